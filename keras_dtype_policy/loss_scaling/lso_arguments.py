"""The checks of `LossScaleOptimizer`'s arguments, with tf.keras' rules."""

import dataclasses

import keras

from keras_dtype_policy.low_precision import optimizer_values
from keras_dtype_policy.policies.validation import check_positive_int
from keras_dtype_policy.policies.validation import check_positive_number


@dataclasses.dataclass(frozen=True)
class Settings:
    """A `LossScaleOptimizer`'s settings, checked, defaults filled in.

    The fields are the optimizer's arguments of the same names.
    """

    initial_scale: float
    dynamic_growth_steps: int
    dynamic: bool
    growth_factor: float
    backoff_factor: float
    min_scale: float
    max_scale: float
    hysteresis: int


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
    """Returns the `Settings`, defaults filled in by tf.keras' rules.

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
    settings = Settings(
        initial_scale=_initial_scale(dynamic, initial_scale),
        dynamic_growth_steps=_growth_steps(dynamic, dynamic_growth_steps),
        dynamic=dynamic,
        growth_factor=_factor("growth_factor", growth_factor, above_one=True),
        backoff_factor=_factor("backoff_factor", backoff_factor),
        min_scale=check_positive_number("min_scale", min_scale),
        max_scale=check_positive_number("max_scale", max_scale),
        hysteresis=check_positive_int("hysteresis", hysteresis),
    )
    low, high = settings.min_scale, settings.max_scale
    if dynamic and not low <= settings.initial_scale <= high:
        raise ValueError(
            "A dynamic scale needs min_scale <= initial_scale <= "
            f"max_scale. Received: min_scale={settings.min_scale!r}, "
            f"initial_scale={settings.initial_scale!r}, "
            f"max_scale={settings.max_scale!r}"
        )
    return settings


def _factor(name, value, above_one=False):
    """Returns the positive number `value`, checked to be above 1 (a
    growth factor) or below it (a backoff factor)."""
    value = check_positive_number(name, value)
    if above_one and value <= 1.0:
        raise ValueError(
            f"`{name}` must be greater than 1. Received: {name}={value!r}"
        )
    if not above_one and value >= 1.0:
        raise ValueError(
            f"`{name}` must be between 0 and 1. Received: {name}={value!r}"
        )
    return value


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
    if getattr(inner_optimizer, "release_gradients", False) is True:
        raise ValueError(
            "A LossScaleOptimizer cannot wrap an optimizer with "
            "release_gradients=True: loss scaling must see every gradient "
            "(finite or not, to skip the step and lower the scale) before "
            "any variable is updated, and release updates each variable as "
            "its gradient is made. Train float16 weights without release, "
            "or bfloat16 weights (no loss scale) with it. "
            f"Received: inner_optimizer={inner_optimizer!r}"
        )


def _initial_scale(dynamic, initial_scale):
    """Returns the initial scale by tf.keras' rules."""
    if initial_scale is None:
        if not dynamic:
            raise ValueError(
                '"initial_scale" must be specified if "dynamic" is False. '
                "Received: initial_scale=None"
            )
        initial_scale = 2.0**15
    return check_positive_number("initial_scale", initial_scale)


def _growth_steps(dynamic, dynamic_growth_steps):
    """Returns `dynamic_growth_steps` by tf.keras' rules."""
    if not dynamic:
        if dynamic_growth_steps is not None:
            raise ValueError(
                '"dynamic_growth_steps" must be None if "dynamic" is False, '
                f"but got: {dynamic_growth_steps}. "
                f"Received: dynamic_growth_steps={dynamic_growth_steps!r}"
            )
        # Keras' base class keeps a number; a fixed scale never reads it.
        return 2000
    if dynamic_growth_steps is None:
        dynamic_growth_steps = 2000
    return check_positive_int("dynamic_growth_steps", dynamic_growth_steps)
