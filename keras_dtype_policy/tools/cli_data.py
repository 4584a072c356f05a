"""`--data FILE.npz`: a file's arrays, their declared sizes bounded first.

Each member's `.npy` header is read and its shape bounded (see
`file_limits.check_declared_shape`) before any array memory is set aside;
only the first `samples` rows are read. Arrays of objects, strings or
anything but numbers are refused with the array named; nothing is
unpickled.
"""

import math
import zipfile

import numpy as np
from numpy.lib import format as npy_format

from keras_dtype_policy.tf_keras_compat import file_limits
from keras_dtype_policy.tools.cli_arguments import CommandError

# The dtype kinds a model's inputs and labels can be: bool, int, uint and
# float.
_NUMBER_KINDS = "biuf"
_HEADER_READERS = {
    (1, 0): npy_format.read_array_header_1_0,
    (2, 0): npy_format.read_array_header_2_0,
}


def read_npz(path, samples):
    """Returns the first `samples` rows of each array of an `.npz` file.

    Args:
        path: The `.npz` file.
        samples: The most rows to read from each array.

    Returns:
        A dict of array name to array.

    Raises:
        CommandError: for a file that is no `.npz`, a damaged one, or an
            array that is too large, not numbers or holds no samples.
    """
    where = f"--data {path}"
    try:
        file_limits.check_path_kind(path, "--data")
        with zipfile.ZipFile(path) as archive:
            return {
                _array_name(info.filename): _read_member(
                    archive, info, samples, where
                )
                for info in archive.infolist()
                if not info.is_dir()
            }
    except CommandError:
        raise
    except file_limits.FileLimitError as error:
        raise CommandError(str(error)) from None
    except FileNotFoundError:
        raise CommandError(f"{where}: cannot be read: no such file") from None
    except IsADirectoryError:
        raise CommandError(
            f"{where}: cannot be read: is a directory, not a file"
        ) from None
    except zipfile.BadZipFile as error:
        raise CommandError(
            f"{where}: not an .npz file, or a damaged one: {error}"
        ) from None
    except (OSError, ValueError, EOFError) as error:
        raise CommandError(f"{where}: cannot be read: {error}") from None
    except MemoryError:
        raise CommandError(f"{where}: does not fit in memory") from None


def _array_name(member):
    return member[: -len(".npy")] if member.endswith(".npy") else member


def _read_member(archive, info, samples, where):
    name = _array_name(info.filename)
    field = f"{where}: array {name!r}"
    file_limits.check_zip_member_size(info.filename, info.file_size)
    with archive.open(info) as stream:
        version = npy_format.read_magic(stream)
        reader = _HEADER_READERS.get(version)
        if reader is None:
            raise CommandError(
                f"{field}: .npy format version {version} is not read"
            )
        shape, fortran_order, dtype = reader(stream)
        file_limits.check_declared_shape(shape, field)
        if dtype.kind not in _NUMBER_KINDS or dtype.hasobject:
            raise CommandError(
                f"{field} holds {dtype} values; expected numbers (bool, "
                "int or float)"
            )
        if not shape:
            raise CommandError(
                f"{field} is a scalar; expected one sample per row"
            )
        rows = shape[0] if fortran_order else min(shape[0], samples)
        count = rows * math.prod(shape[1:])
        data = stream.read(count * dtype.itemsize)
    if len(data) != count * dtype.itemsize:
        raise CommandError(f"{field}: the file ends before the array does")
    order = "F" if fortran_order else "C"
    array = np.frombuffer(data, dtype=dtype).reshape(
        (rows, *shape[1:]), order=order
    )
    return np.array(array[:samples])
