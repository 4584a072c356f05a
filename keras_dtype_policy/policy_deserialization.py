"""Keeping this package's policies through Keras' layer deserialization."""

import keras

from keras_dtype_policy.registration import PACKAGE


def make_from_config(original_from_config):
    """Returns `Operation.from_config` that keeps this package's policies.

    Keras' own `Operation.from_config` turns every plain serialized policy
    into its name, so a layer saved with a `keras_dtype_policy.DTypePolicy`
    would come back with Keras' own class. This passes the deserialized
    policy object to the layer instead, for this package's classes only.

    Args:
        original_from_config: Keras' own `Operation.from_config` (a
            classmethod object).

    Returns:
        A classmethod with the same behaviour for every other config.
    """
    original = original_from_config.__func__

    def from_config(cls, config):
        dtype = config.get("dtype") if isinstance(config, dict) else None
        if is_package_policy_config(dtype):
            config = dict(config)
            config["dtype"] = keras.dtype_policies.deserialize(dtype)
        return original(cls, config)

    from_config.__doc__ = original.__doc__
    from_config.__wrapped__ = original
    return classmethod(from_config)


def is_package_policy_config(config):
    """Returns True for a serialized policy of this package."""
    if not isinstance(config, dict):
        return False
    registered_name = config.get("registered_name")
    return isinstance(registered_name, str) and registered_name.startswith(
        f"{PACKAGE}>"
    )
