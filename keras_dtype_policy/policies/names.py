"""Parsing of dtype policy names into compute and variable dtypes."""

import keras

MIXED_POLICIES = {
    "mixed_float16": ("float16", "float32"),
    "mixed_bfloat16": ("bfloat16", "float32"),
}

# Policies whose bfloat16 or float16 weights are trained with updates that
# are not rounded away: the compile hook wraps the optimizer of a model with
# one of them in a `LowPrecisionOptimizer` with this `update` and
# `state_dtype` (None: the compile hook's default for the weight dtype).
LOW_PRECISION_UPDATE_POLICIES = {
    "kahan_bfloat16": ("bfloat16", "kahan", None),
    "stochastic_bfloat16": ("bfloat16", "stochastic_rounding", None),
    "kahan_float16": ("float16", "kahan", None),
    "stochastic_float16": ("float16", "stochastic_rounding", None),
    # The same with 8-bit block-wise optimizer state.
    "kahan_bfloat16_8bit": ("bfloat16", "kahan", "8bit"),
    "stochastic_bfloat16_8bit": ("bfloat16", "stochastic_rounding", "8bit"),
    "kahan_float16_8bit": ("float16", "kahan", "8bit"),
    "stochastic_float16_8bit": ("float16", "stochastic_rounding", "8bit"),
    # The same with 4-bit block-wise optimizer state.
    "kahan_bfloat16_4bit": ("bfloat16", "kahan", "4bit"),
    "stochastic_bfloat16_4bit": ("bfloat16", "stochastic_rounding", "4bit"),
    "kahan_float16_4bit": ("float16", "kahan", "4bit"),
    "stochastic_float16_4bit": ("float16", "stochastic_rounding", "4bit"),
}

# Names that tf.keras 2.0 removed, with the policy that replaced them.
REMOVED_POLICIES = {
    "float16_with_float32_vars": "mixed_float16",
    "bfloat16_with_float32_vars": "mixed_bfloat16",
    "float32_with_float32_vars": "float32",
    "float64_with_float32_vars": "float64",
}

ACCEPTED_FORMS = (
    "'mixed_float16', 'mixed_bfloat16', 'kahan_bfloat16', "
    "'stochastic_bfloat16', 'kahan_float16', 'stochastic_float16' (each "
    "also with '_8bit' or '_4bit' optimizer state, such as "
    "'stochastic_bfloat16_8bit'), or a dtype name such as "
    "'float32', 'float16', 'bfloat16', 'float64', 'int32' or 'bool'"
)


def parse_policy_name(name):
    """Returns the `(compute_dtype, variable_dtype)` pair a name stands for.

    Args:
        name: A policy name: `"mixed_float16"`, `"mixed_bfloat16"`, one of
            `LOW_PRECISION_UPDATE_POLICIES` (such as `"kahan_bfloat16"`:
            bfloat16 compute and weights) or a dtype name that Keras
            accepts, such as `"float32"` or `"bfloat16"`.

    Returns:
        A tuple of two dtype strings.

    Raises:
        TypeError: if `name` is not a string.
        ValueError: if `name` is not a known policy name.
    """
    if not isinstance(name, str):
        # Keras' own wording first: code and tests match on it.
        raise TypeError(
            "'name' must be a string, such as 'mixed_float16'. "
            f"Received: name={name!r} (of type {type(name).__name__})"
        )
    if name in MIXED_POLICIES:
        return MIXED_POLICIES[name]
    if name in LOW_PRECISION_UPDATE_POLICIES:
        dtype = LOW_PRECISION_UPDATE_POLICIES[name][0]
        return dtype, dtype
    if name in REMOVED_POLICIES:
        raise ValueError(
            f"The dtype policy {name!r} was removed in TensorFlow 2.0. Use "
            f"{REMOVED_POLICIES[name]!r} instead. Received: name={name!r}"
        )
    try:
        dtype = keras.backend.standardize_dtype(name)
    except (TypeError, ValueError):
        dtype = None
    if dtype is None:
        raise ValueError(
            f"Cannot convert {name!r} to a mixed precision DTypePolicy. "
            f"Expected {ACCEPTED_FORMS}. Received: name={name!r}"
        )
    return dtype, dtype
