"""Saved model files: which reader a path needs, and loading its model.

A `.keras` or `.h5` file is read and loaded by `keras_files`; a SavedModel
directory that tf.keras 2 wrote with `model.save(dir)` by
`saved_model_dirs`. Every problem with a file raises `ModelFileError` with
a message meant for the person who named the file.
"""

import os
import pathlib

from keras_dtype_policy.tf_keras_compat import file_limits
from keras_dtype_policy.tf_keras_compat import keras_files
from keras_dtype_policy.tf_keras_compat import saved_model_dirs
from keras_dtype_policy.tf_keras_compat.keras_files import ModelFile
from keras_dtype_policy.tf_keras_compat.keras_files import ModelFileError

__all__ = ["ModelFile", "ModelFileError", "load_model", "read_model_file"]


def read_model_file(path):
    """Reads the configs of a saved model without loading it.

    Args:
        path: A `.keras` or `.h5` (`.hdf5`) file, or a SavedModel directory
            that tf.keras 2 wrote (read without TensorFlow; loading it
            needs TensorFlow).

    Returns:
        A `ModelFile`.

    Raises:
        ModelFileError: if the file is missing, not a regular file or a
            directory (a FIFO, a device), or holds no model.
        TypeError: if `path` is not a path.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            "`path` must be a path (a str or a path-like). "
            f"Received: path={path!r} (of type {type(path).__name__})"
        )
    path = pathlib.Path(path)
    try:
        file_limits.check_path_kind(path, "path")
    except file_limits.FileLimitError as error:
        raise ModelFileError(f"{path}: {error}") from None
    if not path.exists():
        raise ModelFileError(f"{path}: no such file")
    if path.is_dir():
        return saved_model_dirs.read_saved_model_dir(path)
    suffix = path.suffix.lower()
    if suffix in keras_files.KERAS_SUFFIXES:
        return keras_files.read_keras_file(path)
    if suffix in keras_files.H5_SUFFIXES:
        return keras_files.read_h5_file(path)
    raise ModelFileError(
        f"{path}: not a model file: expected a name ending in .keras or .h5"
    )


def load_model(model_file):
    """Loads the model of a `ModelFile` with Keras, this package installed.

    The optimizer of a compiled model is built, so that the state that
    `.h5` files hold is in place.

    Args:
        model_file: A `ModelFile`.

    Returns:
        A `(model, messages)` pair: the Keras model, and the text of the
        warnings that loading gave (Python warnings other than deprecations,
        and the warnings Keras logs through absl), in order, without
        repeats.

    Raises:
        ModelFileError: if Keras cannot load the model (or, for a SavedModel
            directory, TensorFlow is not installed).
    """
    if model_file.format == "savedmodel":
        return saved_model_dirs.load_model(model_file)
    return keras_files.load_path(model_file.path)
