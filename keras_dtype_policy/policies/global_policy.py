"""The global dtype policy: reading, setting and scoping Keras' own global."""

import contextlib
from collections.abc import Iterator

import keras
from keras.src import dtype_policies

from keras_dtype_policy.policies import float8
from keras_dtype_policy.policies import hardware
from keras_dtype_policy.policies import keras_internals
from keras_dtype_policy.policies.policy import DTypePolicy

# tf.keras' infer policies, which the package's `dtype_policies.get` knows.
_INFER_NAMES = ("infer", "_infer", "infer_with_float32_vars")


def as_policy(policy, argument_name="policy"):
    """Returns `policy` as a policy object.

    Args:
        policy: A policy name, such as `"mixed_float16"`, or any
            `keras.DTypePolicy` instance, which is returned as it is.
        argument_name: The argument name used in error messages.

    Returns:
        A `keras.DTypePolicy` instance. Float policy names give a
        `keras_dtype_policy.DTypePolicy`; quantized names, such as
        `"int8_from_float32"`, give Keras' own quantized policy, as
        `keras.config.set_dtype_policy` does; tf.keras' infer names
        (`"_infer"`, `"infer"`, `"infer_with_float32_vars"`) give its
        infer `Policy`, as `set_policy` does.

    Raises:
        ValueError: for anything else, as Keras raises.
    """
    if isinstance(policy, keras.DTypePolicy):
        return policy
    if isinstance(policy, str):
        if keras_internals.is_quantized_policy_name(policy):
            return keras.dtype_policies.get(policy)
        if policy in _INFER_NAMES:
            # Keras' internal `get`, where the package's patch reads them.
            return dtype_policies.get(policy)
        return DTypePolicy(policy)
    # Keras' own wording and error type first.
    raise ValueError(
        f"Invalid `{argument_name}` argument. Expected the string name of a "
        "policy (such as 'mixed_float16') or a `DTypePolicy` instance. "
        f"Received: {argument_name}={policy!r} "
        f"(of type {type(policy).__name__})"
    )


def set_dtype_policy(policy: str | keras.DTypePolicy) -> None:
    """Sets the global dtype policy that layers without a `dtype` follow.

    This sets Keras' own global policy, so it holds for every layer built
    afterwards in this thread, as `keras.config.set_dtype_policy` does.

    Args:
        policy: A policy name, such as `"mixed_float16"` (tf.keras' infer
            names included), or a `keras.DTypePolicy` instance.

    Example:

    >>> keras_dtype_policy.set_dtype_policy("mixed_float16")
    >>> keras.layers.Dense(10).dtype_policy
    <DTypePolicy "mixed_float16">
    >>> keras_dtype_policy.set_dtype_policy("float32")
    """
    _set_global(policy, stacklevel=4)


def set_global_policy(policy: str | keras.DTypePolicy | None) -> None:
    """Sets the global dtype policy; None restores the default.

    `set_dtype_policy` under the name of `keras.mixed_precision` (and of
    tf.keras), which also takes None, as tf.keras' did: the default float
    policy (`keras.config.floatx()`) comes back.

    Args:
        policy: A policy name, a `keras.DTypePolicy` instance, or None.

    Example:

    >>> keras_dtype_policy.set_global_policy("mixed_bfloat16")
    >>> keras_dtype_policy.set_global_policy(None)
    >>> keras_dtype_policy.dtype_policy()
    <DTypePolicy "float32">
    """
    if policy is None:
        policy = keras.config.floatx()
    _set_global(policy, stacklevel=4)


def _set_global(policy, stacklevel):
    policy = as_policy(policy)
    hardware.warn_if_float16_is_slow(policy, stacklevel=stacklevel)
    keras.config.set_dtype_policy(_as_keras_global(policy))


def _as_keras_global(policy):
    """The policy Keras' global holds for `policy`.

    A float8 policy is held as its `Float8SourcePolicy`: a float policy
    (Keras 3.16 refuses a quantized global) from which every new layer
    that can train in float8 takes the float8 policy.
    """
    if float8.is_float8_policy(policy):
        return float8.source_for(policy)
    return policy


def dtype_policy() -> keras.DTypePolicy:
    """Returns the current global dtype policy of this thread.

    `keras_dtype_policy.global_policy` is this function, as
    `keras.mixed_precision.global_policy` is Keras' own, and so is
    `keras_dtype_policy.experimental.global_policy`: tf.keras' returned the
    policy that was set, as this does.

    Under a float8 global policy this is the float8 policy that was set
    (`keras.config.dtype_policy()` returns its source, which Keras' global
    holds).
    """
    policy = keras.config.dtype_policy()
    if isinstance(policy, float8.Float8SourcePolicy):
        return policy.float8_policy
    return policy


@contextlib.contextmanager
def policy_scope(
    policy: str | keras.DTypePolicy,
) -> Iterator[keras.DTypePolicy]:
    """A context manager that sets the global dtype policy for its block.

    The previous global policy comes back on exit, also when the block
    raises.

    Args:
        policy: A policy name or a `keras.DTypePolicy` instance.

    Yields:
        The policy in force inside the block.

    Example:

    >>> with keras_dtype_policy.policy_scope("mixed_bfloat16"):
    ...     layer = keras.layers.Dense(4)
    >>> layer.compute_dtype
    'bfloat16'
    """
    new_policy = as_policy(policy)
    hardware.warn_if_float16_is_slow(new_policy, stacklevel=4)
    previous_policy = keras.config.dtype_policy()
    keras.config.set_dtype_policy(_as_keras_global(new_policy))
    try:
        yield new_policy
    finally:
        keras.config.set_dtype_policy(previous_policy)
