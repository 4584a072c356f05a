"""Loading what tf.keras 2 saved: the hooks on Keras' loaders, and JSON."""

import functools
import json
import os
from typing import Any

import keras

from keras_dtype_policy.loss_scaling import state_arrival
from keras_dtype_policy.tf_keras_compat import config_translation
from keras_dtype_policy.tf_keras_compat import file_limits


def model_from_json(
    json_string: str | bytes, custom_objects: dict[str, Any] | None = None
) -> keras.Model:
    """Builds a model from the JSON that tf.keras 2's `to_json()` wrote.

    Keras 3's own `keras.models.model_from_json` reads only Keras 3 JSON.
    This reads both, with the policies of tf.keras (mixed precision
    included) translated.

    Args:
        json_string: The JSON text of a model architecture.
        custom_objects: Optional dict of custom classes or functions.

    Returns:
        An uncompiled Keras model, with freshly initialized weights.

    Raises:
        TypeError: if `json_string` is not a string.
        ValueError: if it is not JSON, names no class or config to build,
            is nested too deeply, or declares sizes past the limits of
            `file_limits` (such as `units` above 2**24).
    """
    config = _model_config(json_string)
    file_limits.check_model_config(config, "`json_string`")
    try:
        config = config_translation.translate_model_config(config)
        model = keras.models.model_from_json(
            json.dumps(config), custom_objects=custom_objects
        )
    except RecursionError:
        raise _too_deep() from None
    except (AttributeError, KeyError, IndexError) as error:
        # Keras' deserialization meets a value of the wrong type.
        raise ValueError(
            "`json_string` holds a config that cannot be built: "
            f"{type(error).__name__}: {error}. "
            f"Received: json_string={json_string[:80]!r}"
        ) from error
    if not isinstance(model, keras.layers.Layer):
        raise ValueError(
            "`json_string` must hold a model config, but it builds a "
            f"{type(model).__name__}. "
            f"Received: json_string={json_string[:80]!r}"
        )
    return model


def _model_config(json_string):
    """The config dict that `json_string` holds, its outline checked."""
    if not isinstance(json_string, (str, bytes)):
        raise TypeError(
            "`json_string` must be a JSON string. "
            f"Received: json_string of type {type(json_string).__name__}"
        )
    try:
        config = json.loads(json_string)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"`json_string` is not valid JSON: {error}. "
            f"Received: json_string={json_string[:80]!r}..."
        ) from None
    except RecursionError:
        raise _too_deep() from None
    if not isinstance(config, dict) or not isinstance(
        config.get("class_name"), str
    ):
        raise ValueError(
            "`json_string` must hold a model config with a 'class_name'. "
            f"Received: json_string={json_string[:80]!r}"
        )
    if not isinstance(config.get("config"), (dict, list)):
        raise ValueError(
            "`json_string` must hold a model config with a 'config' to "
            f"build {config['class_name']!r} from. "
            f"Received: json_string={json_string[:80]!r}"
        )
    return config


def _too_deep():
    return file_limits.FileLimitError(
        "`json_string` holds a config nested too deeply to build (more "
        f"than {file_limits.MAX_CONFIG_DEPTH} levels, or too deep for "
        "Python's recursion limit)"
    )


def make_model_from_config_json(original):
    """Wraps saving_lib's `_model_from_config` (the .keras loader).

    Keras compiles the model inside it (`compile_from_config`), then loads
    the saved state: the optimizer is compiled where state may arrive.
    """

    def model_from_config_json(config_json, *args, **kwargs):
        config = json.loads(config_json)
        file_limits.check_model_config(config, "config.json")
        config = config_translation.translate_model_config(config)
        with state_arrival.loading_saved_state():
            return original(json.dumps(config), *args, **kwargs)

    model_from_config_json.__wrapped__ = original
    return model_from_config_json


def make_model_from_config(original):
    """Wraps the legacy `model_from_config` (the .h5 loader)."""

    def model_from_config(config, custom_objects=None):
        if isinstance(config, dict):
            file_limits.check_model_config(config, "model_config")
            config = config_translation.translate_model_config(config)
        return original(config, custom_objects=custom_objects)

    model_from_config.__wrapped__ = original
    return model_from_config


def make_compile_args_from_training_config(original):
    """Wraps the legacy .h5 loader's reading of the optimizer config."""

    def compile_args_from_training_config(training_config, custom_objects=None):
        if isinstance(training_config, dict):
            training_config = config_translation.translate_compile_config(
                training_config
            )
        return original(training_config, custom_objects=custom_objects)

    compile_args_from_training_config.__wrapped__ = original
    return compile_args_from_training_config


def make_h5_model_loader(original):
    """Wraps the legacy .h5 model loader (see `state_arrival`).

    A FIFO or device is refused before it is opened, and the KeyError or
    AttributeError of a malformed file becomes a `MalformedFileError` (a
    ValueError, still the error it was) naming the file.
    """
    loader = state_arrival.make_h5_model_loader(original)

    @functools.wraps(original)
    def load_model_from_hdf5(filepath, *args, **kwargs):
        if isinstance(filepath, (str, os.PathLike)):
            file_limits.check_path_kind(filepath)
        with file_limits.malformed_as_value_errors(filepath):
            return loader(filepath, *args, **kwargs)

    return load_model_from_hdf5


def make_weights_loader(original):
    """Wraps `load_weights_only` (see `state_arrival`): a FIFO or device is
    refused before it is opened."""
    loader = state_arrival.make_weights_loader(original)

    @functools.wraps(original)
    def load_weights_only(model, filepath, *args, **kwargs):
        if isinstance(filepath, (str, os.PathLike)):
            file_limits.check_path_kind(filepath)
        return loader(model, filepath, *args, **kwargs)

    return load_weights_only
