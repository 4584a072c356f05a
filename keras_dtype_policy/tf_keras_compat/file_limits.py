"""What the package's readers accept before they open or allocate anything.

Every reader (the Python API and the command line) refuses a path that is
neither a regular file nor a directory (a FIFO would block for ever, a
device never ends), and bounds every size a file declares before memory is
set aside for it: an array's element count, a zip member's expanded size,
a layer config's `units`/`filters`, a config's nesting. Each refusal
names the field.
"""

import contextlib
import math
import os
import stat

# The largest array any declared shape may describe, in elements: 2**31
# (8 GiB of float32), beyond any model this package is meant to read on one
# host and below what the backends' allocators refuse with their own errors.
MAX_DECLARED_ELEMENTS = 2**31

# The largest size a single `.keras` zip member may expand to: 16 GiB.
MAX_ZIP_MEMBER_BYTES = 16 * 2**30

# The largest JSON member (`config.json`, `metadata.json`) of a `.keras`
# file, and the largest config attribute of an `.h5` file: 256 MiB.
MAX_CONFIG_BYTES = 2**28

# The largest dimension a layer config may ask for (`units`, `filters`,
# `output_dim`, ...): larger ones are refused before a weight is built.
MAX_LAYER_DIMENSION = 2**24

# The deepest nesting of lists and dicts a model config may have. Real
# configs (nested models, policies, regularizers) stay well below; Keras'
# recursive deserialization fails near 400.
MAX_CONFIG_DEPTH = 200

# Config keys that declare a layer's size.
DIMENSION_KEYS = frozenset(
    {
        "units",
        "filters",
        "output_dim",
        "input_dim",
        "num_heads",
        "key_dim",
        "value_dim",
        "num_tokens",
        "max_tokens",
        "depth",
        "n",
    }
)
# Config keys that declare a shape.
SHAPE_KEYS = frozenset(
    {"batch_shape", "batch_input_shape", "input_shape", "shape"}
)


class FileLimitError(ValueError):
    """A path or a declared size that the readers refuse."""


def check_path_kind(path, argument="filepath"):
    """Refuses a path that is neither a regular file nor a directory.

    A missing path passes: the caller reports it in its own words.

    Args:
        path: A path-like.
        argument: The argument's name, for the message.

    Raises:
        FileLimitError: for a FIFO, socket, device or other special file.
    """
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return
    raise FileLimitError(
        f"`{argument}` must be a regular file or a directory; received "
        f"{os.fspath(path)!r}, which is a {_kind_name(mode)}"
    )


def check_declared_shape(shape, field):
    """Refuses a declared shape that is malformed or describes too much.

    Args:
        shape: A sequence of dimensions, as the file declares it.
        field: What declares it (a dataset name, a config key), for the
            message.

    Raises:
        FileLimitError: for a negative or non-integer dimension, or more
            than `MAX_DECLARED_ELEMENTS` elements.
    """
    dimensions = tuple(shape)
    for dimension in dimensions:
        if (
            isinstance(dimension, bool)
            or not isinstance(dimension, (int,))
            and not hasattr(dimension, "__index__")
        ):
            raise FileLimitError(
                f"{field}: declares a shape with a dimension that is not an "
                f"integer: {dimensions!r}"
            )
        if int(dimension) < 0:
            raise FileLimitError(
                f"{field}: declares a negative dimension: {dimensions!r}"
            )
    elements = math.prod(int(dimension) for dimension in dimensions)
    if elements > MAX_DECLARED_ELEMENTS:
        raise FileLimitError(
            f"{field}: declares {elements} elements (shape {dimensions!r}), "
            f"more than the {MAX_DECLARED_ELEMENTS} this package reads"
        )


def check_zip_member_size(name, size):
    """Refuses a zip member whose expanded size is past the limit.

    Args:
        name: The member's name.
        size: Its declared expanded size, in bytes.

    Raises:
        FileLimitError: if `size` exceeds `MAX_ZIP_MEMBER_BYTES`.
    """
    if size > MAX_ZIP_MEMBER_BYTES:
        raise FileLimitError(
            f"zip member {name!r} expands to {size} bytes, more than the "
            f"{MAX_ZIP_MEMBER_BYTES} this package reads"
        )


