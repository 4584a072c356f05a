"""Policy lookup and deserialization: this package's and tf.keras' forms."""

import contextlib

import keras

from keras_dtype_policy.policies import float8
from keras_dtype_policy.policies import names as policy_names
from keras_dtype_policy.policies.policy import DTypePolicy
from keras_dtype_policy.policies.registration import PACKAGE
from keras_dtype_policy.tf_keras_compat import legacy_policy
from keras_dtype_policy.tf_keras_compat import legacy_policy_configs
from keras_dtype_policy.tf_keras_compat import tf_keras_policy


def make_from_config(original_from_config):
    """Returns `Operation.from_config` that keeps this package's policies.

    Keras' own `Operation.from_config` turns every plain serialized policy
    into its name, so a layer saved with a `keras_dtype_policy.DTypePolicy`
    would come back with Keras' own class. This passes the deserialized
    policy object to the layer instead, for this package's classes and for
    tf.keras' policy configs (which give tf.keras 2.4+'s `Policy`).

    Args:
        original_from_config: Keras' own `Operation.from_config` (a
            classmethod object).

    Returns:
        A classmethod with the same behaviour for every other config.
    """
    original = original_from_config.__func__

    def from_config(cls, config):
        dtype = config.get("dtype") if isinstance(config, dict) else None
        if legacy_policy_configs.is_legacy_policy_config(dtype):
            config = dict(config)
            config["dtype"] = legacy_policy_configs.policy_from_legacy_config(
                dtype
            )
        elif is_package_policy_config(dtype):
            config = dict(config)
            config["dtype"] = keras.dtype_policies.deserialize(dtype)
        policy = config.get("dtype") if isinstance(config, dict) else None
        if isinstance(policy, float8.Float8SourcePolicy):
            # The layers its constructor makes in code took the float8
            # policy from the global one when it was saved: so again.
            with _global_policy(policy):
                return original(cls, config)
        return original(cls, config)

    from_config.__doc__ = original.__doc__
    from_config.__wrapped__ = original
    return classmethod(from_config)


@contextlib.contextmanager
def _global_policy(policy):
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)


def is_package_policy_config(config):
    """Returns True for a serialized policy of this package."""
    if not isinstance(config, dict):
        return False
    registered_name = config.get("registered_name")
    return isinstance(registered_name, str) and registered_name.startswith(
        f"{PACKAGE}>"
    )


def make_deserialize(original_deserialize):
    """Returns `dtype_policies.deserialize` that also reads tf.keras forms.

    Every failure becomes one `ValueError` that shows the config, instead of
    the mix of errors Keras raises (or the class name it returns for an
    unknown class, which fails later with `'str' object has no attribute
    'quantization_mode'`).

    Args:
        original_deserialize: Keras' own `dtype_policies.deserialize`.

    Returns:
        A function with the same signature.
    """

    def deserialize(config, custom_objects=None):
        if legacy_policy_configs.is_legacy_policy_config(config):
            return legacy_policy_configs.policy_from_legacy_config(config)
        try:
            policy = original_deserialize(config, custom_objects=custom_objects)
        except Exception as error:
            raise ValueError(
                f"Cannot deserialize a dtype policy: {error} "
                f"Received: dtype={config!r}"
            ) from error
        if not isinstance(policy, keras.DTypePolicy):
            # Keras returns the class name for a class it does not know.
            raise ValueError(
                "Cannot deserialize a dtype policy: the config names no "
                f"known policy class. Received: dtype={config!r}"
            )
        return policy

    deserialize.__doc__ = original_deserialize.__doc__
    deserialize.__wrapped__ = original_deserialize
    return deserialize


def make_get(original_get):
    """Returns `dtype_policies.get` that knows the tf.keras names.

    It also knows this package's low-precision update policies (such as
    `"kahan_bfloat16"`), which give a `keras_dtype_policy.DTypePolicy`.

    The infer names give each caller (each layer) a policy of its own, so
    no layer's inference touches a shared or global policy object. Names
    that tf.keras 2.0 removed raise a `ValueError` naming the replacement.

    Args:
        original_get: Keras' own `dtype_policies.get`.

    Returns:
        A function with the same signature.
    """

    def get(identifier):
        if identifier is None:
            identifier = keras.config.dtype_policy()
        if isinstance(identifier, tf_keras_policy.Policy) and (
            identifier.infers
        ):
            return identifier.unresolved_copy()
        if isinstance(identifier, str) and (
            identifier in legacy_policy.INFER_POLICIES
            or identifier in policy_names.REMOVED_POLICIES
        ):
            return legacy_policy_configs.policy_for_name(identifier)
        if (
            isinstance(identifier, str)
            and identifier in policy_names.LOW_PRECISION_UPDATE_POLICIES
        ):
            return DTypePolicy(identifier)
        try:
            return original_get(identifier)
        except (TypeError, ValueError) as error:
            if "Received: dtype=" in str(error):
                raise
            raise type(error)(
                f"{error} Received: dtype={identifier!r}"
            ) from error

    get.__doc__ = original_get.__doc__
    get.__wrapped__ = original_get
    return get
