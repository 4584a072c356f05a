"""The backend-agnostic `DTypePolicy`."""

import functools
from typing import Any

import keras
import numpy as np

from keras_dtype_policy.policies import names as policy_names
from keras_dtype_policy.policies.registration import register
from keras_dtype_policy.types import Tensor

# Keras' own classes for a plain (not quantized, not mapped) float policy.
_KERAS_PLAIN_POLICIES = (
    keras.DTypePolicy,
    keras.dtype_policies.FloatDTypePolicy,
)


@register
class DTypePolicy(keras.DTypePolicy):
    """A dtype policy for a Keras layer, on every Keras backend.

    A dtype policy determines a layer's computation and variable dtypes. Each
    layer has a policy. Policies can be passed to the `dtype` argument of
    layer constructors, or a global policy can be set with
    `keras_dtype_policy.set_dtype_policy` (or `keras.config.set_dtype_policy`).

    This is a subclass of `keras.DTypePolicy`: every Keras layer accepts it,
    it equals Keras' own policy of the same name, and it is hashable, so
    policies can key a dict. Its inputs are cast with `keras.ops` only.

    Args:
        name: The policy name. Any dtype name, such as `"float32"` or
            `"bfloat16"`, makes both the compute and the variable dtype that
            dtype. `"mixed_float16"` and `"mixed_bfloat16"` compute in
            float16 or bfloat16 and keep variables in float32. `None` takes
            the name of the current global policy.

    Example:

    >>> policy = keras_dtype_policy.DTypePolicy("mixed_float16")
    >>> policy
    <DTypePolicy "mixed_float16">
    >>> policy.compute_dtype, policy.variable_dtype
    ('float16', 'float32')
    >>> layer = keras.layers.Dense(10, dtype=policy)
    """

    # Policies compare equal only with policies of the same kind.
    _policy_kind = "float"

    def _parse_name(self, name):
        return policy_names.parse_policy_name(name)

    def convert_input(self, x: Tensor, autocast: bool, dtype: str) -> Tensor:
        """Casts floating inputs to `dtype` when `autocast` is true.

        Args:
            x: A backend tensor, a `KerasTensor`, a NumPy array, a Python
                float, or a nested list, tuple or dict of these.
            autocast: Whether floating inputs are cast at all.
            dtype: The dtype floating inputs are cast to.

        Returns:
            `x` with every floating leaf in `dtype`. Integer, bool and string
            inputs keep their dtype, and a tensor that needs no cast is
            returned as the same object. NumPy arrays become backend tensors,
            as in Keras.
        """
        dtype = _standard_dtype(dtype)
        if isinstance(x, (list, tuple, dict)):
            return keras.tree.map_structure(
                lambda leaf: _convert_leaf(leaf, autocast, dtype), x
            )
        return _convert_leaf(x, autocast, dtype)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "DTypePolicy":
        """Builds a policy from `{"name": ...}`, the output of `get_config`."""
        if not isinstance(config, dict) or set(config) != {"name"}:
            raise ValueError(
                f"A {cls.__name__} config must be a dict with a 'name' key "
                f"only. Received: config={config!r}"
            )
        return cls(**config)

    def __eq__(self, other):
        if not isinstance(other, keras.DTypePolicy):
            return NotImplemented
        return _kind(self) == _kind(other) and self.name == other.name

    def __ne__(self, other):
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    def __hash__(self):
        return hash((self._policy_kind, self.name))

    def __repr__(self):
        return f'<{type(self).__name__} "{self.name}">'


def _kind(policy):
    """Returns the kind of policy that equality compares within."""
    if isinstance(policy, DTypePolicy):
        return policy._policy_kind
    if type(policy) in _KERAS_PLAIN_POLICIES:
        return "float"
    return type(policy)


def _convert_leaf(x, autocast, dtype):
    if keras.ops.is_tensor(x) or keras.backend.is_keras_tensor(x):
        if autocast and _needs_cast(_standard_dtype(x.dtype), dtype):
            return keras.ops.cast(x, dtype)
        return x
    if isinstance(x, float):
        if autocast:
            return keras.ops.convert_to_tensor(x, dtype=dtype)
        return x
    if hasattr(x, "__array__"):
        x_dtype = _array_dtype(x)
        if x_dtype is None or x_dtype == "string":
            return x
        if autocast and _needs_cast(x_dtype, dtype):
            return keras.ops.convert_to_tensor(x, dtype=dtype)
        return keras.ops.convert_to_tensor(x)
    return x


def _standard_dtype(dtype):
    """Keras' name of a dtype (cached: the same few dtypes recur)."""
    try:
        return _cached_standard_dtype(dtype)
    except TypeError:  # an unhashable dtype object
        return keras.backend.standardize_dtype(dtype)


@functools.lru_cache(maxsize=256)
def _cached_standard_dtype(dtype):
    return keras.backend.standardize_dtype(dtype)


def _array_dtype(x):
    """Returns the Keras dtype of an array-like, or None if it has none."""
    x_dtype = getattr(x, "dtype", None)
    if x_dtype is None:
        x_dtype = np.asarray(x).dtype
    try:
        return _standard_dtype(x_dtype)
    except (TypeError, ValueError):
        return None


def _needs_cast(x_dtype, dtype):
    """Whether a standardized `x_dtype` is a float dtype other than `dtype`."""
    return x_dtype != dtype and x_dtype.startswith(("float", "bfloat"))
