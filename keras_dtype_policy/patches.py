"""Every patch this package makes to Keras internals, and its undoing.

Each patch replaces one attribute of a Keras class or module and says in one
line why. `install()` applies them all once; `uninstall()` puts Keras' own
attributes back, the very same objects. If a Keras release moves a patched
attribute, `install()` raises instead of patching something else.

`INSTANCE_PATCHES` lists the methods set on single objects rather than on a
Keras class, each with its reason; `uninstall()` takes them off every object
that holds them, and `install()` does not set them again.

`KERAS_INTERNALS` lists the private names of Keras the package uses
without patching them (`internals_inventory`).
"""

import dataclasses
import types
from collections.abc import Callable
from typing import Any

import keras
from keras.src import dtype_policies
from keras.src.layers.layer import Layer
from keras.src.legacy.saving import legacy_h5_format
from keras.src.legacy.saving import saving_utils
from keras.src.ops.operation import Operation
from keras.src.optimizers.loss_scale_optimizer import (
    LossScaleOptimizer as KerasLossScaleOptimizer,
)
from keras.src.saving import saving_lib

from keras_dtype_policy import internals_inventory
from keras_dtype_policy.loss_scaling import additional_losses
from keras_dtype_policy.loss_scaling import compile_hook
from keras_dtype_policy.loss_scaling import keras_lso_from_config
from keras_dtype_policy.loss_scaling import state_arrival
from keras_dtype_policy.low_precision import float32_views
from keras_dtype_policy.low_precision import scattered_gradients
from keras_dtype_policy.low_precision import state_sharding
from keras_dtype_policy.policies import float8
from keras_dtype_policy.policies import keras_internals
from keras_dtype_policy.policies import keras_lookups
from keras_dtype_policy.policies import rules_application
from keras_dtype_policy.tf_keras_compat import bfloat16_weights
from keras_dtype_policy.tf_keras_compat import bridge as tf_keras_bridge
from keras_dtype_policy.tf_keras_compat import policy_deserialization


@dataclasses.dataclass(frozen=True)
class Patch:
    """One patched attribute.

    `owner` is the class or module that holds it, or a function of
    `keras_internals` that finds that class in the installed Keras.
    """

    owner: object
    attribute: str
    make_replacement: Callable[[Any], Any]
    why: str

    def find_owner(self):
        """Returns the class or module; raises if Keras has none."""
        if isinstance(self.owner, types.FunctionType):
            try:
                return self.owner()
            except keras_internals.KerasInternalsError as error:
                raise RuntimeError(
                    f"keras_dtype_policy cannot patch {self.attribute}: {error}"
                ) from error
        return self.owner

    @property
    def target(self):
        owner = self.find_owner()
        if isinstance(owner, types.ModuleType):
            return f"{owner.__name__}.{self.attribute}"
        return f"{owner.__module__}.{owner.__qualname__}.{self.attribute}"


PATCHES = (
    Patch(
        keras_internals.trainer_class,
        "compile",
        compile_hook.make_hooked_compile,
        "Wrap the optimizer for any float16 or loss-scale-carrying policy.",
    ),
    Patch(
        keras_internals.trainer_class,
        "_aggregate_additional_loss",
        additional_losses.make_aggregate_additional_loss,
        "Sum float16 and float32 regularization losses, as tf.keras did.",
    ),
    Patch(
        Operation,
        "from_config",
        policy_deserialization.make_from_config,
        "Keep this package's policy classes when layers are deserialized "
        "(and a float8 model's sublayers made in code in float8).",
    ),
    Patch(
        dtype_policies,
        "get",
        policy_deserialization.make_get,
        "Accept the tf.keras names: 'infer' policies and removed names.",
    ),
    Patch(
        dtype_policies,
        "deserialize",
        policy_deserialization.make_deserialize,
        "Read the policy configs that tf.keras wrote.",
    ),
    Patch(
        saving_lib,
        "_model_from_config",
        tf_keras_bridge.make_model_from_config_json,
        "Translate tf.keras 2 model configs in .keras files.",
    ),
    Patch(
        saving_utils,
        "model_from_config",
        tf_keras_bridge.make_model_from_config,
        "Translate tf.keras 2 model configs in .h5 files.",
    ),
    Patch(
        saving_utils,
        "compile_args_from_training_config",
        tf_keras_bridge.make_compile_args_from_training_config,
        "Translate tf.keras 2 optimizer configs in .h5 files.",
    ),
    Patch(
        legacy_h5_format,
        "load_model_from_hdf5",
        tf_keras_bridge.make_h5_model_loader,
        "Keep .h5 optimizer state past the loader's empty placeholder build; "
        "refuse FIFOs and devices, and name the file a KeyError comes from.",
    ),
    Patch(
        saving_lib,
        "load_weights_only",
        tf_keras_bridge.make_weights_loader,
        "Let load_weights restore optimizer state the way load_model does; "
        "refuse FIFOs and devices.",
    ),
    Patch(
        KerasLossScaleOptimizer,
        "from_config",
        keras_lso_from_config.make_keras_from_config,
        "Read tf.keras' LossScaleOptimizer configs in keras.optimizers.get.",
    ),
    Patch(
        Layer,
        "__init__",
        rules_application.make_layer_init,
        "Let a precision_scope choose the policy of each new layer, and "
        "give a float8 policy only to layers that can train in float8.",
    ),
    Patch(
        legacy_h5_format,
        "_set_weights",
        bfloat16_weights.make_set_weights,
        "Read the bfloat16 weights tf.keras wrote into .h5 as bfloat16.",
    ),
    Patch(
        saving_lib.H5IOStore,
        "__getitem__",
        bfloat16_weights.make_h5_store_getitem,
        "Read the bfloat16 weights tf.keras wrote into .keras as bfloat16.",
    ),
    Patch(
        Layer,
        "dtype_policy",
        float8.make_dtype_policy_property,
        "Give a model whose float8 layers already train in float8 the "
        "float8 policy's source when it is set, not a second quantize.",
    ),
    Patch(
        keras.dtype_policies,
        "get",
        keras_lookups.make_get,
        "Public name of dtype_policies.get, which keras-hub calls: "
        "know this package's names ('kahan_bfloat16').",
    ),
    Patch(
        keras.config,
        "set_dtype_policy",
        keras_lookups.make_set_dtype_policy,
        "Public name of set_dtype_policy: take this package's names.",
    ),
    Patch(
        keras.mixed_precision,
        "set_dtype_policy",
        keras_lookups.make_set_dtype_policy,
        "Legacy name of set_dtype_policy: take this package's names.",
    ),
    Patch(
        keras.mixed_precision,
        "set_global_policy",
        keras_lookups.make_set_dtype_policy,
        "Legacy name of set_dtype_policy: take this package's names.",
    ),
)


