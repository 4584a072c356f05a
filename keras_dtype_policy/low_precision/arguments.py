"""Checks of `LowPrecisionOptimizer`'s arguments."""

import re

import keras

from keras_dtype_policy.low_precision import multi_optimizers
from keras_dtype_policy.low_precision import optimizer_values

UPDATES = ("kahan", "stochastic_rounding", "nearest")
STATE_DTYPES = (None, "float32", "bfloat16", "float16", "8bit", "4bit")


def check_inner_optimizer(inner_optimizer, wrapper_class):
    """Raises unless `inner_optimizer` can go inside `wrapper_class`.

    Args:
        inner_optimizer: The optimizer to wrap.
        wrapper_class: The wrapper's class, which may not wrap itself.
    """
    if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
        raise TypeError(
            "LowPrecisionOptimizer goes inside a LossScaleOptimizer, not "
            "around one: wrap the inner optimizer first, then the result "
            "in the LossScaleOptimizer. "
            f"Received: inner_optimizer={inner_optimizer!r}"
        )
    if multi_optimizers.is_multi_optimizer(inner_optimizer):
        raise TypeError(
            "LowPrecisionOptimizer goes inside a MultiOptimizer, around "
            "each sub-optimizer, not around the MultiOptimizer: it runs one "
            "inner optimizer's step, and a MultiOptimizer has several. "
            "Use MultiOptimizer(OptimizerMap(LowPrecisionOptimizer(...), "
            "{...})); under a low-precision policy, compiling a plain "
            "MultiOptimizer wraps its sub-optimizers. "
            f"Received: inner_optimizer={inner_optimizer!r}"
        )
    if isinstance(inner_optimizer, wrapper_class):
        raise TypeError(
            "`inner_optimizer` is already a LowPrecisionOptimizer. "
            f"Received: inner_optimizer={inner_optimizer!r}"
        )
    if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            "`inner_optimizer` must be a keras.optimizers.Optimizer "
            f"instance. Received: inner_optimizer={inner_optimizer!r} "
            f"(of type {type(inner_optimizer).__name__})"
        )
    optimizer_values.check_inner_learning_rate(inner_optimizer)
    if inner_optimizer.use_ema:
        raise ValueError(
            "LowPrecisionOptimizer does not support an inner optimizer with "
            "`use_ema=True`. Received: inner_optimizer with use_ema=True"
        )
    if inner_optimizer.gradient_accumulation_steps:
        raise ValueError(
            "LowPrecisionOptimizer does not support an inner optimizer with "
            "`gradient_accumulation_steps`. Received: "
            "gradient_accumulation_steps="
            f"{inner_optimizer.gradient_accumulation_steps!r}"
        )
    if inner_optimizer.built:
        raise ValueError(
            "`inner_optimizer` must not be built yet: the wrapper builds it "
            "on float32 views of low-precision weights. "
            f"Received: inner_optimizer={inner_optimizer!r} (built)"
        )


def check_update(update):
    """Returns `update` if it is one of `UPDATES`, else raises."""
    if not isinstance(update, str):
        raise TypeError(
            f"`update` must be one of {', '.join(map(repr, UPDATES))}. "
            f"Received: update={update!r} (of type {type(update).__name__})"
        )
    if update not in UPDATES:
        raise ValueError(
            f"`update` must be one of {', '.join(map(repr, UPDATES))}. "
            f"Received: update={update!r}"
        )
    return update


def check_state_dtype(state_dtype):
    """Returns `state_dtype` standardized: one of `STATE_DTYPES`, or a dict
    from variable-path regexes to them (see `state_dtype_for`)."""
    if isinstance(state_dtype, dict):
        return {
            _check_pattern(key): _check_one_state_dtype(
                value, f"state_dtype[{key!r}]"
            )
            for key, value in state_dtype.items()
        }
    return _check_one_state_dtype(state_dtype, "state_dtype")


def state_dtype_for(state_dtype, path):
    """The state dtype for the variable at `path`.

    Args:
        state_dtype: What `check_state_dtype` returned.
        path: The variable's path (`"embedding/embeddings"`).

    Returns:
        `state_dtype` itself for one dtype; for a dict, the value of its
        first key that is `path` or a regex matching the whole of it (in
        the dict's order, so a last `".*"` is the default), else None.
    """
    if not isinstance(state_dtype, dict):
        return state_dtype
    if path in state_dtype:
        return state_dtype[path]
    for pattern, value in state_dtype.items():
        if re.fullmatch(pattern, path):
            return value
    return None


def _check_pattern(key):
    if not isinstance(key, str):
        raise TypeError(
            "The keys of a `state_dtype` dict are regexes of variable "
            f"paths, as strings. Received: state_dtype key {key!r} "
            f"(of type {type(key).__name__})"
        )
    try:
        re.compile(key)
    except re.error as error:
        raise ValueError(
            "The keys of a `state_dtype` dict are regexes of variable "
            f"paths. Received: state_dtype key {key!r} ({error})"
        ) from None
    return key


def _check_one_state_dtype(state_dtype, argument):
    if state_dtype is None:
        return None
    expected = "None, 'float32', 'bfloat16', 'float16', '8bit' or '4bit'"
    if argument == "state_dtype":
        expected += ", or a dict from variable-path regexes to those"
    if not isinstance(state_dtype, str):
        raise TypeError(
            f"`{argument}` must be {expected}. "
            f"Received: {argument}={state_dtype!r} "
            f"(of type {type(state_dtype).__name__})"
        )
    if state_dtype in ("8bit", "4bit"):
        return state_dtype
    try:
        standard = keras.backend.standardize_dtype(state_dtype)
    except (TypeError, ValueError, AttributeError):
        standard = None
    # None is one of STATE_DTYPES: an unknown name must not pass as it.
    if standard is None or standard not in STATE_DTYPES:
        raise ValueError(
            f"`{argument}` must be {expected}. "
            f"Received: {argument}={state_dtype!r} "
            f"(of type {type(state_dtype).__name__})"
        )
    return standard


def check_seed(seed):
    """Returns `seed` if it is an int or None, else raises."""
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(
            "`seed` must be an int or None. "
            f"Received: seed={seed!r} (of type {type(seed).__name__})"
        )
    return seed
