"""`inspect` of a Keras 3 `.weights.h5` file: its optimizer state.

A weights file holds no model and no optimizer config, only variables:
the model's under `layers` (and `vars`), the optimizer's under
`optimizer` (`vars` and groups of their own), an inner optimizer's under
`optimizer/inner_optimizer`. What the state is follows from their shapes
and dtypes alone, read from the file's metadata (no array is read, no
soft or external link followed, nothing executed): int8 codes of
`(blocks, 256)` are 8-bit state in blocks of 256, of `(blocks, 64)` 4-bit
state in blocks of 128, each with float32 scales of `(blocks,)`.

A wrapper saves its inner optimizer's variables twice (in its own list
and in the inner optimizer's), and a slot stored as codes once more as
its float32 value: each is counted once, the codes and scales for the
slot.
"""

import collections
import pathlib

from keras_dtype_policy.low_precision import block_codes
from keras_dtype_policy.tools.tables import format_bytes

_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
# Code columns (bytes a block) of each quantized state, by its bits.
_CODE_COLUMNS = {
    block_codes.code_for(bits, True).bytes_per_block: bits
    for bits in block_codes.BLOCKS
}
# How deep optimizers may nest in a file (a wrapper of a wrapper of ...).
_MAX_DEPTH = 8

_Entry = collections.namedtuple("_Entry", "shape dtype itemsize")


def build_report(path):
    """Describes a Keras 3 weights file that holds optimizer state.

    Args:
        path: A `.weights.h5` file.

    Returns:
        None unless the file is HDF5 with Keras 3's `layers` and
        `optimizer` groups; else a JSON-serializable dict: `file`,
        `format` (`"weights"`), `totals` (`params` and `bytes` of the
        model's weights) and `optimizer` (see `stored_state`).
    """
    import h5py

    path = pathlib.Path(path)
    try:
        with open(path, "rb") as f:
            if f.read(len(_HDF5_SIGNATURE)) != _HDF5_SIGNATURE:
                return None
        with h5py.File(path, "r") as f:
            if not _is_group(f, "layers") or not _is_group(f, "optimizer"):
                return None
            weights = []
            for name in ("layers", "vars"):
                if _is_group(f, name):
                    weights += _datasets(f[name])
            groups = _optimizer_groups(f["optimizer"])
    except OSError:
        return None
    params = sum(_size(entry) for entry in weights)
    return {
        "file": str(path),
        "format": "weights",
        "totals": {
            "params": params,
            "bytes": sum(_size(e) * e.itemsize for e in weights),
        },
        "optimizer": stored_state(groups, params),
    }


def stored_state(groups, params):
    """What optimizer state a file's variables are.

    Args:
        groups: The variables of each optimizer, outermost first: a list of
            lists of `_Entry`.
        params: The parameters of the model's weights.

    Returns:
        A dict: `state_dtype` (`"8bit"`, `"4bit"`, the slots' dtype, or
        None where no slot is found), `quantized_slots`, `update`
        (`"kahan"` where compensation buffers are found, else None: a
        weights file does not record it), `state_bytes` and
        `state_bytes_per_parameter` (None without parameters).
    """
    own = []
    for outer, inner in zip(groups, [*groups[1:], []], strict=True):
        own.append(_without(outer, inner))
    entries = [entry for group in own for entry in group]
    codes = [e for e in entries if _code_bits(e) is not None]
    remaining = _without(entries, [])
    for code in codes:
        image = _slot_image(remaining, code)
        if image is not None:
            remaining.remove(image)
    state_bytes = sum(_size(e) * e.itemsize for e in remaining)
    bits = sorted({_code_bits(c) for c in codes})
    if bits:
        state_dtype = "/".join(f"{b}bit" for b in bits)
    else:
        slots = [e for e in own[-1] if e.shape] if own else []
        largest = max(slots, key=_size, default=None)
        state_dtype = None if largest is None else largest.dtype
    compensated = any(
        e.shape and e.dtype in ("bfloat16", "float16")
        for group in own[:-1]
        for e in group
    )
    return {
        "state_dtype": state_dtype,
        "quantized_slots": len(codes),
        "update": "kahan" if compensated else None,
        "state_bytes": state_bytes,
        "state_bytes_per_parameter": (state_bytes / params if params else None),
    }


