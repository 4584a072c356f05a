""".keras and .h5 model files: what they hold, read and loaded with Keras.

A `.keras` file is a zip archive with a `config.json` (the model, with its
`compile_config`) and a `metadata.json`; a legacy `.h5` file is HDF5 with
`model_config` and `training_config` attributes. Both may have been written
by tf.keras 2 or by Keras 3. Every problem with a file raises
`ModelFileError` with a message meant for the person who named the file.
"""

import contextlib
import dataclasses
import json
import logging
import pathlib
import warnings
import zipfile

import keras

from keras_dtype_policy.tf_keras_compat import config_translation
from keras_dtype_policy.tf_keras_compat import file_limits

KERAS_SUFFIXES = (".keras",)
H5_SUFFIXES = (".h5", ".hdf5")
_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
# Warnings of Keras' loaders that say nothing about the file.
_UNINFORMATIVE = (
    "Compiled the loaded model, but the compiled metrics have yet to be built",
)


class ModelFileError(Exception):
    """A file that does not exist, is not a model, or does not load."""


@dataclasses.dataclass
class ModelFile:
    """What a saved model file holds, read without building the model.

    Attributes:
        path: The file.
        format: `"keras"` (a `.keras` zip), `"h5"` (legacy HDF5) or
            `"savedmodel"` (a tf.keras 2 SavedModel directory).
        model_config: The model's config, as saved.
        compile_config: The saved compile (or `.h5` training) config, or
            None for a model saved without compiling.
        keras_version: The Keras version that wrote the file, if recorded.
    """

    path: pathlib.Path
    format: str
    model_config: dict
    compile_config: dict | None = None
    keras_version: str | None = None

    @property
    def from_tf_keras(self):
        """True if tf.keras 2 wrote the file."""
        if self.keras_version is not None:
            return self.keras_version.startswith("2.")
        return config_translation.is_tf_keras_config(self.model_config)

    @property
    def writer(self):
        """Who wrote the file, for people: `"tf.keras 2.21.0"`."""
        if self.keras_version is None:
            return "tf.keras 2" if self.from_tf_keras else "Keras"
        name = "tf.keras" if self.from_tf_keras else "Keras"
        return f"{name} {self.keras_version}"

    @property
    def holds_loss_scale_state(self):
        """True if the file saved a loss scale's current value and counter.

        tf.keras 2's `.h5` and `.keras` files did not; its SavedModel
        directories did, in their checkpoint.
        """
        return self.format == "savedmodel"


def load_path(path):
    """Loads a `.keras` or `.h5` file with Keras; returns `(model, messages)`.

    Args:
        path: The file.

    Returns:
        The model, its optimizer built, and the warnings loading gave.

    Raises:
        ModelFileError: if Keras cannot load it, or it holds no model.
    """
    with _captured_messages() as messages:
        try:
            model = keras.saving.load_model(path)
            if isinstance(model, keras.Model):
                build_optimizer(model)
        except Exception as error:
            cause = innermost_cause(error)
            raise ModelFileError(
                f"{path}: cannot be loaded: "
                f"{type(cause).__name__}: {_first_line(cause)}"
            ) from error
        if not isinstance(model, keras.Model):
            raise ModelFileError(
                f"{path}: holds a {type(model).__name__}, not a model"
            )
    return model, messages


@contextlib.contextmanager
def _captured_messages():
    """Collects the warnings of a block instead of printing them."""
    messages = []
    handler = _ListHandler(messages)
    absl_logger = logging.getLogger("absl")
    propagate = absl_logger.propagate
    absl_logger.addHandler(handler)
    absl_logger.propagate = False
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield messages
    finally:
        absl_logger.removeHandler(handler)
        absl_logger.propagate = propagate
    for warning in caught:
        if not issubclass(
            warning.category, (DeprecationWarning, PendingDeprecationWarning)
        ):
            handler.add(warning.message)


class _ListHandler(logging.Handler):
    def __init__(self, messages):
        super().__init__(level=logging.WARNING)
        self._messages = messages

    def emit(self, record):
        self.add(record.getMessage())

    def add(self, message):
        text = _first_line(message)
        if text not in self._messages and not text.startswith(_UNINFORMATIVE):
            self._messages.append(text)


def build_optimizer(model):
    """Builds a compiled model's optimizer, if it is not built yet.

    Keras' `.h5` loader leaves it unbuilt, the saved state pending.
    """
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not optimizer.built:
        optimizer.build(model.trainable_variables)


def read_keras_file(path):
    """Reads the configs of a `.keras` file; returns a `ModelFile`."""
    try:
        with _limits_as_file_errors(), zipfile.ZipFile(path) as archive:
            config, metadata = _read_archive(path, archive)
    except zipfile.BadZipFile as error:
        raise ModelFileError(
            f"{path}: not a .keras file (a broken zip archive: {error})"
        ) from None
    except (OSError, EOFError, RuntimeError, ValueError) as error:
        raise _unreadable(path, error) from None
    check_model_config(path, config)
    compile_config = config.get("compile_config")
    return ModelFile(
        path=path,
        format="keras",
        model_config=config,
        compile_config=compile_config if compile_config else None,
        keras_version=version_string(metadata.get("keras_version")),
    )


