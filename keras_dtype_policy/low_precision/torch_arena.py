"""The float32 working space of one group of the torch step.

`torch_step` updates a group of weights in float32 working copies that
live in one space (the arena), reused from step to step. The space is
laid out by what happens to each copy at the end of the step, so that
each end is one operation for the whole group: the values stored back
rounded stochastically side by side, each code's slots side by side in
whole blocks, the rest after them, then scratch and staging space.

torch is imported inside functions, only once Keras runs on it.
"""

from keras_dtype_policy.low_precision import torch_codes
from keras_dtype_policy.low_precision.quantized_slots import QuantizedSlot

# The arena's regions: values stored back rounded stochastically (one
# region, rounded in one pass), and the rest; each code has its own.
ROUNDED = "rounded"
OTHER = "other"


def weight_role(wrapper, view):
    """The region of a weight's float32 working copy."""
    if view.compensation is None and wrapper.update == "stochastic_rounding":
        return ROUNDED
    return OTHER


def slot_role(wrapper):
    """The region of the float32 working copy of a bfloat16 or float16
    slot (stored back rounded to nearest for `update="nearest"`)."""
    return OTHER if wrapper.update == "nearest" else ROUNDED


class Arena:
    """The float32 working space of one group, reused from step to step.

    Fresh tensors would cost a page fault every 4 KiB on every step; this
    space is allocated once (and grown if a group needs more), never more
    than a few float32 copies of a group (`torch_step.GROUP_ELEMENTS`).
    It is split in regions: the values that are stored back rounded
    stochastically, side by side, so that one pass rounds them all; each
    code's working values (whole blocks), so that one pass quantizes
    them; the rest; then scratch and staging space.
    """

    def __init__(self, wrapper, group):
        import torch

        sizes = {ROUNDED: 0}
        for piece in group:
            for role, size in _needs(wrapper, piece):
                sizes[role] = sizes.get(role, 0) + size
        sizes.setdefault(OTHER, 0)
        coded = [sizes[r] for r in sizes if r not in (ROUNDED, OTHER)]
        largest_code = max(coded, default=0)
        largest = max(piece.size for piece in group)
        self.regions, start = {}, 0
        for role, size in sizes.items():
            self.regions[role] = (start, start + size)
            start += size
        summing = max(largest, sizes[ROUNDED])
        scratch = torch_codes.SCRATCH_TENSORS if largest_code else 0
        # bfloat16 staging of the rounded region, int8 codes and scales
        # staging of the largest code region (4 codes a float32 at most).
        staging = -(-sizes[ROUNDED] // 2) + 2 * largest_code
        total = start + summing + scratch * largest_code + staging
        space = getattr(wrapper._targets, "arena", None)
        device = group[0].view.weight._value.device
        if space is None or space.numel() < total or space.device != device:
            space = torch.empty(total, device=device)
            wrapper._targets.arena = space
        self.space = space
        self.sum_space = space[start : start + summing]
        start += summing
        self.code_space = [
            space[start + i * largest_code : start + (i + 1) * largest_code]
            for i in range(scratch)
        ]
        start += scratch * largest_code
        self.staging = space[start:total]
        self.used = {role: first for role, (first, _) in self.regions.items()}
        # The stored tensor of each working copy (by id), and the slots of
        # each code: what the ends of the step write back.
        self.stored = {}
        self.coded = {}
        self.rounded = []

    def take(self, role, size):
        """Returns the next `size` elements of region `role`."""
        first = self.used[role]
        self.used[role] += size
        taken = self.space[first : first + size]
        if role == ROUNDED:
            self.rounded.append(taken)
        return taken

    def region(self, role):
        """Returns the whole of region `role`."""
        first, stop = self.regions[role]
        return self.space[first:stop]


def _needs(wrapper, piece):
    """`(region, elements)` of each float32 copy a piece needs: its
    weight, compensation and gradient, and each slot (a quantized one in
    whole blocks, in its code's region)."""
    import torch

    view = piece.view
    if view.weight._value.dtype != torch.float32:
        yield weight_role(wrapper, view), piece.size
        if view.compensation is not None:
            yield OTHER, piece.size
    if piece.grad.dtype != torch.float32:
        yield OTHER, piece.size
    for slot in piece.slots:
        if isinstance(slot, QuantizedSlot):
            yield slot.code, padded(piece, slot)
        elif slot._value.dtype != torch.float32:
            yield slot_role(wrapper), piece.size


def blocks_of(piece, slot):
    """The blocks of `slot` that `piece` covers: `(first, stop)`."""
    block = slot.code.block
    return piece.start // block, -(-piece.stop // block)


def coded_pieces(entries):
    """Each entry's codes, scales and `(offset, elements)` in its code's
    region."""
    offset = 0
    for piece, slot in entries:
        first, stop = blocks_of(piece, slot)
        elements = padded(piece, slot)
        codes = slot.codes._value[first:stop]
        scales = slot.scales._value[first:stop]
        yield codes, scales, offset, elements
        offset += elements


def staged_codes(code, blocks, arena):
    """Staging space for the int8 codes and the scales of `blocks`."""
    import torch

    codes = arena.staging.view(torch.int8)[: blocks * code.bytes_per_block]
    start = -(-codes.numel() // 4)
    scales = arena.staging[start : start + blocks]
    return codes.view(blocks, code.bytes_per_block), scales


def padded(piece, slot):
    """Elements of `piece`'s blocks of `slot`."""
    first, stop = blocks_of(piece, slot)
    return (stop - first) * slot.code.block
