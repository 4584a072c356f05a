"""float8 as a policy: which layers train in float8, and what the rest get.

Keras trains a layer in float8 when its policy is a
`keras.dtype_policies.QuantizedFloat8DTypePolicy` (`"float8_from_<source>"`)
and the layer has a float8 path (`Dense` and `EinsumDense`); any other
layer, a model included, fails on its first call under such a policy (keras
#23479). Here a float8 policy means float8 where a layer can train in it and
its source policy (`"mixed_bfloat16"` for `"float8_from_mixed_bfloat16"`)
everywhere else: every new layer is settled so (the `Layer.__init__` patch
calls `settle_layer_policy`), and precision rules resolve through
`policy_for_layer`.
"""

import keras

from keras_dtype_policy.policies.policy import DTypePolicy

FLOAT8_MODE = "float8"
_SEPARATOR = "_from_"
# Keras' float8 layers quantize from one of Keras' own float policies.
_SOURCE_FORMS = "'float32', 'mixed_bfloat16', 'mixed_float16', 'bfloat16'"


class Float8FromDefault:
    """A rule's `"float8"`: float8 over the rules' default float policy.

    `PrecisionRule("float8", layers="Dense")` gives matching layers
    `"float8_from_<default>"`, whatever default the rules have.
    """

    name = FLOAT8_MODE

    def __eq__(self, other):
        return isinstance(other, Float8FromDefault)

    def __hash__(self):
        return hash(FLOAT8_MODE)

    def __repr__(self):
        return '<Float8FromDefault "float8">'


FLOAT8_FROM_DEFAULT = Float8FromDefault()


def is_float8_policy(policy):
    """Returns True if `policy` is a float8 policy (of any source)."""
    return isinstance(policy, keras.dtype_policies.QuantizedFloat8DTypePolicy)


def is_float8_name(name):
    """Returns True for a name of the form `"float8_from_<source>"`."""
    return isinstance(name, str) and name.startswith(FLOAT8_MODE + _SEPARATOR)


def source_name(policy):
    """Returns the name of the float policy a float8 policy quantizes from."""
    return policy.name.split(_SEPARATOR, 1)[1]


def source_policy(policy):
    """Returns the float `DTypePolicy` a float8 policy quantizes from."""
    return DTypePolicy(source_name(policy))


def float8_policy(source, argument_name="policy", amax_history_length=None):
    """Returns Keras' float8 policy over a float source policy.

    Args:
        source: The source policy's name or a float `keras.DTypePolicy`:
            the compute and variable dtypes of the float8 layers' other
            work, such as `"mixed_bfloat16"`.
        argument_name: The argument named in errors.
        amax_history_length: The length of the scaling history; Keras'
            default where None.

    Returns:
        A `keras.dtype_policies.QuantizedFloat8DTypePolicy`.

    Raises:
        ValueError: if Keras' float8 layers cannot quantize from `source`.
    """
    name = source.name if isinstance(source, keras.DTypePolicy) else source
    kwargs = {}
    if amax_history_length is not None:
        kwargs["amax_history_length"] = amax_history_length
    try:
        return keras.dtype_policies.QuantizedFloat8DTypePolicy(
            FLOAT8_MODE, name, **kwargs
        )
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"`{argument_name}`: float8 layers quantize from one of Keras' "
            f"own float policies ({_SOURCE_FORMS} or 'float16'); "
            f"{name!r} is not one. Received: {argument_name}="
            f"{FLOAT8_MODE}{_SEPARATOR}{name} ({error})"
        ) from error


def _defining_class(cls, attribute):
    for klass in cls.__mro__:
        if attribute in vars(klass):
            return klass
    return None


def trains_in_float8(layer):
    """Returns True if `layer` computes in float8 under a float8 policy.

    A layer does when its class has a float8 path of its own
    (`_float8_call`, as `Dense` and `EinsumDense` have; `keras.Layer`'s
    only raises) and no subclass below that class replaces `call` or
    `build`, which the float8 path would skip.
    """
    cls = type(layer)
    owner = _defining_class(cls, "_float8_call")
    if owner is None or owner in keras.layers.Layer.__mro__:
        return False
    for attribute in ("call", "build"):
        definer = _defining_class(cls, attribute)
        if definer is not None and not issubclass(owner, definer):
            return False
    return True


def policy_for_layer(policy, layer):
    """Returns the policy `layer` gets from `policy`: a float8 policy's
    source policy for a layer that cannot train in float8, else `policy`.
    """
    if is_float8_policy(policy) and not trains_in_float8(layer):
        return source_policy(policy)
    return policy


def settle_layer_policy(layer):
    """Gives a new layer that cannot train in float8 the source policy of
    the float8 policy it was given (by `dtype=` or the global policy)."""
    policy = getattr(layer, "_dtype_policy", None)
    if is_float8_policy(policy) and not trains_in_float8(layer):
        layer._dtype_policy = source_policy(policy)
