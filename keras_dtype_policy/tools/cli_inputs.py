"""The model and data a command runs on: `MODEL`, `--data` and `--import`.

Keras and the model files are imported inside the functions: the command
line's parser must work where Keras does not import.
"""

import re

from keras_dtype_policy.tf_keras_compat import file_limits
from keras_dtype_policy.tools.cli_arguments import CommandError
from keras_dtype_policy.tools.cli_data import read_npz
from keras_dtype_policy.tools.cli_errors import file_failure
from keras_dtype_policy.tools.cli_imports import import_modules


def load_model_and_data(args):
    """Returns `(model, x, y)` for a command's `MODEL` and `--data`.

    The `--import` modules are imported first; `x` comes in the
    structure of the model's inputs (by name, where the file holds no
    array `x`); `y` is None without labels.

    Args:
        args: The parsed arguments, with `model`, `data`, `samples` and
            `imports`.

    Returns:
        The loaded model, its inputs and its labels.
    """
    import_modules(args.imports)
    x, y = read_data(args.data, args.samples)
    model = load_model(args.model)
    if isinstance(x, dict):
        x = _inputs_by_name(model, x, args.data)
    return model, x, y


def load_model(path):
    """Loads a model file, reporting what fails in one line."""
    from keras_dtype_policy.tf_keras_compat import model_files

    check_model_path(path, "MODEL")
    try:
        model, _ = model_files.load_model(model_files.read_model_file(path))
    except model_files.ModelFileError as error:
        raise CommandError(with_hint(error)) from None
    except Exception as error:
        raise file_failure(path, error) from None
    return model


def check_model_path(path, argument):
    """Refuses, before anything opens it, a path that is neither a regular
    file nor a directory (a FIFO would block for ever)."""
    try:
        file_limits.check_path_kind(path, argument)
    except file_limits.FileLimitError as error:
        raise CommandError(str(error)) from None


def read_data(path, samples):
    """Returns `(x, y)` from an `.npz` file; x a dict for named inputs."""
    if path is None:
        return None, None
    arrays = read_npz(path, samples)
    empty = [name for name, array in arrays.items() if not len(array)]
    if empty:
        raise CommandError(
            f"--data {path}: array {empty[0]!r} holds 0 samples: there is "
            "nothing to run the model on"
        )
    y = arrays.pop("y", None)
    if "x" in arrays:
        return arrays["x"], y
    if not arrays:
        raise CommandError(f"--data {path}: holds no array 'x'")
    return arrays, y


def _inputs_by_name(model, arrays, path):
    names = [tensor.name for tensor in model.inputs]
    missing = [name for name in names if name not in arrays]
    if missing:
        raise CommandError(
            f"--data {path}: holds no array 'x' and none for the model's "
            f"inputs {', '.join(missing)}"
        )
    values = [arrays[name] for name in names]
    return values[0] if len(values) == 1 else values


def with_hint(error):
    """Returns the message of a `ModelFileError`, with what to do about a
    class that Keras could not locate: import the module that defines it."""
    from keras_dtype_policy.tf_keras_compat.keras_files import innermost_cause

    message = str(error)
    cause = innermost_cause(error)
    if "Could not locate class" not in str(cause):
        return message
    module = re.search(r"'module': '([\w.]+)'", str(cause))
    if module and not module.group(1).startswith("keras"):
        return (
            f"{message} (import the module that defines it: --import "
            f"{module.group(1)})"
        )
    return f"{message} (import the module that defines it: --import MODULE)"
