"""What a command prints for a failure: one line, whatever went wrong.

Imports no Keras: the command line's parser must work where Keras does not
import.
"""

import zipfile

from keras_dtype_policy.tf_keras_compat.file_limits import FileLimitError
from keras_dtype_policy.tools.cli_arguments import CommandError


def one_line(text):
    """Returns `text` with its lines joined: an error is one line."""
    lines = [line.strip() for line in str(text).splitlines()]
    return " ".join(line for line in lines if line) or "unknown error"


def describe(error):
    """Returns what a reader's or a command's exception says, in words.

    Args:
        error: An exception that a file or the work on it raised.
    """
    if isinstance(error, zipfile.BadZipFile):
        return f"a broken zip archive: {error}"
    if isinstance(error, MemoryError):
        return "does not fit in memory"
    if isinstance(error, RecursionError):
        return "is nested too deeply to be read"
    if isinstance(error, OSError) and error.strerror:
        where = f" ({error.filename})" if error.filename else ""
        return f"{error.strerror}{where}"
    if isinstance(error, FileLimitError):
        return str(error)
    if isinstance(error, RuntimeError) and type(error) is RuntimeError:
        return f"cannot be read: {error}"  # h5py: a damaged HDF5 file
    return f"{type(error).__name__}: {error}"


def file_failure(path, error):
    """Returns the `CommandError` for a file that a command could not use.

    Args:
        path: The file the user named.
        error: What reading or using it raised.
    """
    if isinstance(error, CommandError):
        return error
    return CommandError(f"{path}: {describe(error)}")
