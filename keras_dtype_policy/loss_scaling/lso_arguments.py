"""The checks of `LossScaleOptimizer`'s arguments, with tf.keras' rules."""

import keras

from keras_dtype_policy.low_precision import optimizer_values
from keras_dtype_policy.policies.validation import check_positive_int
from keras_dtype_policy.policies.validation import check_positive_number


def checked(
    inner_optimizer,
    *,
    dynamic,
    initial_scale,
    dynamic_growth_steps,
    growth_factor,
    backoff_factor,
    min_scale,
    max_scale,
    hysteresis,
):
    """Returns the settings as a dict, defaults filled in by tf.keras' rules.

    Raises:
        TypeError: for an argument of the wrong type.
        ValueError: for an argument out of range, or an inner optimizer
            already wrapped.
    """
    _check_inner_optimizer(inner_optimizer)
    if not isinstance(dynamic, bool):
        # tf.keras' wording first.
        raise TypeError(
            '"dynamic" argument to LossScaleOptimizer.__init__ must be '
            f"a bool, but got: {dynamic!r}. "
            f"Received: dynamic={dynamic!r} "
            f"(of type {type(dynamic).__name__})"
        )
    initial_scale, dynamic_growth_steps = _scale_arguments(
        dynamic, initial_scale, dynamic_growth_steps
    )
    initial_scale = check_positive_number("initial_scale", initial_scale)
    dynamic_growth_steps = check_positive_int(
        "dynamic_growth_steps", dynamic_growth_steps
    )
    growth_factor = check_positive_number("growth_factor", growth_factor)
    if growth_factor <= 1.0:
        raise ValueError(
            "`growth_factor` must be greater than 1. "
            f"Received: growth_factor={growth_factor!r}"
        )
    backoff_factor = check_positive_number("backoff_factor", backoff_factor)
    if backoff_factor >= 1.0:
        raise ValueError(
            "`backoff_factor` must be between 0 and 1. "
            f"Received: backoff_factor={backoff_factor!r}"
        )
    min_scale = check_positive_number("min_scale", min_scale)
    max_scale = check_positive_number("max_scale", max_scale)
    hysteresis = check_positive_int("hysteresis", hysteresis)
    if dynamic and not min_scale <= initial_scale <= max_scale:
        raise ValueError(
            "A dynamic scale needs min_scale <= initial_scale <= "
            f"max_scale. Received: min_scale={min_scale!r}, "
            f"initial_scale={initial_scale!r}, max_scale={max_scale!r}"
        )
    return {
        "initial_scale": initial_scale,
        "dynamic_growth_steps": dynamic_growth_steps,
        "dynamic": dynamic,
        "growth_factor": growth_factor,
        "backoff_factor": backoff_factor,
        "min_scale": min_scale,
        "max_scale": max_scale,
        "hysteresis": hysteresis,
    }


def _check_inner_optimizer(inner_optimizer):
    if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
        # tf.keras' error type and wording first.
        raise TypeError(
            "LossScaleOptimizer cannot wrap another LossScaleOptimizer, but "
            f"got: {inner_optimizer!r}. `inner_optimizer` is already a "
            "loss-scale optimizer; wrap its own inner optimizer instead. "
            f"Received: inner_optimizer={inner_optimizer!r}"
        )
    if getattr(inner_optimizer, "_is_wrapped_by_loss_scale_optimizer", False):
        raise ValueError(
            '"inner_optimizer" is already wrapped by a LossScaleOptimizer. '
            "An optimizer can only be wrapped by a single "
            f"LossScaleOptimizer. Received: inner_optimizer={inner_optimizer!r}"
        )
    if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            "`inner_optimizer` must be a keras.optimizers.Optimizer "
            f"instance. Received: inner_optimizer={inner_optimizer!r} "
            f"(of type {type(inner_optimizer).__name__})"
        )
    optimizer_values.check_inner_learning_rate(inner_optimizer)


def _scale_arguments(dynamic, initial_scale, dynamic_growth_steps):
    """Returns `(initial_scale, dynamic_growth_steps)` by tf.keras' rules."""
    if dynamic:
        if initial_scale is None:
            initial_scale = 2.0**15
        if dynamic_growth_steps is None:
            dynamic_growth_steps = 2000
        return initial_scale, dynamic_growth_steps
    if initial_scale is None:
        raise ValueError(
            '"initial_scale" must be specified if "dynamic" is False. '
            "Received: initial_scale=None"
        )
    if dynamic_growth_steps is not None:
        raise ValueError(
            '"dynamic_growth_steps" must be None if "dynamic" is False, but '
            f"got: {dynamic_growth_steps}. "
            f"Received: dynamic_growth_steps={dynamic_growth_steps!r}"
        )
    # Keras' base class keeps a number; a fixed scale never reads it.
    return initial_scale, 2000
