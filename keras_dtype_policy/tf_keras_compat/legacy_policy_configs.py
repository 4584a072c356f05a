"""Reading the policy configs that tf.keras wrote, and the legacy `Policy`'s.

tf.keras serialized its policies as `{"class_name": "Policy", ...}`,
`{"class_name": "PolicyV1", "config": {"name": ..., "loss_scale": ...}}` or
`{"module": "keras.mixed_precision", "class_name": "Policy", ...}`; Keras 3
reads none of these. As tf.keras 2.4+ did, such a config comes back as the
non-experimental `mixed_precision.Policy` of its name (the infer names
included), and a loss scale in it is dropped, with a warning that names it.
"""

import warnings
from typing import Any

import keras

from keras_dtype_policy.loss_scaling.loss_scale import get_loss_scale
from keras_dtype_policy.policies.policy import DTypePolicy
from keras_dtype_policy.policies.registration import PACKAGE
from keras_dtype_policy.policies.registration import registered_name
from keras_dtype_policy.tf_keras_compat.legacy_policy import INFER_POLICIES
from keras_dtype_policy.tf_keras_compat.legacy_policy import Policy
from keras_dtype_policy.tf_keras_compat.tf_keras_policy import (
    Policy as NonExperimentalPolicy,
)

_LEGACY_CLASS_NAMES = ("Policy", "PolicyV1")
# Dropped loss scales already reported in this process.
_reported_scales: set[Any] = set()


def is_legacy_policy_config(config):
    """Returns True for a policy config that tf.keras wrote."""
    if not isinstance(config, dict):
        return False
    if config.get("class_name") not in _LEGACY_CLASS_NAMES:
        return False
    registered = config.get("registered_name")
    return not (isinstance(registered, str) and registered.startswith(PACKAGE))


def policy_from_legacy_config(config):
    """Returns the non-experimental policy a tf.keras policy config names.

    Args:
        config: A tf.keras policy config, or this package's serialized
            `Policy`.

    Returns:
        A fresh tf.keras 2.4+ `mixed_precision.Policy` of the config's name
        (for an infer name too, as tf.keras 2.4+ revived `PolicyV1("_infer")`).
    """
    inner = config.get("config")
    if not isinstance(inner, dict) or "name" not in inner:
        raise ValueError(
            "A serialized policy needs a 'config' dict with a 'name'. "
            f"Received: dtype={config!r}"
        )
    name = inner["name"]
    loss_scale = inner.get("loss_scale")
    if loss_scale is not None:
        report_dropped_loss_scale(name, get_loss_scale(loss_scale))
    return NonExperimentalPolicy(name)


def policy_for_name(name):
    """Returns a fresh `mixed_precision.Policy` for an infer name (as
    tf.keras 2.4+ gave a layer built with `dtype="_infer"`), or a
    `DTypePolicy` for `name`."""
    if isinstance(name, str) and name in INFER_POLICIES:
        return NonExperimentalPolicy(name)
    return DTypePolicy(name)


def report_dropped_loss_scale(name, loss_scale):
    """Warns, once per loss scale and process, that it was dropped."""
    if loss_scale in _reported_scales:
        return
    _reported_scales.add(loss_scale)
    warnings.warn(
        f"The policy {name!r} was deserialized as the non-experimental "
        f"mixed_precision.Policy, as tf.keras 2.4+ did: its loss scale "
        f"{loss_scale!r} is dropped. To keep it, compile with "
        "keras_dtype_policy.LossScaleOptimizer, or rebuild the policy with "
        "keras_dtype_policy.Policy.from_config.",
        UserWarning,
        stacklevel=2,
    )


class _ExperimentalPolicyReviver:
    """What Keras' own deserialization finds under `Policy`'s name.

    `Policy.from_config` keeps the loss scale; Keras' functions
    (`deserialize_keras_object`, `from_config` of layers, `load_model`)
    revive the non-experimental policy instead, as tf.keras did.
    """

    @classmethod
    def from_config(cls, config):
        return policy_from_legacy_config({"config": config})


keras.saving.get_custom_objects()[registered_name(Policy)] = (
    _ExperimentalPolicyReviver
)
