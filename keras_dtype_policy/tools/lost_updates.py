"""What plain low-precision updates round away, weight by weight.

A weight stored in bfloat16 keeps 8 significant bits: an update smaller
than half a unit in the last place (ulp) of the weight rounds back to the
weight itself and is lost (a weight of 1.0 receiving -1e-4 a step stays
1.0 for ever). `lost_updates` computes one batch's gradients in float32,
turns them into one optimizer step, and counts, for every weight tensor,
the nonzero updates that writing the weight in the low-precision dtype
would round away: those for which `round(w + u) == w`, with `w` the weight
already in that dtype. `docs/low-precision-training.md` explains what to
do about it.
"""

import dataclasses

import keras
import numpy as np

from keras_dtype_policy.policies import rules_application
from keras_dtype_policy.tools import tables
from keras_dtype_policy.tools.gradients import first_samples
from keras_dtype_policy.tools.gradients import weight_gradients
from keras_dtype_policy.tools.rounding import round_to
from keras_dtype_policy.types import Data
from keras_dtype_policy.types import LossFunction

OPTIMIZER_STEPS = ("sgd", "adam")
DTYPES = ("bfloat16", "float16")
# Adam's epsilon, as Keras' Adam has it.
ADAM_EPSILON = 1e-7


@dataclasses.dataclass(frozen=True)
class WeightUpdates:
    """What one weight tensor's updates lose.

    Attributes:
        path: The variable's path, such as `"dense/kernel"`.
        shape: Its shape.
        updates: The number of its nonzero updates.
        lost: The fraction of them the dtype rounds away (0 without
            nonzero updates).
        median_update: The median magnitude of its nonzero updates (0
            without any).
    """

    path: str
    shape: tuple
    updates: int
    lost: float
    median_update: float


@dataclasses.dataclass(frozen=True)
class LostUpdates(tables.RowsReport):
    """The updates of one step that a low-precision dtype rounds away.

    Iterate over it for its `WeightUpdates` rows; `row(path)` finds one.

    Attributes:
        model_name: The model's name.
        dtype: The weights' dtype judged, `"bfloat16"` or `"float16"`.
        optimizer: `"sgd"` or `"adam"`: how a gradient became a step.
        learning_rate: The learning rate of the step.
        rows: One `WeightUpdates` per trainable weight tensor.
    """

    model_name: str
    dtype: str
    optimizer: str
    learning_rate: float
    rows: tuple

    @property
    def lost(self):
        """The fraction of all nonzero updates that are rounded away."""
        total = sum(row.updates for row in self.rows)
        if not total:
            return 0.0
        return sum(row.lost * row.updates for row in self.rows) / total

    def row(self, path):
        """Returns the `WeightUpdates` of the variable at `path`."""
        for row in self.rows:
            if row.path == path:
                return row
        raise KeyError(f"No trainable weight at {path!r}")

    def to_dict(self):
        """Returns the result as a JSON-serializable dict."""
        return {
            "model": self.model_name,
            "dtype": self.dtype,
            "optimizer": self.optimizer,
            "learning_rate": self.learning_rate,
            "lost": self.lost,
            "weights": [dataclasses.asdict(row) for row in self.rows],
        }

    def format(self):
        """Returns the result as lines of text."""
        rows = [
            (
                row.path,
                "x".join(str(d) for d in row.shape) or "scalar",
                f"{row.median_update:.2e}",
                f"{100 * row.lost:.1f}%",
            )
            for row in self.rows
        ]
        lines = [
            f"Updates of one {self.optimizer} step (learning rate "
            f"{self.learning_rate:g}) of {self.model_name} that {self.dtype} "
            "weights round away",
            "",
            *tables.format_table(
                ("weight", "shape", "median |update|", "lost"),
                rows,
                align="llrr",
            ),
            "",
            f"lost in all: {100 * self.lost:.1f}% of the nonzero updates",
        ]
        if self.lost > 0:
            lines.append(
                "compensated updates keep them: kdp.LowPrecisionOptimizer "
                "(docs/low-precision-training.md)"
            )
        return lines


