"""Keras' own policy nearest to each of the package's policies.

A file Keras alone loads names Keras' policies only. Each package policy
has a Keras one that computes in the same dtype and keeps its variables
in the same dtype: a low-precision update policy (`"kahan_bfloat16"`,
`"stochastic_float16_8bit"`...) becomes its weight dtype (`"bfloat16"`,
`"float16"`), which Keras trains with plain rounding; every other name
(`"mixed_bfloat16"`, `"float32"`, a float8 policy's source) is Keras' own
already and only changes class.
"""

import keras

from keras_dtype_policy.policies import names
from keras_dtype_policy.policies.policy import DTypePolicy


def nearest_keras_name(name):
    """Returns the name of Keras' policy nearest to the policy `name`.

    Args:
        name: A policy name the package accepts.

    Returns:
        `"bfloat16"` or `"float16"` for a low-precision update policy
        (the dtype of its weights), else `name`.

    Example:

    >>> nearest_keras_name("kahan_bfloat16_8bit")
    'bfloat16'
    >>> nearest_keras_name("mixed_float16")
    'mixed_float16'
    """
    entry = names.LOW_PRECISION_UPDATE_POLICIES.get(name)
    return name if entry is None else entry[0]


def nearest_keras_policy(policy):
    """Returns Keras' own policy nearest to `policy`, or None to keep it.

    Args:
        policy: A layer's `keras.DTypePolicy`.

    Returns:
        A `keras.DTypePolicy` of Keras' own class for a policy of the
        package's classes; None for any other (Keras' own policies, a
        `DTypePolicyMap`, Keras' quantized policies), which Keras loads.
    """
    if not isinstance(policy, DTypePolicy):
        return None
    return keras.DTypePolicy(nearest_keras_name(policy.name))


def is_keras_policy_name(name):
    """True where Keras alone accepts the policy `name`."""
    try:
        keras.DTypePolicy(name)
    except (TypeError, ValueError):
        return False
    return True