def _read_archive(path, archive):
    """Returns a `.keras` archive's config and metadata, sizes checked."""
    members = {info.filename: info for info in archive.infolist()}
    for info in members.values():
        file_limits.check_zip_member_size(info.filename, info.file_size)
    if "config.json" not in members:
        raise ModelFileError(
            f"{path}: not a .keras model file (it holds no config.json)"
        )
    config = _read_json_member(path, archive, members["config.json"])
    metadata = {}
    if "metadata.json" in members:
        metadata = _read_json_member(path, archive, members["metadata.json"])
    if not isinstance(metadata, dict):
        raise ModelFileError(f"{path}: its metadata.json is not an object")
    if "model.weights.h5" in members:
        import h5py

        with archive.open("model.weights.h5") as member:
            with h5py.File(member, "r") as weights:
                file_limits.check_h5_sizes(weights, f"{path}: model.weights.h5")
    return config, metadata


def _read_json_member(path, archive, info):
    if info.file_size > file_limits.MAX_CONFIG_BYTES:
        raise ModelFileError(
            f"{path}: its {info.filename} expands to {info.file_size} bytes, "
            f"more than the {file_limits.MAX_CONFIG_BYTES} this package reads"
        )
    return _parse_json(path, archive.read(info.filename), info.filename)


def read_h5_file(path):
    """Reads the configs of a `.h5` file; returns a `ModelFile`."""
    import h5py

    with open(path, "rb") as f:
        signature = f.read(len(_HDF5_SIGNATURE))
    if signature != _HDF5_SIGNATURE:
        raise ModelFileError(f"{path}: not an HDF5 file")
    try:
        with _limits_as_file_errors(), h5py.File(path, "r") as f:
            file_limits.check_h5_sizes(f, str(path))
            attributes = {
                name: f.attrs[name]
                for name in ("model_config", "training_config", "keras_version")
                if name in f.attrs
            }
            has_weights = "layer_names" in f.attrs
            groups = set(f.keys())
    except (OSError, RuntimeError, KeyError, TypeError, ValueError) as error:
        raise _unreadable(path, error) from None
    if "model_config" not in attributes:
        if not has_weights and not {"layers", "vars"} <= groups:
            raise ModelFileError(
                f"{path}: not a Keras file: an HDF5 file with neither a "
                "model nor Keras weights"
            )
        raise ModelFileError(
            f"{path}: holds weights only, no model: load it with "
            "model.load_weights() into a model you build"
        )
    config = _parse_json(path, attributes["model_config"], "model_config")
    check_model_config(path, config)
    training_config = attributes.get("training_config")
    if training_config is not None:
        training_config = _parse_json(path, training_config, "training_config")
        if not isinstance(training_config, dict):
            raise ModelFileError(
                f"{path}: its training_config is not an object"
            )
    return ModelFile(
        path=path,
        format="h5",
        model_config=config,
        compile_config=training_config,
        keras_version=version_string(attributes.get("keras_version")),
    )


@contextlib.contextmanager
def _limits_as_file_errors():
    """Turns the refusals of `file_limits` into `ModelFileError`s."""
    try:
        yield
    except file_limits.FileLimitError as error:
        raise ModelFileError(str(error)) from None


def version_string(value):
    """Returns a saved `keras_version` as a string, or None if it is not one.

    A version of another type says nothing: the config tells the writer.
    """
    if isinstance(value, bytes):
        value = value.decode("utf-8", errors="replace")
    return str(value) if isinstance(value, str) else None


def _parse_json(path, text, what):
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    if not isinstance(text, str):
        raise ModelFileError(
            f"{path}: its {what} is not JSON text but a {type(text).__name__}"
        )
    try:
        return json.loads(text)
    except (TypeError, ValueError) as error:
        raise ModelFileError(
            f"{path}: its {what} is not JSON: {error}"
        ) from None
    except RecursionError:
        raise ModelFileError(
            f"{path}: its {what} is nested more than "
            f"{file_limits.MAX_CONFIG_DEPTH} levels deep"
        ) from None


def check_model_config(path, config):
    """Refuses a model config with no class to build, or past the limits."""
    if not isinstance(config, dict) or not isinstance(
        config.get("class_name"), str
    ):
        raise ModelFileError(f"{path}: its model config names no class")
    if not isinstance(config.get("config"), (dict, list)):
        raise ModelFileError(
            f"{path}: its model config has no 'config' to build "
            f"{config['class_name']!r} from"
        )
    with _limits_as_file_errors():
        file_limits.check_model_config(config, str(path))


def innermost_cause(error):
    """Returns the exception at the root of `error`'s chain of causes.

    Keras' loaders wrap the error that stopped them (such as "Could not
    locate class ...") in more general ones.
    """
    seen = {id(error)}
    while True:
        cause = error.__cause__ or error.__context__
        if cause is None or id(cause) in seen:
            return error
        seen.add(id(cause))
        error = cause


def _unreadable(path, error):
    """The `ModelFileError` for `error`, raised reading `path` (`error`
    itself when it already is one)."""
    if isinstance(error, ModelFileError):
        return error
    return ModelFileError(
        f"{path}: cannot be read: {type(error).__name__}: {_first_line(error)}"
    )


def _first_line(message):
    text = str(message).strip()
    # Keras ends some messages with the whole config of the object.
    text = text.split(" Full object config:")[0]
    return text.splitlines()[0] if text else type(message).__name__
