"""tf.keras' `LossScaleOptimizer` configs, in today's layout.

TensorFlow 2.3 (and tf.keras' `LossScaleOptimizerV1`) saved a loss-scale
optimizer as `{"optimizer": ..., "loss_scale": ...}`, the loss scale being a
serialized `FixedLossScale` or `DynamicLossScale`. tf.keras 2.4 and later
saved `inner_optimizer`, `dynamic`, `initial_scale` and
`dynamic_growth_steps`; Keras 3's own `LossScaleOptimizer` has no `dynamic`.
"""

from keras_dtype_policy.loss_scaling.loss_scale import DynamicLossScale
from keras_dtype_policy.loss_scaling.loss_scale import FixedLossScale
from keras_dtype_policy.loss_scaling.loss_scale import get_loss_scale


def is_tf_2_3_config(config):
    """Returns True for a config with TensorFlow 2.3's keys."""
    return isinstance(config, dict) and (
        "optimizer" in config or "loss_scale" in config
    )


def scale_settings(loss_scale):
    """Returns the `LossScaleOptimizer` arguments that `loss_scale` means.

    Args:
        loss_scale: A loss-scale value (`FixedLossScale` or
            `DynamicLossScale`).

    Returns:
        A dict of `LossScaleOptimizer` keyword arguments.

    Raises:
        TypeError: for a loss scale of another class (tf.keras' rule).
    """
    if not isinstance(loss_scale, (FixedLossScale, DynamicLossScale)):
        # tf.keras' wording first.
        raise TypeError(
            "Passing a LossScale that is not a FixedLossScale or a "
            f"DynamicLossScale is no longer supported. Got: {loss_scale!r}. "
            f"Received: loss_scale={loss_scale!r} "
            f"(of type {type(loss_scale).__name__})"
        )
    if not loss_scale.dynamic:
        return {"dynamic": False, "initial_scale": loss_scale.initial_scale}
    settings = {
        "dynamic": True,
        "initial_scale": loss_scale.initial_scale,
        "dynamic_growth_steps": loss_scale.increment_period,
        "min_scale": min(1.0, loss_scale.initial_scale),
        "max_scale": max(2.0**24, loss_scale.initial_scale),
    }
    if getattr(loss_scale, "hysteresis", 1) != 1:
        settings["hysteresis"] = loss_scale.hysteresis
    if loss_scale.multiplier != 2.0:
        settings["growth_factor"] = loss_scale.multiplier
        settings["backoff_factor"] = 1.0 / loss_scale.multiplier
    return settings


def from_tf_2_3(config):
    """Returns a copy of `config` with today's keys.

    A config without TensorFlow 2.3's keys comes back as a plain copy.

    Raises:
        ValueError: for a config with both layouts' keys, or no loss scale.
    """
    config = dict(config)
    if not is_tf_2_3_config(config):
        return config
    if "inner_optimizer" in config:
        raise ValueError(
            "A LossScaleOptimizer config has either 'inner_optimizer' or "
            f"TensorFlow 2.3's 'optimizer' key, not both. Received: "
            f"config={config!r}"
        )
    loss_scale = get_loss_scale(config.pop("loss_scale", "dynamic"))
    if loss_scale is None:
        raise ValueError(
            "A LossScaleOptimizer config needs a loss scale. "
            f"Received: loss_scale=None in config={config!r}"
        )
    config["inner_optimizer"] = config.pop("optimizer", None)
    config.update(scale_settings(loss_scale))
    return config


def is_tf_keras_config(config):
    """Returns True for a config only tf.keras' loss-scale optimizer wrote."""
    return is_tf_2_3_config(config) or (
        isinstance(config, dict) and "dynamic" in config
    )
