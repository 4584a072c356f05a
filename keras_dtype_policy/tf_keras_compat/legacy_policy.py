"""TensorFlow 2.3's policy API: `Policy`, `set_policy`, `get_layer_policy`.

The objects of `keras_dtype_policy.experimental` (its `global_policy` is the
package's `dtype_policy`). `Policy` is tf.keras' experimental policy:
tf.keras 2.4+'s `Policy` that also names a loss scale. The top level's
`Policy`, `set_policy` and `get_layer_policy` are these same objects.
"""

import warnings

import keras

from keras_dtype_policy.loss_scaling.loss_scale import FixedLossScale
from keras_dtype_policy.loss_scaling.loss_scale import get_loss_scale
from keras_dtype_policy.loss_scaling.loss_scale import serialize_loss_scale
from keras_dtype_policy.policies import hardware
from keras_dtype_policy.policies.policy import DTypePolicy
from keras_dtype_policy.policies.registration import register
from keras_dtype_policy.tf_keras_compat import tf_keras_policy
from keras_dtype_policy.tf_keras_compat.tf_keras_policy import INFER_POLICIES

_AUTO = "auto"


@register
class Policy(tf_keras_policy.Policy):
    """The deprecated tf.keras policy with a loss scale.

    Prefer `keras_dtype_policy.DTypePolicy`, and a `LossScaleOptimizer` for
    loss scaling. A model compiled under this policy gets the loss scale it
    names. As tf.keras did, deserializing it through Keras' own functions
    (`deserialize_keras_object`, a layer's `from_config`, `load_model`)
    yields the non-experimental `DTypePolicy` and drops the loss scale; this
    package warns once when it does.

    Args:
        name: A `DTypePolicy` name, or one of the infer policies: `"infer"`
            (or `"_infer"`), whose layers take the dtype of their first input
            on their first call, and `"infer_with_float32_vars"`, which does
            so for the compute dtype only and keeps float32 variables.
        loss_scale: `"auto"` (dynamic for `"mixed_float16"`, none
            otherwise), a number for a `FixedLossScale`, `"dynamic"` for a
            `DynamicLossScale`, None for no loss scaling, or a loss-scale
            value.

    Example:

    >>> policy = Policy("mixed_float16", loss_scale=1024)
    >>> policy.loss_scale
    FixedLossScale(loss_scale_value=1024.0)
    """

    _policy_kind = "legacy"

    def __init__(self, name, loss_scale=_AUTO):
        warnings.warn(
            "keras_dtype_policy.Policy is deprecated: use "
            "keras_dtype_policy.DTypePolicy, and a "
            "keras_dtype_policy.LossScaleOptimizer for loss scaling.",
            DeprecationWarning,
            stacklevel=2,
        )
        self._setup(name, loss_scale)

    @classmethod
    def create(cls, name, loss_scale=_AUTO):
        """Builds a `Policy` without the deprecation warning."""
        policy = cls.__new__(cls)
        policy._setup(name, loss_scale)
        return policy

    def _setup(self, name, loss_scale):
        self._name = name
        self._compute_dtype, self._variable_dtype = self._parse_name(name)
        self._quantization_mode = None
        self._using_default_loss_scale = (
            isinstance(loss_scale, str) and loss_scale == _AUTO
        )
        if self._using_default_loss_scale:
            loss_scale = "dynamic" if name == "mixed_float16" else None
        elif loss_scale and self._compute_dtype not in (None, "float16"):
            # tf.keras' warning, word for word.
            warnings.warn(
                "Creating a Policy with a loss scale is only useful for "
                f"float16 policies. You passed loss_scale={loss_scale!r} for "
                f"policy {name}. Consider not passing any loss_scale "
                "instead.",
                UserWarning,
                stacklevel=3,
            )
        self._loss_scale = get_loss_scale(loss_scale)

    @property
    def loss_scale(self):
        """The loss scale of this policy: a loss-scale value, or None."""
        return self._loss_scale

    def get_config(self):
        """Returns the name, and the loss scale unless it is the default.

        As in tf.keras, a policy built without a `loss_scale` argument
        writes no `loss_scale` key.
        """
        config = {"name": self.name}
        if not self._using_default_loss_scale:
            config["loss_scale"] = serialize_loss_scale(self.loss_scale)
        return config

    @classmethod
    def from_config(cls, config):
        """Rebuilds a `Policy`, loss scale included, from its config."""
        if not isinstance(config, dict) or "name" not in config:
            raise ValueError(
                "A Policy config must be a dict with a 'name' key. "
                f"Received: config={config!r}"
            )
        unknown = set(config) - {"name", "loss_scale"}
        if unknown:
            raise ValueError(
                f"Unknown keys {sorted(unknown)} in a Policy config. "
                f"Received: config={config!r}"
            )
        return cls.create(config["name"], config.get("loss_scale", _AUTO))

    def __eq__(self, other):
        if not isinstance(other, Policy):
            return (
                NotImplemented
                if not isinstance(other, keras.DTypePolicy)
                else False
            )
        return self.name == other.name and self.loss_scale == other.loss_scale

    def __hash__(self):
        return hash((self._policy_kind, self.name, self.loss_scale))

    def __repr__(self):
        return (
            f'<Policy "{self.name}", '
            f"loss_scale={_loss_scale_repr(self.loss_scale)}>"
        )