def check_model_config(config, source):
    """Refuses a model config too deep to build or declaring huge sizes.

    Walks the config without recursion, before anything is built.

    Args:
        config: The decoded config (dicts, lists, scalars).
        source: What holds it (a file, an argument), for the message.

    Raises:
        FileLimitError: for nesting deeper than `MAX_CONFIG_DEPTH`, a
            dimension (`units`, `filters`, ...) past `MAX_LAYER_DIMENSION`
            or a shape past `MAX_DECLARED_ELEMENTS`.
    """
    pending = [(config, 1)]
    while pending:
        node, depth = pending.pop()
        if depth > MAX_CONFIG_DEPTH:
            raise FileLimitError(
                f"{source}: its config is nested more than "
                f"{MAX_CONFIG_DEPTH} levels deep"
            )
        if isinstance(node, dict):
            for key, value in node.items():
                _check_config_value(key, value, source)
                pending.append((value, depth + 1))
        elif isinstance(node, (list, tuple)):
            pending.extend((item, depth + 1) for item in node)


def _check_config_value(key, value, source):
    if key in DIMENSION_KEYS and _is_integer(value):
        if value > MAX_LAYER_DIMENSION:
            raise FileLimitError(
                f"{source}: its config declares `{key}`={value}, more than "
                f"the {MAX_LAYER_DIMENSION} this package builds"
            )
    elif key in SHAPE_KEYS and isinstance(value, (list, tuple)):
        # Unknown (None) and placeholder (-1) dimensions are Keras' to judge.
        known = [d for d in value if _is_integer(d) and d > 0]
        check_declared_shape(known, f"{source}: its config's `{key}`")


def _is_integer(value):
    return isinstance(value, int) and not isinstance(value, bool)


def check_h5_sizes(h5_file, source):
    """Refuses an HDF5 file declaring an attribute or dataset too large.

    Reads only the shapes: no data, no external link followed.

    Args:
        h5_file: An open `h5py.File` (or group).
        source: What holds it (a file), for the message.

    Raises:
        FileLimitError: naming the dataset or attribute.
    """
    _check_attribute_shapes(h5_file, source)

    def visit(name, item):
        _check_attribute_shapes(item, source)
        shape = getattr(item, "shape", None)
        if shape is not None:
            check_declared_shape(shape, f"{source}: dataset {name!r}")

    h5_file.visititems(visit)


def _check_attribute_shapes(item, source):
    for name in item.attrs:
        shape = item.attrs.get_id(name).shape
        check_declared_shape(
            shape or (), f"{source}: attribute {name!r} of {item.name!r}"
        )


class MalformedFileError(
    ValueError, KeyError, AttributeError, IndexError, RuntimeError
):
    """A file whose contents Keras' loader stumbled on (a missing group, a
    name of the wrong type, HDF5 structures h5py cannot follow): a
    `ValueError`, and still the error it was."""

    def __str__(self):
        return str(self.args[0]) if self.args else ""


@contextlib.contextmanager
def malformed_as_value_errors(source):
    """Raises Keras' KeyError/AttributeError/IndexError (and h5py's
    RuntimeError) on a malformed file as a `MalformedFileError` naming the
    file.

    Args:
        source: The file, for the message.
    """
    try:
        yield
    except (KeyError, AttributeError, IndexError, RuntimeError) as error:
        # h5py raises plain RuntimeErrors on damaged structures; other
        # kinds of RuntimeError (RecursionError, NotImplementedError) are
        # not about the file's contents.
        if isinstance(error, MalformedFileError) or (
            isinstance(error, RuntimeError) and type(error) is not RuntimeError
        ):
            raise
        raise MalformedFileError(
            f"{os.fspath(source)}: cannot be loaded, the file is malformed: "
            f"{type(error).__name__}: {error}"
        ) from error


def _kind_name(mode):
    kinds = (
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
    )
    for test, name in kinds:
        if test(mode):
            return name
    return "special file"
