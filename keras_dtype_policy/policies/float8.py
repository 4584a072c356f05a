"""float8 as a policy: which layers train in float8, and what the rest get.

Keras trains a layer in float8 when its policy is a
`keras.dtype_policies.QuantizedFloat8DTypePolicy` (`"float8_from_<source>"`)
and the layer has a float8 path (`Dense` and `EinsumDense`); any other
layer, a model included, fails on its first call under such a policy (keras
#23479). Here a float8 policy means float8 where a layer can train in it and
its source policy (`"mixed_bfloat16"` for `"float8_from_mixed_bfloat16"`)
everywhere else, as a `Float8SourcePolicy` that remembers the float8
policy: every new layer is settled so (the `Layer.__init__` patch calls
`settle_layer_policy`), and precision rules resolve through
`policy_for_layer`.
"""

import keras

from keras_dtype_policy.policies import keras_internals
from keras_dtype_policy.policies import layer_walk
from keras_dtype_policy.policies.policy import DTypePolicy
from keras_dtype_policy.policies.registration import register

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
    """Returns the name of the float policy a float8 policy quantizes from.

    Keras clears the names of the policies a `DTypePolicyMap` serializes
    (keras-hub saves its float8 layers' so): the source is then read from
    the dtypes, which stay.
    """
    if policy.name:
        return policy.name.split(_SEPARATOR, 1)[1]
    compute, variable = policy.compute_dtype, policy.variable_dtype
    if compute == variable:
        return compute
    return f"mixed_{compute}"


def quantized_policy(source, argument_name="policy", amax_history_length=None):
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
        policy = keras.dtype_policies.QuantizedFloat8DTypePolicy(
            FLOAT8_MODE, name, **kwargs
        )
    except (TypeError, ValueError) as error:
        policy = error
    if isinstance(policy, Exception) or not keras.backend.is_float_dtype(
        policy.compute_dtype
    ):
        raise ValueError(
            f"`{argument_name}`: float8 layers quantize from one of Keras' "
            f"own float policies ({_SOURCE_FORMS} or 'float16'); "
            f"{name!r} is not one. Received: {argument_name}="
            f"{FLOAT8_MODE}{_SEPARATOR}{name}"
        ) from (policy if isinstance(policy, Exception) else None)
    return policy


@register
class Float8SourcePolicy(DTypePolicy):
    """A float8 policy's source policy, on a layer that cannot use float8.

    It computes and keeps variables as its source policy does, and equals
    it (`Float8SourcePolicy("float8_from_mixed_bfloat16")` equals
    `DTypePolicy("mixed_bfloat16")`), so the compile hook and Keras treat
    the layer as a `"mixed_bfloat16"` one. It remembers the float8 policy:
    a layer that can train in float8 and is given this policy (keras-hub
    models pass their own `dtype` to every layer they make) gets the float8
    policy, and a saved model's config keeps it.

    Args:
        float8_policy: The float8 policy's name, such as
            `"float8_from_mixed_bfloat16"`.
        amax_history_length: The length of its scaling history; Keras'
            default where None.

    Example:

    >>> policy = Float8SourcePolicy("float8_from_mixed_bfloat16")
    >>> policy.name, policy.float8_policy.name
    ('mixed_bfloat16', 'float8_from_mixed_bfloat16')
    """

    def __init__(self, float8_policy, amax_history_length=None):
        if not is_float8_name(float8_policy):
            raise ValueError(
                "`float8_policy` must name a float8 policy, such as "
                "'float8_from_mixed_bfloat16'. Received: "
                f"float8_policy={float8_policy!r}"
            )
        quantized = quantized_policy(
            float8_policy.split(_SEPARATOR, 1)[1],
            "float8_policy",
            amax_history_length,
        )
        super().__init__(source_name(quantized))
        self._float8_policy = quantized

    @property
    def float8_policy(self):
        """The float8 policy whose source this is."""
        return self._float8_policy

    def get_config(self):
        return {
            "float8_policy": self._float8_policy.name,
            "amax_history_length": self._float8_policy.amax_history_length,
        }

    @classmethod
    def from_config(cls, config):
        """Builds a policy from the output of `get_config`."""
        if not isinstance(config, dict) or "float8_policy" not in config:
            raise ValueError(
                f"A {cls.__name__} config must be a dict with a "
                f"'float8_policy' key. Received: config={config!r}"
            )
        return cls(**config)

    def __repr__(self):
        return (
            f'<Float8SourcePolicy "{self.name}" of '
            f'"{self._float8_policy.name}">'
        )


