"""TensorFlow 2.3's `LossScaleOptimizer(optimizer, loss_scale)`.

`tf.keras.mixed_precision.experimental.LossScaleOptimizer` took a loss-scale
value instead of today's `dynamic`/`initial_scale` arguments, and saved
`{"optimizer": ..., "loss_scale": ...}`. Here it is this package's
`LossScaleOptimizer` with that signature; it reads both config layouts and
is also found by `keras.optimizers.deserialize` under its tf.keras class
name, `LossScaleOptimizerV1`. As in tf.keras 2.4+, deserializing one
(`keras.optimizers.deserialize`, `load_model`) gives the non-experimental
`LossScaleOptimizer`; `LossScaleOptimizerV1.from_config` itself keeps the
class.
"""

import keras

from keras_dtype_policy.loss_scaling.loss_scale import get_loss_scale
from keras_dtype_policy.loss_scaling.optimizer import LossScaleOptimizer
from keras_dtype_policy.loss_scaling.tf_keras_configs import scale_settings
from keras_dtype_policy.policies.registration import register
from keras_dtype_policy.policies.registration import registered_name


@register
class LossScaleOptimizerV1(LossScaleOptimizer):
    """A `LossScaleOptimizer` built from a loss scale, as in TF 2.3.

    Args:
        optimizer: The `keras.optimizers.Optimizer` to wrap.
        loss_scale: `"dynamic"` (the default), a number for a fixed scale,
            or a `FixedLossScale`/`DynamicLossScale` value.

    Example:

    >>> optimizer = keras_dtype_policy.experimental.LossScaleOptimizer(
    ...     keras.optimizers.SGD(), loss_scale=1024
    ... )
    >>> (optimizer.dynamic, optimizer.loss_scale)
    (False, 1024.0)
    """

    def __init__(self, optimizer, loss_scale="dynamic", **kwargs):
        if kwargs:
            # Today's keyword arguments, as `from_config` passes them.
            super().__init__(optimizer, **kwargs)
            return
        scale = get_loss_scale(loss_scale)
        if scale is None:
            raise ValueError(
                "`loss_scale` must be 'dynamic', a number or a loss-scale "
                f"value. Received: loss_scale={loss_scale!r}"
            )
        super().__init__(optimizer, **scale_settings(scale))


class _NonExperimentalReviver:
    """What Keras' deserialization finds under `LossScaleOptimizerV1`'s
    names: tf.keras 2.4+ revived the non-experimental optimizer."""

    @classmethod
    def from_config(cls, config, custom_objects=None):
        return LossScaleOptimizer.from_config(
            config, custom_objects=custom_objects
        )


# `keras.optimizers.deserialize({"class_name": "LossScaleOptimizerV1", ...})`
# looks the bare class name up among Keras' custom objects; a file saved by
# this package names the registered class. Saving still writes the
# registered name (Keras keeps it by class, apart from this lookup).
_custom_objects = keras.saving.get_custom_objects()
_custom_objects.setdefault("LossScaleOptimizerV1", _NonExperimentalReviver)
_custom_objects[registered_name(LossScaleOptimizerV1)] = _NonExperimentalReviver
