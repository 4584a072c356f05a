"""The model a memory plan is for, without its weights, and the bytes of
its activations.

A plan needs the variables' shapes and dtypes and the layers' output
shapes, not the values: a `.keras` file or a config (such as a keras-hub
preset's `config.json`) is built inside a `keras.StatelessScope`, where
Keras creates each variable without allocating it, so that a model of a
billion parameters plans in a few megabytes. Nothing in a file runs:
configs are read as `inspect` reads them and built with `safe_mode=True`.
"""

import contextlib
import json
import math
import os
import pathlib

import keras
from keras.src.backend.common import global_state

from keras_dtype_policy.tf_keras_compat import file_limits
from keras_dtype_policy.tf_keras_compat import keras_files
from keras_dtype_policy.tf_keras_compat import model_files

# Where Keras lists the variables made in a stateless scope, to allocate
# them when the next stateless scope closes.
_DEFERRED = "uninitialized_variables"


def resolve_model(model):
    """Returns a `keras.Model` for what `plan` was given.

    Args:
        model: A built `keras.Model`; a path to a `.keras` file or to a
            JSON config (`{"class_name": ..., "config": ...}`, as
            keras-hub's `config.json`); or such a config as a dict.

    Raises:
        TypeError: if `model` is none of these.
        ValueError: if the file or config holds no model Keras can build.
    """
    if isinstance(model, keras.Model):
        if not model.built:
            raise ValueError(
                "`model` must be built (call it once, or give it an "
                f"Input). Received: model={model.name!r} (not built)"
            )
        return model
    if isinstance(model, dict):
        return build_from_config(model, "the config")
    if isinstance(model, (str, os.PathLike)):
        return _model_from_path(pathlib.Path(model))
    raise TypeError(
        "`model` must be a keras.Model, a path to a .keras file or a "
        "config.json, or a config dict. "
        f"Received: model={model!r} (of type {type(model).__name__})"
    )


def build_from_config(config, where):
    """Builds the model of a Keras config with no weight allocated.

    Args:
        config: A dict with `"class_name"` and `"config"`.
        where: What the config came from, for the error messages.
    """
    try:
        keras_files.check_model_config(where, config)
    except model_files.ModelFileError as error:
        raise ValueError(f"`model`: {error}") from None
    # Compiling would build an optimizer the plan does not need.
    config = {k: v for k, v in config.items() if k != "compile_config"}
    try:
        with _weights_deferred():
            built = keras.saving.deserialize_keras_object(
                config, safe_mode=True
            )
    except Exception as error:
        raise ValueError(
            f"`model`: {where} does not build: {type(error).__name__}: {error}"
        ) from None
    if not isinstance(built, keras.Model):
        raise ValueError(
            f"`model`: {where} builds a {type(built).__name__}, not a "
            "keras.Model"
        )
    return built


def activation_bytes(model, batch_size, compute_bytes):
    """Estimates the bytes of the activations a training step keeps.

    Every layer's outputs (for a nested model, its inner layers'), held
    for the backward pass, `batch_size` samples in the compute dtype.
    Dimensions unknown before the data comes (a sequence length) count
    as 1; a layer with no single symbolic output (a subclassed model's,
    a shared layer's) counts its model's outputs in its stead.

    Returns:
        `(bytes, note)`: the estimate, and what it had to assume, or "".
    """
    sizes, guessed = [], set()
    for layer in _leaf_layers(model):
        try:
            outputs = layer.output
        except (AttributeError, ValueError, RuntimeError):
            guessed.add("layers without one symbolic output")
            continue
        for tensor in keras.tree.flatten(outputs):
            dims = tuple(getattr(tensor, "shape", ()))[1:]
            if None in dims:
                guessed.add("unknown dimensions counted as 1")
            sizes.append(math.prod(d or 1 for d in dims))
    if not sizes:
        guessed.add("the model's outputs only")
        for tensor in keras.tree.flatten(getattr(model, "outputs", None)):
            sizes.append(math.prod(d or 1 for d in tensor.shape[1:]))
    total = sum(sizes) * batch_size * compute_bytes
    return int(total), "; ".join(sorted(guessed))


def _leaf_layers(model):
    for layer in model.layers:
        if isinstance(layer, keras.Model):
            yield from _leaf_layers(layer)
        elif not isinstance(layer, keras.layers.InputLayer):
            yield layer


def _model_from_path(path):
    if path.suffix.lower() == ".json":
        return build_from_config(_read_json_config(path), str(path))
    try:
        model_file = model_files.read_model_file(path)
    except model_files.ModelFileError as error:
        raise ValueError(f"`model`: {error}") from None
    if model_file.format != "keras":
        raise ValueError(
            "`model` must be a .keras file or a config.json. "
            f"Received: model={str(path)!r} ({model_file.format})"
        )
    return build_from_config(model_file.model_config, str(path))


def _read_json_config(path):
    try:
        file_limits.check_path_kind(path, "model")
        size = path.stat().st_size
        if size > file_limits.MAX_CONFIG_BYTES:
            raise ValueError(
                f"{size} bytes, more than the "
                f"{file_limits.MAX_CONFIG_BYTES} this package reads"
            )
        return json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except (
        OSError,
        ValueError,
        RecursionError,
        file_limits.FileLimitError,
    ) as error:
        raise ValueError(
            f"`model`: {path} is no JSON config: {error}"
        ) from None


@contextlib.contextmanager
def _weights_deferred():
    """Builds inside a stateless scope, and leaves the variables made
    there unallocated for good: Keras would otherwise allocate them when
    the next stateless scope (a JAX training step's) closes."""
    before = list(global_state.get_global_attribute(_DEFERRED, []) or [])
    try:
        with keras.StatelessScope(initialize_variables=False):
            yield
    finally:
        global_state.set_global_attribute(_DEFERRED, before)