def _loss_scale_repr(loss_scale):
    """TensorFlow 2.3's repr of a loss scale: `FixedLossScale(2.0)`."""
    if isinstance(loss_scale, FixedLossScale):
        return f"FixedLossScale({loss_scale.get_config()['loss_scale_value']})"
    return repr(loss_scale)


def set_policy(policy):
    """Sets the global policy, as tf.keras' `set_policy` did.

    Args:
        policy: A policy name (the infer names included), a policy object,
            or None, which restores the default float policy.

    Example:

    >>> set_policy("mixed_float16")  # layers built now compute in float16
    >>> set_policy(None)
    """
    if policy is None:
        policy = DTypePolicy(keras.config.floatx())
    elif isinstance(policy, str) and policy in INFER_POLICIES:
        policy = Policy.create(policy)
    elif isinstance(policy, str):
        policy = DTypePolicy(policy)
    install_global_policy(policy, stacklevel=4)


def install_global_policy(policy, stacklevel=3):
    """Checks a policy object and makes it the global policy.

    Args:
        policy: A `keras.DTypePolicy` that computes in a floating dtype (or
            infers its dtype).
        stacklevel: Where the slow-float16 warning points: 3 is this
            function's caller, 4 the caller's caller.

    Raises:
        TypeError: if `policy` is not a `keras.DTypePolicy`.
        ValueError: if it does not compute in a floating dtype.
    """
    if not isinstance(policy, keras.DTypePolicy):
        raise TypeError(
            "`policy` must be a policy name, a DTypePolicy or None. "
            f"Received: policy={policy!r} (of type {type(policy).__name__})"
        )
    compute_dtype = policy.compute_dtype
    if compute_dtype is not None and not keras.backend.is_float_dtype(
        compute_dtype
    ):
        # tf.keras' wording.
        raise ValueError(
            "set_global_policy can only be used to set the global policy to "
            'floating-point policies, such as "float32" and '
            f'"mixed_float16", but got policy: {policy.name}'
        )
    hardware.warn_if_float16_is_slow(policy, stacklevel=stacklevel)
    keras.config.set_dtype_policy(policy)


def get_layer_policy(layer):
    """Returns the dtype policy of a layer, as tf.keras' did.

    Args:
        layer: A `keras.layers.Layer`.

    Returns:
        The layer's `dtype_policy`.

    Raises:
        ValueError: if `layer` is not a layer (tf.keras' error type).
    """
    if not isinstance(layer, keras.layers.Layer):
        raise ValueError(
            "get_policy can only be called on a layer, but got: "
            f"{layer!r}. Received: layer={layer!r} "
            f"(of type {type(layer).__name__})"
        )
    return layer.dtype_policy
