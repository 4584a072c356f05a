"""Keras' public policy lookups, taught this package's policy names.

Keras' layers look a policy up through `keras.src.dtype_policies.get`,
which the package's patch of it already reads. Keras' public API binds its
functions by name instead: `keras.dtype_policies.get` (which keras-hub's
`Backbone(dtype=...)` and `from_preset(..., dtype=...)` call),
`keras.config.set_dtype_policy` and their `keras.mixed_precision`
spellings (`tf.keras` has these very modules) are each a name of Keras'
own function, which knows only Keras' names. These replacements give this
package's names (such as `"kahan_bfloat16"`) their
`keras_dtype_policy.DTypePolicy` and pass everything else to Keras'
function, whose results and errors stay as they are.
"""

from typing import Any

from keras_dtype_policy.policies import names as policy_names
from keras_dtype_policy.policies.policy import DTypePolicy


def is_package_name(identifier):
    """Returns True for a policy name that only this package knows.

    Args:
        identifier: Anything a Keras lookup takes.

    Example:

    >>> is_package_name("kahan_bfloat16"), is_package_name("mixed_bfloat16")
    (True, False)
    """
    return (
        isinstance(identifier, str)
        and identifier in policy_names.LOW_PRECISION_UPDATE_POLICIES
    )


def make_get(original_get):
    """Returns a public `keras.dtype_policies.get` that knows this package's
    names.

    Args:
        original_get: Keras' own `dtype_policies.get`.

    Returns:
        A function with the same signature.
    """

    def get(identifier):
        if is_package_name(identifier):
            return DTypePolicy(identifier)
        return original_get(identifier)

    get.__doc__ = original_get.__doc__
    get.__wrapped__ = original_get
    return get


# The setter made for each of Keras' functions, by the function's id.
_SETTERS: dict[int, Any] = {}


def make_set_dtype_policy(original_set):
    """Returns a public `keras.config.set_dtype_policy` that knows this
    package's names.

    Args:
        original_set: Keras' own `set_dtype_policy`.

    Returns:
        A function with the same signature: the same object for the same
        `original_set`, so Keras' names of one function (`keras.config.
        set_dtype_policy`, `keras.mixed_precision.set_global_policy`)
        stay one function.
    """
    made = _SETTERS.get(id(original_set))
    if made is not None and made.__wrapped__ is original_set:
        return made

    def set_dtype_policy(policy):
        if is_package_name(policy):
            policy = DTypePolicy(policy)
        original_set(policy)

    set_dtype_policy.__doc__ = original_set.__doc__
    set_dtype_policy.__wrapped__ = original_set
    _SETTERS[id(original_set)] = set_dtype_policy
    return set_dtype_policy
