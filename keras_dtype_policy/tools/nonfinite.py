"""`find_nonfinite`: which layer (or gradient) of a model first goes inf/NaN.

One batch runs through the model with every layer's `call` recorded (the
leaves of nested models and subclassed layers too, found by their paths
in the model). The first layer, in the order the layers return, whose
output holds a NaN or Inf, or a value beyond what its compute dtype holds
(65504 for float16), is named with the range of values it produced. With
labels, the gradient of the loss is taken too (through the backend's own
autodiff, at an optional loss scale) and the variables whose gradients are
not finite are named.
"""

import dataclasses

import keras
import numpy as np

from keras_dtype_policy.policies import layer_walk
from keras_dtype_policy.tools import layer_recorder
from keras_dtype_policy.tools.float_tensors import float_tensors
from keras_dtype_policy.tools.gradients import gradients
from keras_dtype_policy.types import Data
from keras_dtype_policy.types import LossFunction


@dataclasses.dataclass
class ValueRange:
    """The values one layer output, or one gradient, held.

    Attributes:
        path: The layer's path in the model (`"encoder/dense_1"`), or the
            variable's path (`"dense_1/kernel"`).
        dtype: The layer's compute dtype, or the gradient's dtype.
        size: How many values.
        nan_count: How many are NaN.
        inf_count: How many are +/-Inf.
        overflow_count: How many are finite but beyond the largest value
            of `dtype` (only a layer that outputs a wider dtype than it
            computes in has such values).
        min_abs: The smallest absolute finite value (None if none).
        max_abs: The largest absolute finite value (None if none).
    """

    path: str
    dtype: str
    size: int
    nan_count: int
    inf_count: int
    overflow_count: int
    min_abs: float
    max_abs: float

    @property
    def finite(self):
        """Whether every value is finite and fits `dtype`."""
        return not (self.nan_count or self.inf_count or self.overflow_count)

    def __str__(self):
        parts = []
        if self.nan_count:
            parts.append(f"{self.nan_count} NaN")
        if self.inf_count:
            parts.append(f"{self.inf_count} Inf")
        if self.overflow_count:
            parts.append(f"{self.overflow_count} beyond the {self.dtype} max")
        found = ", ".join(parts) or "all finite"
        if self.max_abs is None:
            span = "no finite value"
        else:
            span = f"finite |x| in [{self.min_abs:.3g}, {self.max_abs:.3g}]"
        return (
            f"{self.path} ({self.dtype}): {found} of {self.size} values; {span}"
        )


@dataclasses.dataclass
class NonfiniteReport:
    """What `find_nonfinite` found.

    False in a boolean context when everything was finite, so
    `if kdp.find_nonfinite(model, x): ...` reads as "if something
    overflowed".

    Attributes:
        layer: The first layer whose output was not finite or overflowed
            its compute dtype (a `ValueRange`), or None.
        inputs_finite: Whether the batch itself was finite. If not, the
            first layer is not to blame.
        gradients: The variables whose gradients were not finite (one
            `ValueRange` each, in the model's order of trainable
            variables); empty without labels or when all were finite.
        checked_gradients: Whether gradients were checked (labels given).
    """

    layer: ValueRange | None = None
    inputs_finite: bool = True
    gradients: list = dataclasses.field(default_factory=list)
    checked_gradients: bool = False

    @property
    def all_finite(self):
        """True when the inputs, every layer output and every checked
        gradient were finite."""
        return self.layer is None and self.inputs_finite and not self.gradients

    def __bool__(self):
        return not self.all_finite

    def __str__(self):
        checked = (
            "inputs, layer outputs or gradients"
            if self.checked_gradients
            else "inputs or layer outputs"
        )
        if self.all_finite:
            return f"All finite: no NaN, Inf or overflow in the {checked}."
        lines = []
        if not self.inputs_finite:
            lines.append("The input batch itself holds NaN or Inf.")
        if self.layer is not None:
            lines.append(f"First non-finite layer output: {self.layer}")
        if self.gradients:
            lines.append("Non-finite gradients:")
            lines.extend(f"  {g}" for g in self.gradients)
        return "\n".join(lines)

    def __repr__(self):
        if self.all_finite:
            return "NonfiniteReport(all finite)"
        layer = None if self.layer is None else self.layer.path
        paths = [g.path for g in self.gradients]
        return (
            f"NonfiniteReport(layer={layer!r}, gradients={paths!r}, "
            f"inputs_finite={self.inputs_finite})"
        )


