"""Deserialization of inner optimizers, including tf.keras 2 configs."""

import warnings

import keras

# Keys that tf.keras 2 optimizers save and Keras 3 optimizers reject.
_TF_KERAS_ONLY_KEYS = ("jit_compile", "is_legacy_optimizer")


def deserialize_optimizer(config, custom_objects=None):
    """Returns the optimizer that `config` describes.

    Args:
        config: A `keras.optimizers.Optimizer` (returned as it is), a Keras 3
            serialized optimizer, or a tf.keras 2 one, such as
            `{"class_name": "Adam", "config": {..., "jit_compile": True}}`.
        custom_objects: Optional custom objects.

    Returns:
        A `keras.optimizers.Optimizer`.
    """
    if isinstance(config, keras.optimizers.Optimizer):
        return config
    if isinstance(config, str):
        return keras.optimizers.get(config)
    if not isinstance(config, dict) or "class_name" not in config:
        raise ValueError(
            "`inner_optimizer` must be an optimizer or a serialized "
            f"optimizer. Received: inner_optimizer={config!r}"
        )
    config = dict(config)
    config["config"] = without_tf_keras_keys(config.get("config") or {})
    if config.get("module") is None:
        return keras.optimizers.deserialize(
            config, custom_objects=custom_objects
        )
    return keras.saving.deserialize_keras_object(
        config, custom_objects=custom_objects
    )


def without_tf_keras_keys(config):
    """Drops the optimizer config keys that only tf.keras 2 accepted."""
    config = {k: v for k, v in config.items() if k not in _TF_KERAS_ONLY_KEYS}
    decay = config.pop("decay", None)
    if decay:
        warnings.warn(
            f"The saved optimizer used `decay={decay}`, which Keras 3 "
            "optimizers do not support; it is ignored. Use a learning rate "
            "schedule to keep decaying the learning rate.",
            stacklevel=3,
        )
    return config