@dataclasses.dataclass(frozen=True)
class InstancePatch:
    """Methods set on single objects, not on a Keras class.

    `undo` takes them off every object that holds them.
    """

    objects: str
    attributes: tuple
    undo: Callable[[], None]
    why: str


INSTANCE_PATCHES = (
    InstancePatch(
        "optimizer instances that saved state is loaded into, and the inner "
        "optimizer of this package's LossScaleOptimizer",
        state_arrival.TAUGHT_METHODS,
        state_arrival.forget_taught,
        "Read tf.keras 2 optimizer state, keep state loaded before the "
        "first build, and skip state that does not fit, naming both layouts.",
    ),
    InstancePatch(
        "the inner optimizer of this package's LowPrecisionOptimizer",
        float32_views.ROUTED_METHODS,
        float32_views.unroute_all,
        "Send the inner optimizer's writes to the float32 views and to the "
        "rounded and quantized slots, make its quantized slots, and leave "
        "its saved values to the wrapper; the wrapper sets them again at its "
        "next step.",
    ),
    InstancePatch(
        "optimizer instances given to shard_optimizer_state, with their "
        "inner optimizers (not a loss-scale optimizer's own)",
        state_sharding.SHARDING_METHODS,
        state_sharding.unshard_all,
        "Lay the optimizer state made later out split along the "
        "data-parallel axis (ZeRO stage 1), never whole on any device, "
        "and save it whole: gathered from every process where it is split "
        "across processes, which Keras' own save_own_variables cannot read; "
        "on torch, run apply in Keras' DTensor promotion mode.",
    ),
    InstancePatch(
        "models given to shard_optimizer_state(model, reduce_scatter=True) "
        "(JAX)",
        scattered_gradients.SCATTER_METHODS,
        scattered_gradients.remove_all,
        "Compute each device's gradients in a shard_map and reduce-scatter "
        "them into the split state's layout, where Keras' train step "
        "all-reduces them whole.",
    ),
)


# The private names of Keras used as they are, not patched, each with its
# owner, users and reason: with the patches above, every reliance of the
# package on Keras internals.
KERAS_INTERNALS = internals_inventory.KERAS_INTERNALS

# target -> (owner, attribute, Keras' own attribute, our replacement), while
# installed.
_installed: dict = {}


def install() -> None:
    """Applies the patches; a second call changes nothing.

    Raises:
        RuntimeError: naming the target, if the installed Keras no longer
            has one; the patches this call applied are undone first.
    """
    applied = []
    try:
        for patch in PATCHES:
            owner = patch.find_owner()
            target = patch.target
            if target in _installed:
                continue
            original = vars(owner).get(patch.attribute)
            if original is None:
                raise RuntimeError(
                    f"keras_dtype_policy cannot patch {target}: this Keras "
                    "release no longer defines it there. Please report this."
                )
            replacement = patch.make_replacement(original)
            setattr(owner, patch.attribute, replacement)
            _installed[target] = (owner, patch.attribute, original, replacement)
            applied.append(target)
    except Exception:
        for target in reversed(applied):
            owner, attribute, original, _ = _installed.pop(target)
            setattr(owner, attribute, original)
        raise


def uninstall() -> None:
    """Restores Keras' own attributes; a second call changes nothing.

    The instance patches come off every object that holds them (see
    `INSTANCE_PATCHES`).
    """
    for owner, attribute, original, _ in reversed(list(_installed.values())):
        setattr(owner, attribute, original)
    _installed.clear()
    for patch in INSTANCE_PATCHES:
        patch.undo()


def is_installed() -> bool:
    """Returns True while the patches are in place."""
    return bool(_installed)


def installed_patches():
    """Returns `{target: (original, replacement)}` for the patches in place."""
    return {t: (o, r) for t, (_, _, o, r) in _installed.items()}
