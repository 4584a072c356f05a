"""Registration of the package's classes with Keras serialization."""

import keras

PACKAGE = "keras_dtype_policy"


def register(cls):
    """Registers `cls` with Keras serialization under the package name.

    The class is then saved as `"keras_dtype_policy>ClassName"` and found
    again by `keras.saving.deserialize_keras_object` and `load_model`
    without `custom_objects`.

    Args:
        cls: The class to register.

    Returns:
        The class itself, so this can be used as a decorator.
    """
    return keras.saving.register_keras_serializable(package=PACKAGE)(cls)


def registered_name(cls):
    """Returns the name under which `cls` is registered."""
    return f"{PACKAGE}>{cls.__name__}"
