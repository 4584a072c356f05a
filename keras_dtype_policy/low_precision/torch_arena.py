"""The float32 working space of one group of the torch step.

`torch_step` updates a group of weights in float32 working copies that
live in one space (the arena), reused from step to step. The space is
laid out by what happens to each copy at the end of the step, so that
each end is one operation for the whole group: the values stored back
rounded stochastically side by side, each code's slots side by side in
whole blocks, the rest after them, then staging space.
"""

import dataclasses
import typing

import torch

from keras_dtype_policy.low_precision.quantized_slots import QuantizedSlot


class Region(typing.NamedTuple):
    """A region of the arena: what happens to its values at the end of
    the step (`ROUNDED`, `OTHER`, or the codes of `code`)."""

    kind: str
    code: object = None

    @classmethod
    def of_code(cls, code):
        """The region of the slots coded with `block_codes.Code` `code`."""
        return cls("coded", code)


# Values stored back rounded stochastically (one region, rounded in one
# pass), and the rest; each code has its own region.
ROUNDED = Region("rounded")
OTHER = Region("other")


class CodedSlot(typing.NamedTuple):
    """A piece of a quantized slot in its code's region."""

    piece: object
    slot: QuantizedSlot


class CodedPiece(typing.NamedTuple):
    """A `CodedSlot`'s codes and scales, and its elements (whole blocks)
    at `offset` in its code's region."""

    codes: object
    scales: object
    offset: int
    elements: int


@dataclasses.dataclass
class Copies:
    """Copies run as one batched copy: each destination gets its source."""

    destinations: list = dataclasses.field(default_factory=list)
    sources: list = dataclasses.field(default_factory=list)

    def add(self, destination, source):
        """Adds the copy of `source` into `destination`."""
        self.destinations.append(destination)
        self.sources.append(source)

    def run(self):
        """Runs every copy added, as one batched copy."""
        if self.destinations:
            torch._foreach_copy_(self.destinations, self.sources)


def weight_role(wrapper, view):
    """The region of a weight's float32 working copy."""
    if (
        view.compensation is None
        and wrapper.update_rule == "stochastic_rounding"
    ):
        return ROUNDED
    return OTHER


def slot_role(wrapper):
    """The region of the float32 working copy of a bfloat16 or float16
    slot (stored back rounded to nearest for `update="nearest"`)."""
    return OTHER if wrapper.update_rule == "nearest" else ROUNDED


class Arena:
    """The float32 working space of one group, reused from step to step.

    Fresh tensors would cost a page fault every 4 KiB on every step; this
    space is allocated once (and grown if a group needs more), never more
    than a few float32 copies of a group
    (`torch_step.TORCH_GROUP_ELEMENTS`).
    It is split in regions: the values that are stored back rounded
    stochastically, side by side, so that one pass rounds them all; each
    code's working values (whole blocks), so that one pass quantizes
    them; the rest; then staging space.
    """

    def __init__(self, wrapper, group):
        sizes = {ROUNDED: 0}
        for piece in group:
            for role, size in _needs(wrapper, piece):
                sizes[role] = sizes.get(role, 0) + size
        sizes.setdefault(OTHER, 0)
        coded = [sizes[r] for r in sizes if r not in (ROUNDED, OTHER)]
        self.regions, start = {}, 0
        for role, size in sizes.items():
            self.regions[role] = (start, start + size)
            start += size
        # bfloat16 or float16 staging of the rounded region, int8 codes
        # and scales staging of the largest code region (4 codes a
        # float32 at most).
        staging = -(-sizes[ROUNDED] // 2) + 2 * max(coded, default=0)
        total = start + staging
        space = wrapper._targets.torch_arena
        device = group[0].view.weight._value.device
        if space is None or space.numel() < total or space.device != device:
            space = torch.empty(total, device=device)
            wrapper._targets.torch_arena = space
        self.space = space
        self.staging = space[start:total]
        self.used = {role: first for role, (first, _) in self.regions.items()}
        # The stored tensor of each working copy (by id), and the
        # `CodedSlot`s of each code: what the ends of the step write back.
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
    view = piece.view
    if view.weight._value.dtype != torch.float32:
        yield weight_role(wrapper, view), piece.size
        if view.compensation is not None:
            yield OTHER, piece.size
    if piece.grad.dtype != torch.float32:
        yield OTHER, piece.size
    for slot in piece.slots:
        if isinstance(slot, QuantizedSlot):
            yield Region.of_code(slot.code), padded(piece, slot)
        elif slot._value.dtype != torch.float32:
            yield slot_role(wrapper), piece.size


def blocks_of(piece, slot):
    """The blocks of `slot` that `piece` covers: `(first, stop)`."""
    block = slot.code.block
    return piece.start // block, -(-piece.stop // block)


def coded_pieces(entries):
    """Each `CodedSlot`'s `CodedPiece`, in the order of `entries`."""
    offset = 0
    for piece, slot in entries:
        first, stop = blocks_of(piece, slot)
        elements = padded(piece, slot)
        yield CodedPiece(
            codes=slot.codes._value[first:stop],
            scales=slot.scales._value[first:stop],
            offset=offset,
            elements=elements,
        )
        offset += elements


def staged_codes(code, blocks, arena):
    """Staging space for the int8 codes and the scales of `blocks`."""
    codes = arena.staging.view(torch.int8)[: blocks * code.bytes_per_block]
    start = -(-codes.numel() // 4)
    scales = arena.staging[start : start + blocks]
    return codes.view(blocks, code.bytes_per_block), scales


def padded(piece, slot):
    """Elements of `piece`'s blocks of `slot`."""
    first, stop = blocks_of(piece, slot)
    return (stop - first) * slot.code.block