def source_for(policy):
    """Returns the `Float8SourcePolicy` of a float8 policy."""
    name = FLOAT8_MODE + _SEPARATOR + source_name(policy)
    return Float8SourcePolicy(name, policy.amax_history_length)


def trains_in_float8(layer):
    """Returns True if `layer` computes in float8 under a float8 policy.

    A layer does when its class has a float8 path of its own (`Dense` and
    `EinsumDense` have; `keras_internals.float8_path_owner` says where each
    Keras release keeps it) and no subclass below that class replaces
    `call` or `build`, which the float8 path would skip.
    """
    owner = keras_internals.float8_path_owner(layer)
    if owner is None:
        return False
    cls = type(layer)
    for attribute in ("call", "build"):
        definer = keras_internals.defining_class(cls, attribute)
        if definer is not None and not issubclass(owner, definer):
            return False
    return True


def policy_for_layer(policy, layer):
    """Returns the policy `layer` gets from `policy`.

    A float8 policy gives a layer that cannot train in float8 its
    `Float8SourcePolicy`; a `Float8SourcePolicy` gives a layer that can
    its float8 policy; any other policy is returned as it is.
    """
    if is_float8_policy(policy) and not trains_in_float8(layer):
        return source_for(policy)
    if isinstance(policy, Float8SourcePolicy) and trains_in_float8(layer):
        return policy.float8_policy
    return policy


def settle_layer_policy(layer):
    """Gives a new layer the policy `policy_for_layer` picks from the one
    it was given (by `dtype=` or the global policy).

    A layer that trains in float8 gets a float8 policy of its own: Keras
    writes into the policy objects of a `DTypePolicyMap` it serializes
    (keras-hub saves its models' float8 layers in one), and the global
    policy must not change when a model is saved.
    """
    policy = getattr(layer, "_dtype_policy", None)
    if is_float8_policy(policy) or isinstance(policy, Float8SourcePolicy):
        chosen = policy_for_layer(policy, layer)
        if is_float8_policy(chosen):
            chosen = quantized_policy(
                source_name(chosen),
                amax_history_length=chosen.amax_history_length,
            )
        layer._dtype_policy = chosen


def settled_policy_value(layer, value):
    """Returns what `layer.dtype_policy = value` should set.

    Keras' setter quantizes a built layer given a quantized policy; a model
    whose float8 layers were made under that float8 policy would fail with
    "already quantized". Such a model (built, not quantized itself, with
    float8 layers and no layer quantized otherwise) gets the
    `Float8SourcePolicy` instead, as `Layer.__init__` gives it; any other
    `value` is returned as it is, for Keras' setter.

    Args:
        layer: The layer whose policy is set.
        value: What was assigned: a policy or a name.
    """
    if not (is_float8_policy(value) or is_float8_name(value)):
        return value
    if trains_in_float8(layer) or not getattr(layer, "built", False):
        return value
    if getattr(layer, "_is_quantized", False):
        return value
    modes = {
        sublayer.quantization_mode
        for sublayer in layer_walk.all_layers(layer)
        if getattr(sublayer, "_is_quantized", False)
    }
    if modes != {FLOAT8_MODE}:
        return value
    policy = (
        value if is_float8_policy(value) else keras.dtype_policies.get(value)
    )
    return source_for(policy)


def make_dtype_policy_property(original):
    """Returns `Layer.dtype_policy` whose setter goes through
    `settled_policy_value`.

    Args:
        original: Keras' own `Layer.dtype_policy` property.

    Returns:
        A property with Keras' getter and deleter.
    """
    setter = original.fset

    def set_dtype_policy(self, value):
        setter(self, settled_policy_value(self, value))

    set_dtype_policy.__wrapped__ = setter
    return property(
        original.fget, set_dtype_policy, original.fdel, original.__doc__
    )
