"""Bytes of weights and optimizer state a parameter: the arithmetic, and
what a live `LowPrecisionOptimizer` holds.

A parameter trained with Adam holds its weight and two moments; a
`"kahan"` update adds a compensation buffer of the weight's dtype, and
8-bit (4-bit) state stores each moment as one byte (half a byte) a
parameter plus a float32 scale a block of 256 (128) parameters.
"""

import re

import keras
import numpy as np

from keras_dtype_policy.low_precision import block_codes
from keras_dtype_policy.low_precision import quantized_slots
from keras_dtype_policy.low_precision.optimizer import LowPrecisionOptimizer

# Adam's slots a parameter: the first and the second moment.
ADAM_SLOTS = 2


def slot_bytes(state_dtype, weight_dtype):
    """Bytes one optimizer slot takes a parameter.

    Args:
        state_dtype: `"8bit"`, `"4bit"`, a float dtype, or None for the
            weight's own dtype.
        weight_dtype: The weight's dtype, such as `"bfloat16"`.

    Example:

    >>> slot_bytes("8bit", "bfloat16")
    1.015625
    """
    bits = quantized_slots.quantized_bits(state_dtype)
    if bits is not None:
        return bits / 8 + 4 / block_codes.BLOCKS[bits]
    return _dtype_bytes(state_dtype or weight_dtype)


def adam_bytes_per_parameter(weight_dtype, update=None, state_dtype=None):
    """Bytes of weight, compensation and Adam's state a parameter.

    Args:
        weight_dtype: The weights' dtype, such as `"bfloat16"`.
        update: `"kahan"` (a compensation buffer of the weight's dtype),
            `"stochastic_rounding"`, or None for Keras' own update.
        state_dtype: As `LowPrecisionOptimizer` takes it; None for the
            weight's dtype.

    Example:

    >>> adam_bytes_per_parameter("float32")  # mixed_bfloat16
    12.0
    >>> round(adam_bytes_per_parameter("bfloat16", "kahan", "8bit"), 2)
    6.03
    """
    weight = _dtype_bytes(weight_dtype)
    compensation = weight if update == "kahan" and weight < 4 else 0
    state = ADAM_SLOTS * slot_bytes(state_dtype, weight_dtype)
    return float(weight + compensation + state)


def low_precision_state(optimizer, parameters):
    """Describes the state of a live `LowPrecisionOptimizer`, or None.

    Args:
        optimizer: A model's optimizer (a `LossScaleOptimizer` around a
            `LowPrecisionOptimizer` included).
        parameters: How many trainable parameters the model has.

    Returns:
        None where no `LowPrecisionOptimizer` is found, else a dict:
        `update`, `state_dtype` (`"8bit"`, `"4bit"`, a dtype, or None for
        each weight's), `quantized_slots` (how many slots are stored as
        codes) and `state_bytes_per_parameter` (every variable of the
        optimizer, codes, scales and compensation buffers included, over
        the parameters; None before the optimizer is built).
    """
    wrapper = optimizer
    while wrapper is not None and not isinstance(
        wrapper, LowPrecisionOptimizer
    ):
        wrapper = getattr(wrapper, "inner_optimizer", None)
    if wrapper is None:
        return None
    quantized = wrapper.quantized_slots
    state_bytes = None
    if wrapper.built and parameters:
        state_bytes = variable_bytes(optimizer) / parameters
    return {
        "update": wrapper.update_rule,
        "state_dtype": wrapper.state_dtype,
        "quantized_slots": len(quantized),
        "state_bytes_per_parameter": state_bytes,
    }


def variable_bytes(optimizer):
    """Bytes of the variables of an optimizer and the optimizers inside it,
    each once (a quantized slot's are its codes and scales)."""
    seen = {}
    while optimizer is not None:
        for variable in optimizer.variables:
            seen[id(variable)] = variable
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return sum(
        int(np.prod(v.shape, dtype=np.int64)) * _dtype_bytes(v.dtype)
        for v in seen.values()
    )


def _dtype_bytes(dtype):
    name = keras.backend.standardize_dtype(dtype)
    bits = re.search(r"(\d+)$", name)
    return int(bits.group(1)) // 8 if bits else 1