def find_nonfinite(
    model: keras.Model,
    x: Data,
    y: Data = None,
    loss: LossFunction | None = None,
    loss_scale: float = 1.0,
) -> NonfiniteReport:
    """Names the first layer (and the gradients) that go inf or NaN.

    Runs `model` once on the batch `x` (`training=False`), recording the
    output of every layer in the order they return, nested layers first.
    Then, with labels, takes the gradient of the loss times `loss_scale`
    with respect to the trainable variables.

    Args:
        model: A built `keras.Model`: functional, Sequential or
            subclassed.
        x: One batch of inputs, as `model` takes them.
        y: Optional labels for `x`, to check the gradients too.
        loss: The loss for the gradients: a name, a function or a
            `keras.losses.Loss`. Defaults to the model's compiled loss.
        loss_scale: A number the loss is multiplied by before
            differentiating, as a `LossScaleOptimizer` does (`2**15` to see
            what its first step sees). Defaults to 1.

    Returns:
        A `NonfiniteReport`; false in a boolean context when all was
        finite.

    Example:

    >>> report = keras_dtype_policy.find_nonfinite(model, x)
    >>> print(report)
    All finite: no NaN, Inf or overflow in the inputs or layer outputs.
    """
    _check_arguments(model, loss_scale)
    if y is not None:
        loss = _loss_function(model, loss)
    x = keras.tree.map_structure(keras.ops.convert_to_tensor, x)
    report = NonfiniteReport(inputs_finite=_all_finite(x))
    report.layer = _first_nonfinite_layer(model, x)
    if y is not None:
        report.checked_gradients = True
        y = keras.tree.map_structure(keras.ops.convert_to_tensor, y)
        report.gradients = _nonfinite_gradients(model, x, y, loss, loss_scale)
    return report


def _check_arguments(model, loss_scale):
    """Raises for a `model` or a `loss_scale` `find_nonfinite` cannot take."""
    if not isinstance(model, keras.Model):
        raise TypeError(
            "`model` must be a keras.Model. "
            f"Received: model={model!r} (of type {type(model).__name__})"
        )
    if isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float)):
        raise TypeError(
            "`loss_scale` must be a number. Received: "
            f"loss_scale={loss_scale!r} (of type {type(loss_scale).__name__})"
        )
    if not np.isfinite(loss_scale) or loss_scale <= 0:
        raise ValueError(
            "`loss_scale` must be a finite number greater than 0. "
            f"Received: loss_scale={loss_scale!r}"
        )


def _first_nonfinite_layer(model, x):
    """The `ValueRange` of the first layer output that is not finite (or
    overflows its compute dtype), in the order layers return; or None."""
    records = []

    def record(path, layer, args, kwargs, result):
        records.append((path, layer, float_tensors(result)))

    with layer_recorder.recording(layer_walk.layer_paths(model), record):
        model(x, training=False)
    for path, layer, outputs in records:
        found = _value_range(path, _compute_dtype(layer), outputs)
        if found is not None and not found.finite:
            return found
    return None


def _nonfinite_gradients(model, x, y, loss, loss_scale):
    """A `ValueRange` per trainable variable whose gradient is not finite."""
    variables = model.trainable_variables
    grads = _gradients(model, x, y, loss, float(loss_scale))
    found = []
    for variable, grad in zip(variables, grads, strict=True):
        if grad is None:
            continue
        dtype = keras.backend.standardize_dtype(grad.dtype)
        value_range = _value_range(variable.path, dtype, [grad])
        if not value_range.finite:
            found.append(value_range)
    return found


def _loss_function(model, loss):
    loss = loss if loss is not None else getattr(model, "loss", None)
    if loss is None:
        raise ValueError(
            "With labels, `find_nonfinite` needs a loss: pass `loss=` or "
            "compile the model first. Received: loss=None"
        )
    if isinstance(loss, str):
        return keras.losses.get(loss)
    if callable(loss):
        return loss
    raise TypeError(
        "`loss` must be a loss name, a function or a keras.losses.Loss. "
        f"Received: loss={loss!r} (of type {type(loss).__name__})"
    )


def _compute_dtype(layer):
    policy = getattr(layer, "dtype_policy", None)
    return getattr(policy, "compute_dtype", None) or "float32"


def _all_finite(structure):
    values = float_tensors(structure)
    return all(np.isfinite(_numpy(v)).all() for v in values)


def _numpy(value):
    return np.asarray(keras.ops.convert_to_numpy(value))


def _value_range(path, dtype, tensors):
    """A `ValueRange` over `tensors`, or None if there are none."""
    if not tensors:
        return None
    values = np.concatenate(
        [_numpy(t).astype("float64").reshape(-1) for t in tensors]
    )
    finite = values[np.isfinite(values)]
    magnitudes = np.abs(finite)
    limit = _largest(dtype)
    return ValueRange(
        path=path,
        dtype=dtype,
        size=int(values.size),
        nan_count=int(np.isnan(values).sum()),
        inf_count=int(np.isinf(values).sum()),
        overflow_count=int((magnitudes > limit).sum()),
        min_abs=float(magnitudes.min()) if magnitudes.size else None,
        max_abs=float(magnitudes.max()) if magnitudes.size else None,
    )


def _largest(dtype):
    try:
        import ml_dtypes

        return float(ml_dtypes.finfo(dtype).max)
    except (ImportError, TypeError, ValueError):
        return float(np.finfo(np.float64).max)


def _gradients(model, x, y, loss, scale):
    """The gradients of `mean(loss(y, model(x))) * scale` with respect to
    the model's trainable variables, on each backend's own autodiff."""

    def scaled_loss(y_pred):
        value = keras.ops.mean(loss(y, y_pred))
        return keras.ops.multiply(keras.ops.cast(value, "float32"), scale)

    return gradients(model, scaled_loss, x, "`find_nonfinite` takes")
