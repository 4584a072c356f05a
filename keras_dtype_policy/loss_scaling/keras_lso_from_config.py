"""The patch that lets Keras' `LossScaleOptimizer` read tf.keras' configs."""

from keras_dtype_policy.loss_scaling.optimizer import LossScaleOptimizer
from keras_dtype_policy.loss_scaling.tf_keras_configs import is_tf_keras_config


def make_keras_from_config(original):
    """Returns Keras' `LossScaleOptimizer.from_config`, reading tf.keras'.

    `keras.optimizers.deserialize` finds Keras' own class for the name
    "LossScaleOptimizer", which tf.keras wrote too. A config in one of
    tf.keras' layouts (which may hold a fixed scale, which Keras' class
    cannot) builds this package's `LossScaleOptimizer` instead; Keras' own
    configs go to Keras as before.

    Args:
        original: Keras' own `from_config` classmethod.

    Returns:
        A classmethod with the same signature.
    """
    keras_from_config = original.__func__

    def from_config(cls, config, custom_objects=None):
        if is_tf_keras_config(config) and issubclass(LossScaleOptimizer, cls):
            return LossScaleOptimizer.from_config(config, custom_objects)
        return keras_from_config(cls, config, custom_objects)

    return classmethod(from_config)
