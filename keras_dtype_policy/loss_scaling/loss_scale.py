"""Loss-scale values of the tf.keras API: fixed, dynamic, or none.

A loss scale says how `Model.compile` scales the loss of a float16 model.
Its settings never change; the `LossScaleOptimizer` carries out what they
describe. As TensorFlow's loss-scale objects did, each also holds a current
scale of its own, read by calling it and moved by `update(grads)`, for code
that drives one by hand.
"""

import numbers
from typing import Any

import numpy as np
from keras import ops

from keras_dtype_policy.loss_scaling import scale_rule
from keras_dtype_policy.policies.validation import check_positive_int
from keras_dtype_policy.policies.validation import check_positive_number
from keras_dtype_policy.types import Tensor

# The largest finite float32: a scale above it would read as inf.
_FLOAT32_MAX = float(np.finfo(np.float32).max)


class LossScale:
    """Base class of the loss-scale values. Not used directly."""

    dynamic = False

    @property
    def initial_scale(self) -> float:
        """The scale the loss is multiplied by at the first step."""
        raise NotImplementedError

    def __call__(self):
        """Returns the current scale, a float32 scalar tensor."""
        return ops.convert_to_tensor(self._current, dtype="float32")

    def update(self, grads: list[Tensor | None]) -> tuple[None, Tensor]:
        """Moves the current scale after one step's gradients.

        Eager only: the gradients must hold concrete values.

        Args:
            grads: A list of gradients (None entries are ignored).

        Returns:
            A pair `(None, should_apply)`: `should_apply` is a boolean
            tensor, True if every gradient is finite.
        """
        finite = all(
            bool(ops.all(ops.isfinite(g))) for g in grads if g is not None
        )
        self._step(finite)
        return None, ops.convert_to_tensor(finite)

    def _step(self, finite):
        pass

    def get_config(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "LossScale":
        if not isinstance(config, dict):
            raise TypeError(
                f"A {cls.__name__} config must be a dict. "
                f"Received: config={config!r}"
            )
        try:
            return cls(**config)
        except TypeError as error:
            raise ValueError(
                f"Invalid {cls.__name__} config: {error}. "
                f"Received: config={config!r}"
            ) from None

    def __eq__(self, other):
        if type(other) is not type(self):
            return NotImplemented
        return self.get_config() == other.get_config()

    def __hash__(self):
        return hash((type(self).__name__, tuple(self.get_config().items())))

    def __repr__(self):
        arguments = ", ".join(
            f"{k}={v!r}" for k, v in self.get_config().items()
        )
        return f"{type(self).__name__}({arguments})"


class FixedLossScale(LossScale):
    """A loss scale that never changes.

    Args:
        loss_scale_value: The scale, a finite number greater than zero.

    Example:

    >>> FixedLossScale(1024).initial_scale
    1024.0
    """

    def __init__(self, loss_scale_value: float) -> None:
        if isinstance(loss_scale_value, bool) or not isinstance(
            loss_scale_value, numbers.Real
        ):
            # TensorFlow's wording and error type.
            raise ValueError(
                "loss_scale_value must be a Python int or float. "
                f"Received: loss_scale_value={loss_scale_value!r} "
                f"(of type {type(loss_scale_value).__name__})"
            )
        self._value: float = check_positive_number(
            "loss_scale_value", loss_scale_value
        )
        self._current = self._value

    @property
    def initial_scale(self) -> float:
        return self._value

    @property
    def initial_loss_scale(self) -> float:
        """The scale, as tf.keras named it for every loss scale."""
        return self._value

    def update(self, grads: list[Tensor | None]) -> tuple[None, Tensor]:
        """Returns `(None, True)`, as TensorFlow's `FixedLossScale` did.

        A fixed scale never moves, and neither checks `grads` nor ever asks
        to skip a step (a `LossScaleOptimizer` with a fixed scale does).
        """
        del grads
        return None, True

    def get_config(self) -> dict[str, Any]:
        return {"loss_scale_value": self._value}


class DynamicLossScale(LossScale):
    """A loss scale that adapts to the gradients.

    A step with a non-finite gradient is skipped; the `hysteresis`-th such
    step in a row (and each one after it, until a finite step) divides the
    scale by `multiplier`. After `increment_period` finite steps in a row
    the scale is multiplied by `multiplier`.

    Args:
        initial_loss_scale: The first scale, a finite number greater than
            zero. Defaults to `2**15`.
        increment_period: The number of finite steps in a row after which
            the scale grows. Defaults to `2000`.
        multiplier: The factor the scale grows and shrinks by, greater than
            one. Defaults to `2.0`.
        hysteresis: How many non-finite steps in a row lower the scale, at
            least 1, as DeepSpeed's `hysteresis` with
            `consecutive_hysteresis=True`. Defaults to `1`, tf.keras' rule
            (and then the config is tf.keras' own, without this key).
    """

    dynamic = True

    def __init__(
        self,
        initial_loss_scale: float = 2.0**15,
        increment_period: int = 2000,
        multiplier: float = 2.0,
        hysteresis: int = 1,
    ) -> None:
        self._initial = check_positive_number(
            "initial_loss_scale", initial_loss_scale
        )
        self.increment_period = check_positive_int(
            "increment_period", increment_period
        )
        self.multiplier = check_positive_number("multiplier", multiplier)
        if self.multiplier <= 1.0:
            raise ValueError(
                "`multiplier` must be greater than 1. "
                f"Received: multiplier={multiplier!r}"
            )
        self.hysteresis = check_positive_int("hysteresis", hysteresis)
        self._current = self._initial
        self._counter = 0
        self._nonfinite_in_a_row = 0

    @property
    def initial_scale(self) -> float:
        return self._initial

    @property
    def initial_loss_scale(self) -> float:
        """The first scale, under tf.keras' name."""
        return self._initial

    def _step(self, finite):
        # TensorFlow's rule: grow after `increment_period` finite steps
        # (not above float32's largest value, the scale's dtype), shrink
        # (not below 1) after `hysteresis` bad steps in a row.
        scale, counter, streak = scale_rule.next_scale_state(
            self._current,
            self._counter,
            self._nonfinite_in_a_row,
            finite,
            growth_steps=self.increment_period,
            hysteresis=self.hysteresis,
            growth_factor=self.multiplier,
            backoff_factor=1.0 / self.multiplier,
            min_scale=1.0,
            max_scale=_FLOAT32_MAX,
        )
        scale = float(ops.convert_to_numpy(scale))
        # A scale that did not change keeps its Python value.
        if scale != float(np.float32(self._current)):
            self._current = scale
        self._counter = int(ops.convert_to_numpy(counter))
        self._nonfinite_in_a_row = int(ops.convert_to_numpy(streak))

    def get_config(self) -> dict[str, Any]:
        config = {
            "initial_loss_scale": self._initial,
            "increment_period": self.increment_period,
            "multiplier": self.multiplier,
        }
        if self.hysteresis != 1:
            config["hysteresis"] = self.hysteresis
        return config


_CLASSES = {cls.__name__: cls for cls in (FixedLossScale, DynamicLossScale)}


def get_loss_scale(
    loss_scale: float | str | LossScale | dict[str, Any] | None,
) -> LossScale | None:
    """Turns a loss-scale spec into a loss-scale value, or None.

    Args:
        loss_scale: One of: a number, for a `FixedLossScale`; `"dynamic"`,
            for a `DynamicLossScale` with its defaults; `None`, for no loss
            scaling; a `LossScale` value, returned as it is; or a serialized
            loss scale, `{"class_name": "FixedLossScale", "config": {...}}`.

    Returns:
        A `LossScale`, or None.

    Raises:
        TypeError: if `loss_scale` is of no accepted type.
        ValueError: if `loss_scale` has an accepted type but a bad value.

    Example:

    >>> get_loss_scale(1024)
    FixedLossScale(loss_scale_value=1024.0)
    >>> get_loss_scale("dynamic")
    DynamicLossScale(initial_loss_scale=32768.0, increment_period=2000, \
multiplier=2.0)
    """
    if loss_scale is None or isinstance(loss_scale, LossScale):
        return loss_scale
    if isinstance(loss_scale, str):
        if loss_scale == "dynamic":
            return DynamicLossScale()
        raise ValueError(
            "`loss_scale` must be a number, 'dynamic', None, a LossScale or "
            f"a serialized LossScale. Received: loss_scale={loss_scale!r}"
        )
    if isinstance(loss_scale, numbers.Real) and not isinstance(
        loss_scale, bool
    ):
        return FixedLossScale(check_positive_number("loss_scale", loss_scale))
    if isinstance(loss_scale, dict):
        return deserialize_loss_scale(loss_scale)
    raise TypeError(
        "`loss_scale` must be a number, 'dynamic', None, a LossScale or a "
        f"serialized LossScale. Received: loss_scale={loss_scale!r} "
        f"(of type {type(loss_scale).__name__})"
    )


def serialize_loss_scale(loss_scale):
    """Returns the tf.keras form `{"class_name": ..., "config": ...}`."""
    if loss_scale is None:
        return None
    return {
        "class_name": type(loss_scale).__name__,
        "config": loss_scale.get_config(),
    }


def deserialize_loss_scale(config):
    """Builds a loss scale from its tf.keras serialized form.

    Only the two loss-scale classes of this module can be named: the
    `module` key of the config, if any, is never imported.
    """
    class_name = config.get("class_name")
    inner_config = config.get("config", {})
    if class_name not in _CLASSES:
        raise ValueError(
            "A serialized loss scale must have class_name 'FixedLossScale' "
            f"or 'DynamicLossScale'. Received: loss_scale={config!r}"
        )
    return _CLASSES[class_name].from_config(inner_config)
