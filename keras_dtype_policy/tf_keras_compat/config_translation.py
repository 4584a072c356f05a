"""Rewriting saved model configs into forms every Keras 3 backend reads.

Keras 3 reads most of a tf.keras 2 model config as it is, and a Keras 3
config from any backend. What it cannot read, this rewrites, and nothing
else:

- policies: tf.keras' `Policy`/`PolicyV1` dicts become the policy name (a
  loss scale is dropped, with a warning), and `None`, which tf.keras wrote
  for its `_infer` policy, becomes `"_infer"`;
- model classes saved under tf.keras modules (`tf_keras.src.engine...`);
- tf.keras' `LossScaleOptimizer` (`LossScaleOptimizerV3`), which becomes
  this package's `LossScaleOptimizer`, and optimizer keys Keras 3 rejects;
- layer arguments Keras 3's layers do not take, by the derived table of
  `layer_arguments` (`time_major`, a convolution's `groups`, ...; a value
  that would change the computation raises), `batch_input_shape` on a
  layer other than an InputLayer, and one-element `axis` lists;
- layer names holding "/" (tf.keras' applications), which Keras 3 refuses;
- a `Lambda`'s bytecode in tf.keras' list form, which becomes Keras 3's
  `__lambda__` form: Keras refuses it in safe mode, with its message;
- tf.keras' loss objects in compile configs (`fn`, `reduction="auto"`:
  see `compile_objects`);
- MultiHeadAttention's saved shapes (`attention_configs`), and the call
  graph's nested-model node numbers and keyword tensors
  (`functional_nodes`);
- optimizers saved under a backend's own module (a model compiled on torch
  saves `keras.src.backend.torch.optimizers.torch_adam`), which load on that
  backend only and would import it: they become the backend-neutral
  `keras.optimizers` class.

The rewrite never imports or calls anything a config names.
"""

import copy
import re

from keras_dtype_policy.loss_scaling.inner_optimizer_config import (
    without_tf_keras_keys,
)
from keras_dtype_policy.loss_scaling.optimizer import LossScaleOptimizer
from keras_dtype_policy.policies.registration import registered_name
from keras_dtype_policy.tf_keras_compat import attention_configs
from keras_dtype_policy.tf_keras_compat import compile_objects
from keras_dtype_policy.tf_keras_compat import functional_nodes
from keras_dtype_policy.tf_keras_compat import layer_arguments
from keras_dtype_policy.tf_keras_compat import legacy_policy_configs

_TF_KERAS_MODULE_PREFIXES = ("tf_keras.", "keras.src.engine.", "keras.engine.")
_MODEL_CLASSES = {
    "Functional": ("keras.src.models.functional", "Functional"),
    "Sequential": ("keras", None),
    "Model": ("keras.src.models.functional", "Functional"),
}
_LOSS_SCALE_OPTIMIZERS = (
    "LossScaleOptimizerV3",
    "LossScaleOptimizerV1",
    "LossScaleOptimizer",
)
_BACKEND_OPTIMIZER_MODULE = re.compile(
    r"keras\.src\.backend\.(jax|numpy|openvino|tensorflow|torch)\.optimizers\."
)
# Loss and metric short names that Keras 3's loaders cannot deserialize.
_LOSS_ALIASES = {
    "mse": "mean_squared_error",
    "mae": "mean_absolute_error",
    "mape": "mean_absolute_percentage_error",
    "msle": "mean_squared_logarithmic_error",
}
# Compile arguments that tf.keras saved as None and Keras 3 needs set.
_COMPILE_DEFAULTS = {
    "steps_per_execution": 1,
    "jit_compile": "auto",
    "run_eagerly": False,
}


def is_tf_keras_config(config):
    """Returns True if a model config shows tf.keras 2 as its writer."""
    if not isinstance(config, dict):
        return False
    version = config.get("keras_version")
    if isinstance(version, str) and version.startswith("2."):
        return True
    module = config.get("module")
    if isinstance(module, str) and module.startswith(_TF_KERAS_MODULE_PREFIXES):
        return True
    inner = config.get("config")
    layers = inner.get("layers") if isinstance(inner, dict) else None
    return isinstance(layers, list) and any(
        isinstance(layer, dict)
        and "batch_input_shape" in (layer.get("config") or {})
        for layer in layers
    )