def format_report(report):
    """Returns the lines that `inspect` prints for a weights file."""
    totals = report["totals"]
    state = report["optimizer"]
    lines = [
        f"file:     {report['file']} (Keras weights file: weights and "
        "optimizer state, no model)",
        f"weights:  {totals['params']} parameters, "
        f"{format_bytes(totals['bytes'])}",
        "optimizer state (from the stored variables):",
        f"  state dtype: {state['state_dtype'] or 'none found'}"
        + (
            f" ({state['quantized_slots']} slots as codes)"
            if state["quantized_slots"]
            else ""
        ),
        "  update: "
        + (
            state["update"]
            or "not recorded in a weights file (no kahan compensation found)"
        ),
    ]
    per_parameter = state["state_bytes_per_parameter"]
    line = f"  {format_bytes(state['state_bytes'])}"
    if per_parameter is not None:
        line += f", {per_parameter:.2f} bytes a parameter"
    return [*lines, line]


def _is_group(parent, name):
    import h5py

    link = parent.get(name, getlink=True)
    return isinstance(link, h5py.HardLink) and isinstance(
        parent[name], h5py.Group
    )


def _datasets(group):
    """The datasets under `group`, hard links only, in name order."""
    import h5py

    found = []

    def visit(_, item):
        if isinstance(item, h5py.Dataset):
            found.append(_entry(item))

    group.visititems(visit)
    return found


def _optimizer_groups(group):
    """The variables of each nested optimizer, outermost first: those of
    its `vars` and of its other groups (a loss-scale optimizer keeps some
    in groups of their own), less those of its `inner_optimizer`."""
    groups = []
    while group is not None and len(groups) < _MAX_DEPTH:
        entries = []
        for name in sorted(group):
            if name != "inner_optimizer" and _is_group(group, name):
                entries += _datasets(group[name])
        groups.append(entries)
        inner = _is_group(group, "inner_optimizer")
        group = group["inner_optimizer"] if inner else None
    return groups


def _entry(dataset):
    dtype = dataset.attrs.get("dtype")
    if isinstance(dtype, bytes):
        dtype = dtype.decode("utf-8", errors="replace")
    if not isinstance(dtype, str):
        dtype = dataset.dtype.name
    shape = tuple(int(d) for d in dataset.shape or ())
    return _Entry(shape, dtype, int(dataset.dtype.itemsize))


def _size(entry):
    size = 1
    for dimension in entry.shape:
        size *= dimension
    return size


def _code_bits(entry):
    if entry.dtype != "int8" or len(entry.shape) != 2:
        return None
    return _CODE_COLUMNS.get(entry.shape[1])


def _without(entries, inner):
    """`entries` less one of each of `inner`'s, where all of `inner`'s are
    among them (a wrapper's list holds its inner optimizer's)."""
    counts = collections.Counter(entries)
    if not inner or collections.Counter(inner) - counts:
        return list(entries)
    counts.subtract(collections.Counter(inner))
    found = []
    for entry in entries:
        if counts[entry] > 0:
            counts[entry] -= 1
            found.append(entry)
    return found


def _slot_image(entries, code):
    """The float32 value a file stores for a slot stored as `code`."""
    bits = _code_bits(code)
    block = block_codes.BLOCKS[bits]
    blocks = code.shape[0]
    for entry in entries:
        if (
            entry.dtype == "float32"
            and entry.shape
            and -(-_size(entry) // block) == blocks
            and entry.shape != (blocks,)
        ):
            return entry
    return None