def lost_updates(
    model: keras.Model,
    x: Data,
    y: Data,
    learning_rate: float = 1e-3,
    optimizer: str = "adam",
    dtype: str = "bfloat16",
    loss: LossFunction | None = None,
    batch_size: int = 32,
) -> LostUpdates:
    """Counts the updates of one step that low-precision weights lose.

    The gradients of the loss on the first `batch_size` samples are
    computed in float32 (on a float32 copy of the model, whatever its
    policy). One optimizer step turns them into updates: `"sgd"` takes
    `-learning_rate * gradient`; `"adam"` takes Adam's first step,
    `-learning_rate * g / (|g| + epsilon)`, about the learning rate in
    size, as Adam's steps stay once its moments settle. An update is lost
    where the weight, rounded to `dtype`, does not change when the update
    is added and the sum rounded to `dtype` again.

    Args:
        model: A built functional or Sequential `keras.Model`.
        x: Inputs (an array, or a list or dict for several inputs).
        y: Labels for `x`.
        learning_rate: The step's learning rate, a number above 0.
        optimizer: `"adam"` or `"sgd"`.
        dtype: The weights' dtype to judge: `"bfloat16"` or `"float16"`.
        loss: The loss (a name or a `keras.losses.Loss`); the model's
            compiled loss if None.
        batch_size: How many samples the gradient takes.

    Returns:
        A `LostUpdates`.

    Example:

    >>> result = keras_dtype_policy.lost_updates(
    ...     model, x, y, learning_rate=1e-4)  # doctest: +SKIP
    >>> print(result)  # doctest: +SKIP
    """
    _check_arguments(model, learning_rate, optimizer, dtype, batch_size)
    loss = _gradient_loss(model, y, loss)
    reference = rules_application.apply_rules(model, "float32", False)
    gradients = weight_gradients(
        reference,
        first_samples(x, batch_size),
        first_samples(y, batch_size),
        loss,
    )
    return LostUpdates(
        model_name=model.name,
        dtype=dtype,
        optimizer=optimizer,
        learning_rate=float(learning_rate),
        rows=_weight_rows(
            reference, gradients, learning_rate, optimizer, dtype
        ),
    )


def _weight_rows(reference, gradients, learning_rate, optimizer, dtype):
    """A `WeightUpdates` per trainable variable of `reference`."""
    return tuple(
        weight_row(
            variable.path,
            np.asarray(keras.ops.convert_to_numpy(variable.value), "float64"),
            step(gradients[id(variable)], learning_rate, optimizer),
            dtype,
        )
        for variable in reference.trainable_variables
    )


def _gradient_loss(model, y, loss):
    """The loss of the gradients: `loss`, else the model's compiled one."""
    if y is None:
        raise ValueError(
            "lost_updates needs labels to compute gradients. Received: y=None"
        )
    if loss is None and getattr(model, "compiled", False):
        loss = getattr(model, "loss", None)
    if loss is None:
        raise ValueError(
            "lost_updates needs a loss: compile the model or pass `loss`. "
            "Received: loss=None"
        )
    return loss


def step(gradient, learning_rate, optimizer):
    """Returns the updates of one step of `optimizer` from `gradient`."""
    gradient = np.asarray(gradient, "float64")
    if optimizer == "sgd":
        return -learning_rate * gradient
    return -learning_rate * gradient / (np.abs(gradient) + ADAM_EPSILON)


def lost_mask(weight, update, dtype):
    """Returns where `update` leaves `weight`, written in `dtype`, as it is.

    Args:
        weight: The weights, float64 NumPy values.
        update: The updates, of the same shape.
        dtype: `"bfloat16"` or `"float16"`.

    Returns:
        A boolean array: True where the update is nonzero and lost.
    """
    stored = round_to(weight, dtype)
    updated = round_to(stored + update, dtype)
    return (update != 0) & (updated == stored)


def weight_row(path, weight, update, dtype):
    """Returns the `WeightUpdates` of one weight tensor."""
    nonzero = update != 0
    count = int(np.count_nonzero(nonzero))
    lost = lost_mask(weight, update, dtype)
    return WeightUpdates(
        path=path,
        shape=tuple(int(d) for d in weight.shape),
        updates=count,
        lost=float(np.count_nonzero(lost)) / count if count else 0.0,
        median_update=float(np.median(np.abs(update[nonzero])))
        if count
        else 0.0,
    )


def _check_arguments(model, learning_rate, optimizer, dtype, batch_size):
    if not isinstance(model, keras.Model):
        raise TypeError(
            "`model` must be a keras.Model. Received: "
            f"model={model!r} (of type {type(model).__name__})"
        )
    if (
        isinstance(learning_rate, bool)
        or not isinstance(learning_rate, (int, float))
        or not learning_rate > 0
    ):
        raise ValueError(
            "`learning_rate` must be a number above 0. Received: "
            f"learning_rate={learning_rate!r} (of type "
            f"{type(learning_rate).__name__})"
        )
    if optimizer not in OPTIMIZER_STEPS:
        raise ValueError(
            f"`optimizer` must be one of {OPTIMIZER_STEPS}. Received: "
            f"optimizer={optimizer!r} (of type {type(optimizer).__name__})"
        )
    if dtype not in DTYPES:
        raise ValueError(
            f"`dtype` must be one of {DTYPES}. Received: dtype={dtype!r} "
            f"(of type {type(dtype).__name__})"
        )
    if (
        isinstance(batch_size, bool)
        or not isinstance(batch_size, int)
        or batch_size < 1
    ):
        raise ValueError(
            "`batch_size` must be a positive integer. Received: "
            f"batch_size={batch_size!r} (of type {type(batch_size).__name__})"
        )