def translate_model_config(config):
    """Returns a copy of a model config that Keras 3 can deserialize.

    Args:
        config: A model config dict, as tf.keras 2 or Keras 3 wrote it.
            Keras 3 configs come back unchanged.

    Returns:
        The rewritten copy.
    """
    from_tf_keras = is_tf_keras_config(config)
    return _translate(copy.deepcopy(config), from_tf_keras)


def translate_optimizer_config(config):
    """Returns an optimizer config that Keras 3 (with this package) reads."""
    if not isinstance(config, dict):
        return config
    config = copy.deepcopy(config)
    if _is_tf_keras_loss_scale_optimizer(config):
        inner = dict(config.get("config") or {})
        for key in ("inner_optimizer", "optimizer"):  # "optimizer": TF 2.3
            if isinstance(inner.get(key), dict):
                inner[key] = translate_optimizer_config(inner[key])
        return {
            "module": "keras_dtype_policy.loss_scaling.optimizer",
            "class_name": "LossScaleOptimizer",
            "config": inner,
            "registered_name": "keras_dtype_policy>LossScaleOptimizer",
        }
    class_name = config.get("class_name")
    inner = config.get("config")
    if _is_backend_optimizer(config):
        config["module"] = "keras.optimizers"
        config["registered_name"] = None
    if isinstance(class_name, str) and isinstance(inner, dict):
        if "is_legacy_optimizer" in inner or "jit_compile" in inner:
            # tf.keras 2.11+ optimizers; "Custom>Adam" in .h5 files.
            config["class_name"] = class_name.removeprefix("Custom>")
            config["config"] = without_tf_keras_keys(inner)
            if "learning_rate" in config["config"]:
                config["config"]["learning_rate"] = (
                    compile_objects.translate_learning_rate(
                        config["config"]["learning_rate"]
                    )
                )
    return config


def translate_compile_config(config):
    """Returns a tf.keras compile (or .h5 training) config for Keras 3."""
    config = dict(config)
    for key, default in _COMPILE_DEFAULTS.items():
        if key in config and config[key] is None:
            config[key] = default
    for key in ("loss", "metrics", "weighted_metrics"):
        if key in config:
            config[key] = _unalias_losses(config[key])
    if "loss" in config:
        config["loss"] = compile_objects.translate_losses(config["loss"])
    for key in ("metrics", "weighted_metrics"):
        if key in config:
            config[key] = compile_objects.translate_metrics(config[key])
    for key in ("optimizer", "optimizer_config"):
        if isinstance(config.get(key), dict):
            config[key] = translate_optimizer_config(config[key])
    return config


def _unalias_losses(value):
    if isinstance(value, str):
        return _LOSS_ALIASES.get(value, value)
    if isinstance(value, list):
        return [_unalias_losses(v) for v in value]
    if isinstance(value, dict) and "class_name" not in value:
        return {k: _unalias_losses(v) for k, v in value.items()}
    return value


def _is_backend_optimizer(config):
    module = config.get("module")
    return isinstance(module, str) and bool(
        _BACKEND_OPTIMIZER_MODULE.match(module)
    )


def _is_tf_keras_loss_scale_optimizer(config):
    if config.get("class_name") not in _LOSS_SCALE_OPTIMIZERS:
        return False
    module = config.get("module")
    registered = config.get("registered_name")
    if registered == registered_name_of_ours():
        return False
    if registered in ("LossScaleOptimizerV3", "LossScaleOptimizerV1"):
        return True
    return module is None or (
        isinstance(module, str) and module.startswith(_TF_KERAS_MODULE_PREFIXES)
    )


def registered_name_of_ours():
    return registered_name(LossScaleOptimizer)


def _translate(node, from_tf_keras):
    if isinstance(node, list):
        return [_translate(item, from_tf_keras) for item in node]
    if not isinstance(node, dict):
        return node
    if "class_name" in node and isinstance(node.get("config"), dict):
        node = _translate_object(node, from_tf_keras)
    if from_tf_keras and isinstance(node.get("compile_config"), dict):
        node["compile_config"] = translate_compile_config(
            node["compile_config"]
        )
    return {
        key: _translate(value, from_tf_keras) for key, value in node.items()
    }


