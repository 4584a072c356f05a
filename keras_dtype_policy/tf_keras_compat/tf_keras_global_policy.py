"""tf.keras 2.4+'s `set_global_policy` and `global_policy`.

They work in `tf_keras_policy.Policy` objects, as tf.keras 2.4+ did: a name
given to `set_global_policy` becomes a `Policy`, and `global_policy` shows
Keras' own plain policy as the `Policy` of the same name.
"""

import keras

from keras_dtype_policy.policies.policy import DTypePolicy
from keras_dtype_policy.tf_keras_compat import legacy_policy
from keras_dtype_policy.tf_keras_compat.tf_keras_policy import Policy

# The plain float policies that `global_policy` shows as a `Policy`.
_PLAIN_POLICIES = (
    keras.DTypePolicy,
    keras.dtype_policies.FloatDTypePolicy,
    DTypePolicy,
)


def set_global_policy(policy):
    """Sets the global policy, as `tf.keras.mixed_precision` 2.4+ did.

    Args:
        policy: A policy name (`"_infer"` included), a policy object, or
            None, which restores the default float policy. A name becomes
            a `Policy`. The policy must be a floating-point one.

    Example:

    >>> set_global_policy("mixed_float16")
    >>> global_policy()
    <Policy "mixed_float16">
    >>> set_global_policy(None)
    """
    if policy is None:
        policy = Policy(keras.config.floatx())
    elif isinstance(policy, str):
        policy = Policy(policy)
    legacy_policy.install_global_policy(policy, stacklevel=4)


def global_policy():
    """Returns the global policy of this thread, as a `Policy`.

    The policy object that was set is returned as it is; Keras' own plain
    policy (the default, or one set through `keras.config`) is shown as the
    `Policy` of the same name, which equals it.
    """
    policy = keras.config.dtype_policy()
    if type(policy) in _PLAIN_POLICIES:
        return Policy(policy.name)
    return policy
