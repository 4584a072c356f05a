"""Optimizer values that make no sense, refused with the field named.

A learning rate must be a finite number >= 0, a loss scale a finite
number > 0, and a count (the step count, the loss-scale counters) an
integer >= 0 that its variable's dtype holds. The package's own optimizers
refuse any other value, at construction and when their state loads from a
file. A Keras optimizer whose state the package reads from a file refuses
a count out of range (Keras alone would wrap -2**62 to 0 in an int32) and
warns about a learning rate out of range, which Keras alone accepts.
"""

import math
import numbers
import warnings

import keras
import numpy as np

# Variable names (an optimizer's `variable.name`) and what each holds.
COUNTS = frozenset(
    (
        "iteration",
        "iterations",
        "step_counter",
        "skipped_steps",
        "nonfinite_steps_in_a_row",
        "nonfinite_gradient_counts",
        "last_nonfinite_gradients",
    )
)
LEARNING_RATES = frozenset(("learning_rate",))
SCALES = frozenset(("dynamic_scale",))


def check_inner_learning_rate(inner_optimizer):
    """Raises if the inner optimizer's learning rate is a number out of range.

    A schedule or a callable is not checked: its values come later.

    Args:
        inner_optimizer: The optimizer a wrapper of this package wraps.

    Raises:
        ValueError: for a learning rate that is not finite or is negative.
    """
    value = getattr(inner_optimizer, "_learning_rate", None)
    if isinstance(value, keras.Variable):
        with warnings.catch_warnings():
            # NumPy 2 warns about the __array__ of TensorFlow's tensors.
            warnings.simplefilter("ignore", DeprecationWarning)
            value = keras.ops.convert_to_numpy(value)
    if isinstance(value, np.ndarray) and value.shape == ():
        value = value.item()
    if isinstance(value, numbers.Real) and not _valid_rate(float(value)):
        raise ValueError(
            "The inner optimizer's `learning_rate` must be a finite number "
            f">= 0. Received: learning_rate={float(value)!r}"
        )


def check_saved(targets, values, strict=True):
    """Checks saved values before they are assigned to `targets`.

    Args:
        targets: The variables the values go to (others, such as
            placeholders for dropped values, are not checked).
        values: The saved arrays, one per target.
        strict: Whether a learning rate out of range is refused (the
            package's own optimizers) or warned about (Keras' optimizers).

    Raises:
        ValueError: for a count out of range or a scale out of range (or,
            with `strict`, a learning rate), naming the variable and the
            value saved.
    """
    for target, value in zip(targets, values, strict=True):
        if not isinstance(target, keras.Variable):
            continue
        name = target.name
        if name in COUNTS:
            _check_count(target, value)
        elif name in SCALES:
            _check_scale(name, value)
        elif name in LEARNING_RATES:
            _check_rate(name, value, strict)


def _check_count(target, value):
    array = np.asarray(value)
    if array.size == 0:
        return
    if array.dtype.kind not in "iu":
        return
    dtype = keras.backend.standardize_dtype(target.dtype)
    low, high = np.iinfo(dtype).min, np.iinfo(dtype).max
    smallest, largest = int(array.min()), int(array.max())
    if smallest < 0 or largest > high or smallest < low:
        shown = smallest if smallest < 0 else largest
        raise ValueError(
            f"The saved optimizer variable `{target.name}` is a count: it "
            f"must be an integer from 0 to {high} ({dtype}). "
            f"Received: {target.name}={shown!r}"
        )


def _check_scale(name, value):
    array = np.asarray(value, dtype="float64")
    if array.size and not (np.isfinite(array).all() and (array > 0).all()):
        raise ValueError(
            f"The saved optimizer variable `{name}` is a loss scale: it must "
            "be a finite number greater than 0. "
            f"Received: {name}={_shown(array)!r}"
        )


def _check_rate(name, value, strict):
    array = np.asarray(value, dtype="float64")
    if not array.size or all(_valid_rate(v) for v in array.ravel()):
        return
    message = (
        f"The saved optimizer variable `{name}` must be a finite number "
        f">= 0. Received: {name}={_shown(array)!r}"
    )
    if strict:
        raise ValueError(message)
    warnings.warn(
        f"{message}. It is loaded as saved, as Keras alone loads it.",
        stacklevel=4,
    )


def _valid_rate(value):
    return math.isfinite(value) and value >= 0


def _shown(array):
    # The first value out of range, as a Python float.
    flat = array.ravel()
    bad = ~np.isfinite(flat) | (flat <= 0)
    return float(flat[bad][0]) if bad.any() else float(flat[0])