def _translate_object(node, from_tf_keras):
    class_name = node["class_name"]
    module = node.get("module")
    if class_name in _MODEL_CLASSES and (
        (module is None and from_tf_keras)
        or (
            isinstance(module, str)
            and module.startswith(_TF_KERAS_MODULE_PREFIXES)
        )
    ):
        new_module, new_registered = _MODEL_CLASSES[class_name]
        node["module"] = new_module
        node["class_name"] = new_registered or class_name
        node["registered_name"] = new_registered
    if (
        class_name in _LOSS_SCALE_OPTIMIZERS
        or "is_legacy_optimizer" in node["config"]
        or _is_backend_optimizer(node)
    ):
        return translate_optimizer_config(node)
    inner = node["config"]
    if "dtype" in inner:
        inner["dtype"] = _translate_dtype(inner["dtype"], from_tf_keras)
    if class_name == "Lambda":
        _translate_lambda(inner)
    if from_tf_keras:
        # Before the keys Keras 3 refuses go: the saved shapes become a
        # build config.
        attention_configs.translate_attention(node)
    # Keys Keras 3 refuses: never in a Keras 3 config, so always safe.
    layer_arguments.drop_unused(class_name, inner)
    if from_tf_keras:
        axis = inner.get("axis")
        if isinstance(axis, list) and len(axis) == 1:
            inner["axis"] = axis[0]
        if class_name == "InputLayer" and "batch_input_shape" in inner:
            inner["batch_shape"] = inner.pop("batch_input_shape")
        if class_name == "Sequential":
            _give_sequential_an_input(inner)
        elif class_name != "InputLayer":
            # The InputLayer tf.keras wrote before the layer carries it too.
            inner.pop("batch_input_shape", None)
        if class_name in _MODEL_CLASSES:
            functional_nodes.translate_nodes(inner)
            node["config"] = _without_slashed_layer_names(inner)
    return node


def _translate_lambda(config):
    """Puts tf.keras' `[code, defaults, closure]` into Keras 3's form."""
    for key, kind in (("function", "function_type"), ("output_shape", None)):
        value = config.get(key)
        kind_key = kind or f"{key}_type"
        if config.get(kind_key) == "lambda" and isinstance(value, list):
            code, defaults, closure = (list(value) + [None, None])[:3]
            config[key] = {
                "class_name": "__lambda__",
                "config": {
                    "code": code,
                    "defaults": defaults,
                    "closure": closure,
                },
            }
        config.pop(kind_key, None)


def _give_sequential_an_input(config):
    """Puts the shape a first layer carried into an InputLayer before it."""
    layers = config.get("layers")
    if not (isinstance(layers, list) and layers):
        return
    first = layers[0]
    if not isinstance(first, dict) or first.get("class_name") == "InputLayer":
        return
    shape = (first.get("config") or {}).get("batch_input_shape")
    if isinstance(shape, list):
        layers.insert(
            0,
            {
                "class_name": "InputLayer",
                "config": {"batch_shape": shape, "dtype": "float32"},
            },
        )


def _without_slashed_layer_names(config):
    """Renames the layers whose names hold "/", which Keras 3 refuses.

    tf.keras' applications name layers "conv1/conv"; each "/" becomes "_"
    wherever the model config names the layer (its own config, the nodes
    that call it, the model's inputs and outputs). Weights do not move: .h5
    files find them by the saved names in order, .keras files by position.
    """
    layers = config.get("layers")
    if not isinstance(layers, list):
        return config
    names = [(layer.get("config") or {}).get("name") for layer in layers]
    renames = {
        name: name.replace("/", "_")
        for name in names
        if isinstance(name, str) and "/" in name
    }
    if not renames:
        return config
    return _renamed(config, renames)


def _renamed(node, renames):
    if isinstance(node, str):
        return renames.get(node, node)
    if isinstance(node, list):
        return [_renamed(item, renames) for item in node]
    if isinstance(node, dict):
        return {key: _renamed(value, renames) for key, value in node.items()}
    return node


def _translate_dtype(dtype, from_tf_keras):
    if dtype is None and from_tf_keras:
        return "_infer"
    if legacy_policy_configs.is_legacy_policy_config(dtype):
        policy = legacy_policy_configs.policy_from_legacy_config(dtype)
        return policy.name
    return dtype
