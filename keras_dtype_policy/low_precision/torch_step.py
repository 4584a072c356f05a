"""The low-precision step as batched `torch._foreach` updates.

On torch, Keras' own optimizers update every variable at once through
their `_parallel_update_step` (one `torch._foreach_*` call an operation,
over all tensors). The wrapper runs that same step: for a group of
weights it reads each low-precision weight once into a float32 working
tensor (its Kahan compensation added), widens the optimizer slots stored
in bfloat16 or float16 the same way, updates them all in place, then
writes every result back rounded, with batched operations. Each end of a
group's step is one operation for the whole group, not one a tensor: one
batched copy widens what is stored narrow, one kernel
(`torch_kernels`) dequantizes each code's slots and one quantizes them
back, one rounds every value stored stochastically into bfloat16 (or
float16); staging space and one batched copy carry codes and rounded
values between the group's working space and each tensor. Groups hold at most
`TORCH_GROUP_ELEMENTS` elements, so the float32 working copies never
exceed a bounded size whatever the model, and each lives only for its
group.

Adam and AdamW take torch's fused Adam kernel (one pass over weights,
gradients and moments for all tensors at once, where Keras' own torch
Adam makes eight), with Keras' epsilon; with 8-bit moments (without
`amsgrad`) the package's own Adam (`torch_numerics.adam_update`) in
`torch_coded_adam`'s kernel; the others run their own
`_parallel_update_step`. Used for Keras' torch
Adam, AdamW, Adamax, Adagrad, Adadelta, Lion, RMSprop and SGD, exactly
those classes (`BATCHED_OPTIMIZERS`: a subclass may change the update).
Nadam (its step also updates a shared product, which groups would
repeat), optimizers with gradient accumulation or an average of the
weights (EMA), and every other optimizer take the general path of the
wrapper, one variable at a time.
"""

import dataclasses
import typing

import keras
import torch
from keras.src.backend.torch.optimizers import torch_adadelta
from keras.src.backend.torch.optimizers import torch_adagrad
from keras.src.backend.torch.optimizers import torch_adam
from keras.src.backend.torch.optimizers import torch_adamax
from keras.src.backend.torch.optimizers import torch_adamw
from keras.src.backend.torch.optimizers import torch_lion
from keras.src.backend.torch.optimizers import torch_rmsprop
from keras.src.backend.torch.optimizers import torch_sgd

from keras_dtype_policy.low_precision import compensated_updates
from keras_dtype_policy.low_precision import slot_lists
from keras_dtype_policy.low_precision import torch_arena
from keras_dtype_policy.low_precision import torch_coded_adam
from keras_dtype_policy.low_precision import torch_kernels
from keras_dtype_policy.low_precision import torch_noise
from keras_dtype_policy.low_precision.quantized_slots import QuantizedSlot

# The most elements one group's float32 working tensors cover on torch.
TORCH_GROUP_ELEMENTS = 2**20
# The classes Keras' torch backend makes of its optimizers
# (keras/src/backend/torch/optimizers/torch_optimizer.py), recognised by
# identity, that the batched step runs: True for the Adams (torch's
# fused Adam, or the package's on 8-bit moments), False where the update
# is the class's own `_parallel_update_step`.
BATCHED_OPTIMIZERS = {
    torch_adam.Adam: True,
    torch_adamw.AdamW: True,
    torch_adamax.Adamax: False,
    torch_adagrad.Adagrad: False,
    torch_adadelta.Adadelta: False,
    torch_lion.Lion: False,
    torch_rmsprop.RMSprop: False,
    torch_sgd.SGD: False,
}


def can_batch(wrapper):
    """True where `wrapper`'s step runs as batched updates."""
    inner = wrapper.inner_optimizer
    if type(inner) not in BATCHED_OPTIMIZERS:
        return False
    if inner.gradient_accumulation_steps or inner.use_ema:
        return False
    return slot_lists.slots_by_variable(wrapper) is not None


def is_package_adam(inner):
    """True where `inner`'s update is the package's own Adam update."""
    return BATCHED_OPTIMIZERS.get(type(inner), False) and not inner.amsgrad


def step_noise(wrapper):
    """Returns the random bits of one step of `wrapper` (a
    `torch_noise.TorchNoise` of the step's key), or None where the step
    draws none."""
    if wrapper.seed_generator is None or wrapper.update_rule == "nearest":
        return None
    # One key a step; every rounding of the step draws from it in turn.
    return torch_noise.TorchNoise(wrapper.seed_generator)


def batched_apply(wrapper, grads, variables, learning_rate, noise):
    """Updates `variables` from `grads`, group by group.

    `grads` are already summed, unscaled and clipped; the caller advances
    the iteration count afterwards. Variables the wrapper keeps no view of
    (float32 weights with float32 state) are updated in place, all at
    once; the others in pieces of at most `TORCH_GROUP_ELEMENTS` elements.

    Args:
        wrapper: The `LowPrecisionOptimizer`.
        grads: The gradients, one per variable.
        variables: The model's variables.
        learning_rate: The inner optimizer's learning rate.
        noise: The step's random bits (`step_noise`).
    """
    inner = wrapper.inner_optimizer
    pieces, plain = _pieces(wrapper, grads, variables)
    if plain.variables:
        _inner_update(inner, plain.grads, plain.variables, learning_rate)
    if is_package_adam(inner):
        pieces = torch_coded_adam.apply(
            wrapper, pieces, learning_rate, noise, TORCH_GROUP_ELEMENTS
        )
    group, filled = [], 0
    for piece in pieces:
        if group and filled + piece.size > TORCH_GROUP_ELEMENTS:
            _update_pieces(wrapper, group, learning_rate, noise)
            group, filled = [], 0
        group.append(piece)
        filled += piece.size
    if group:
        _update_pieces(wrapper, group, learning_rate, noise)


class _Plain(typing.NamedTuple):
    """The variables updated in place, and their gradients."""

    grads: list
    variables: list


def _pieces(wrapper, grads, variables):
    """`(pieces, plain)`: the `Piece`s of the variables the wrapper keeps a
    view of, in order, and the `_Plain` rest."""
    targets = wrapper._targets
    slots = slot_lists.slots_by_variable(wrapper)
    plain, pieces = _Plain([], []), []
    for grad, variable in zip(grads, variables, strict=True):
        view = targets.views.get(id(variable))
        if view is None:
            plain.grads.append(grad)
            plain.variables.append(variable)
            continue
        size = _elements(variable)
        length = _piece_length(slots[id(variable)])
        for start in range(0, max(size, 1), length):
            stop = min(start + length, size)
            pieces.append(Piece(view, grad, slots[id(variable)], start, stop))
    return pieces, plain


def _piece_length(slots):
    """`TORCH_GROUP_ELEMENTS`, rounded down to whole blocks where a slot of
    the weight is quantized (never below one block)."""
    blocks = [s.code.block for s in slots if isinstance(s, QuantizedSlot)]
    if not blocks:
        return TORCH_GROUP_ELEMENTS
    block = max(blocks)
    return max(TORCH_GROUP_ELEMENTS // block, 1) * block


class Piece:
    """A run of elements of one weight, its gradient and its slots."""

    def __init__(self, view, grad, slots, start, stop):
        self.view = view
        self.grad = grad
        self.slots = slots
        self.start = start
        self.stop = stop
        self.size = stop - start

    def flat(self, tensor):
        """This piece's elements of a tensor of the weight's shape."""
        return tensor.reshape(-1)[self.start : self.stop]


class _Swap(typing.NamedTuple):
    """A slot whose private storage (`_value`) holds its float32 working
    piece during the step: its own storage, to put back, and where the
    working piece is written back rounded (None: it is that storage)."""

    slot: keras.Variable
    stored: object
    narrow: object


@dataclasses.dataclass
class _Staged:
    """What a group's step read into float32 working space."""

    widened: torch_arena.Copies = dataclasses.field(
        default_factory=torch_arena.Copies
    )
    workings: list = dataclasses.field(default_factory=list)
    compensations: list = dataclasses.field(default_factory=list)
    swaps: list = dataclasses.field(default_factory=list)
    views: list = dataclasses.field(default_factory=list)
    grads: list = dataclasses.field(default_factory=list)


def _inner_update(inner, grads, targets, learning_rate):
    """The inner optimizer's update of float32 `targets` in place."""
    inner._apply_weight_decay(targets)
    if BATCHED_OPTIMIZERS[type(inner)]:
        _fused_adam(inner, grads, targets, learning_rate)
    else:
        inner._parallel_update_step(grads, targets, learning_rate)


def _fused_adam(inner, grads, targets, learning_rate):
    """Keras' Adam update in one pass: torch's fused Adam kernel.

    Kept for the general path, whose tensors are many and of any size:
    one call for them all, where the package's Adam
    (`torch_numerics.adam_update`) takes a kernel call a tensor (52
    calls made benchmark 9's step 35 -> 47 ms). torch adds epsilon to
    the bias-corrected square root, Keras to the uncorrected one: an
    epsilon divided by `sqrt(1 - beta_2**t)` makes torch's update
    Keras' own. Weight decay is applied before, as Keras does.
    """

    def slots(held):
        return [held[inner._get_variable_index(t)].value for t in targets]

    step = float(inner.iterations.numpy()) + 1.0
    correction = (1.0 - float(inner.beta_2) ** step) ** 0.5
    device = grads[0].device
    steps = [torch.tensor(step, device=device)] * len(targets)
    torch._fused_adam_(
        [t.value for t in targets],
        list(grads),
        slots(inner._momentums),
        slots(inner._velocities),
        slots(inner._velocity_hats) if inner.amsgrad else [],
        steps,
        amsgrad=bool(inner.amsgrad),
        lr=float(learning_rate),
        beta1=float(inner.beta_1),
        beta2=float(inner.beta_2),
        weight_decay=0.0,
        eps=float(inner.epsilon) / correction,
        maximize=False,
    )


def _update_pieces(wrapper, group, learning_rate, noise):
    """Updates one group: each end of the step is one batched operation
    (or one kernel) for the whole group, never one a tensor."""
    arena = torch_arena.Arena(wrapper, group)
    staged = _Staged()
    try:
        for piece in group:
            _stage_weight(wrapper, piece, arena, staged)
            _stage_grad(piece, arena, staged)
            for slot in piece.slots:
                _stage_slot(wrapper, piece, slot, arena, staged)
        staged.widened.run()
        if staged.workings:
            torch._foreach_add_(staged.workings, staged.compensations)
        for region, entries in arena.coded.items():
            _read_codes(region, entries, arena)
        inner = wrapper.inner_optimizer
        _inner_update(inner, staged.grads, staged.views, learning_rate)
        _write_back(wrapper, group, arena, staged, noise)
    finally:
        _unstage(arena, staged)


def _stage_weight(wrapper, piece, arena, staged):
    """The piece's weight as float32 (its compensation added later)."""
    view = piece.view
    weight = piece.flat(view.weight._value)
    working = weight
    if weight.dtype != torch.float32:
        role = torch_arena.weight_role(wrapper, view)
        working = arena.take(role, piece.size)
        staged.widened.add(working, weight)
        arena.stored[id(working)] = weight
        if view.compensation is not None:
            compensation = arena.take(torch_arena.OTHER, piece.size)
            stored = piece.flat(view.compensation._value)
            staged.widened.add(compensation, stored)
            staged.workings.append(working)
            staged.compensations.append(compensation)
    view.working = working
    staged.views.append(view)


def _stage_grad(piece, arena, staged):
    """The piece's gradient as float32."""
    grad = piece.flat(piece.grad)
    if grad.dtype != torch.float32:
        copy = arena.take(torch_arena.OTHER, piece.size)
        staged.widened.add(copy, grad)
        grad = copy
    staged.grads.append(grad)


def _stage_slot(wrapper, piece, slot, arena, staged):
    """The piece of `slot` as float32: a quantized slot's in its code's
    region, another's swapped in as its storage for the step."""
    if isinstance(slot, QuantizedSlot):
        region = torch_arena.Region.of_code(slot.code)
        coded = torch_arena.CodedSlot(piece, slot)
        arena.coded.setdefault(region, []).append(coded)
        return
    stored = slot._value
    flat = piece.flat(stored)
    if flat.dtype == torch.float32:
        slot._value = flat
        staged.swaps.append(_Swap(slot, stored, None))
        return
    working = arena.take(torch_arena.slot_role(wrapper), piece.size)
    staged.widened.add(working, flat)
    arena.stored[id(working)] = flat
    slot._value = working
    staged.swaps.append(_Swap(slot, stored, flat))


def _write_back(wrapper, group, arena, staged, noise):
    """Writes every working value back to its storage."""
    nearest = torch_arena.Copies()
    for piece in group:
        _write_weight(wrapper, piece, arena, nearest)
    if wrapper.update_rule == "nearest":
        for swap in staged.swaps:
            if swap.narrow is not None:
                nearest.add(swap.narrow, swap.slot._value)
    nearest.run()
    _store_rounded_region(arena, noise)
    for region, entries in arena.coded.items():
        _write_codes(region, entries, arena, noise)


def _unstage(arena, staged):
    """Puts every slot's own storage back; no working value is left."""
    for view in staged.views:
        view.working = None
    for entries in arena.coded.values():
        for entry in entries:
            entry.slot.working = None
    for swap in staged.swaps:
        swap.slot._value = swap.stored


def _store_rounded_region(arena, noise):
    """Stores every value of the rounded region, rounded stochastically.

    Where every stored tensor is bfloat16, or every one float16, the
    whole region is rounded in one pass into staging space viewed as
    that dtype, then copied out in one batched copy; mixed storage is
    rounded tensor by tensor.
    """
    workings = arena.rounded
    if not workings:
        return
    stored = [arena.stored[id(working)] for working in workings]
    dtypes = {s.dtype for s in stored}
    dtype = dtypes.pop() if len(dtypes) == 1 else None
    if _rounding_kernel(dtype) is None:
        for target, working in zip(stored, workings, strict=True):
            store_rounded(target, working, noise)
        return
    region = arena.region(torch_arena.ROUNDED)
    staged = arena.staging.view(dtype)[: region.numel()]
    store_rounded(staged, region, noise)
    copies, start = torch_arena.Copies(), 0
    for target, working in zip(stored, workings, strict=True):
        copies.add(target, staged[start : start + working.numel()])
        start += working.numel()
    copies.run()


def _read_codes(region, entries, arena):
    """Dequantizes every slot piece of a code in the group at once into
    the code's region; each slot reads its piece of it as its value until
    written back."""
    code = region.code
    values = arena.region(region)
    listed = list(torch_arena.coded_pieces(entries))
    if len(listed) == 1:
        codes, scales = listed[0].codes, listed[0].scales
    else:
        blocks = values.numel() // code.block
        codes, scales = torch_arena.staged_codes(code, blocks, arena)
        torch.cat([coded.codes for coded in listed], out=codes)
        torch.cat([coded.scales for coded in listed], out=scales)
    torch_kernels.dequantize(values, codes, scales, code)
    for entry, coded in zip(entries, listed, strict=True):
        size = entry.piece.size
        entry.slot.working = values[coded.offset : coded.offset + size]


def _write_codes(region, entries, arena, noise):
    """Quantizes the updated code region back into every slot's codes."""
    code = region.code
    values = arena.region(region)
    listed = list(torch_arena.coded_pieces(entries))
    for entry, coded in zip(entries, listed, strict=True):
        # The padding of a weight's last block is stored as zeros.
        end = coded.offset + coded.elements
        values[coded.offset + entry.piece.size : end].zero_()
    key = None if noise is None else noise.kernel_key()
    if len(listed) == 1:
        only = listed[0]
        torch_kernels.quantize(values, only.codes, only.scales, code, key)
        return
    blocks = values.numel() // code.block
    codes, scales = torch_arena.staged_codes(code, blocks, arena)
    torch_kernels.quantize(values, codes, scales, code, key)
    copies, block = torch_arena.Copies(), 0
    for coded in listed:
        count = coded.codes.shape[0]
        copies.add(coded.codes, codes[block : block + count])
        copies.add(coded.scales, scales[block : block + count])
        block += count
    copies.run()


def _write_weight(wrapper, piece, arena, nearest):
    """Writes a piece's weight back: Kahan-compensated or rounded to
    nearest here (nearest through the batched copy `nearest`); rounded
    stochastically with its region (`_store_rounded_region`)."""
    view = piece.view
    working = view.working
    stored = arena.stored.get(id(working))
    if (
        stored is None
        or torch_arena.weight_role(wrapper, view) == torch_arena.ROUNDED
    ):
        return
    if view.compensation is None:
        nearest.add(stored, working)
        return
    # Rounded to nearest (torch's cast: `torch_numerics.nearest` bit for
    # bit), the compensation keeps what it took off (`kahan_split`), in
    # place: a kernel call a tensor cost benchmark 9's step 37 -> 64 ms.
    stored.copy_(working)
    working.sub_(stored)
    piece.flat(view.compensation._value).copy_(working)


def store_rounded(stored, working, noise):
    """Stores float32 `working` into `stored`, rounded stochastically.

    bfloat16 and float16 storage take a kernel (`_rounding_kernel`: 16
    or 13 random bits hashed from a key of `noise`, added below the kept
    mantissa); any other dtype `compensated_updates.stochastic_round`,
    seeded from a key.

    Args:
        stored: The bfloat16 or float16 torch tensor to write.
        working: The float32 values, a torch tensor of as many elements.
        noise: The step's `torch_noise.TorchNoise`.
    """
    if not isinstance(noise, torch_noise.TorchNoise):
        raise TypeError(
            "`noise` must be a torch_noise.TorchNoise. "
            f"Received: noise={noise!r} (of type {type(noise).__name__})"
        )
    key = noise.kernel_key()
    kernel = _rounding_kernel(stored.dtype)
    if kernel is not None:
        kernel(stored, working, key)
        return
    seed = int(key[0]) | (int(key[1]) << 15)
    stored.copy_(
        compensated_updates.stochastic_round(working, stored.dtype, seed)
    )


def _rounding_kernel(dtype):
    """The `torch_kernels` function storing values into `dtype` rounded
    stochastically, or None (dtypes other than bfloat16 and float16)."""
    if dtype == torch.bfloat16:
        return torch_kernels.round_to_bfloat16
    if dtype == torch.float16:
        return torch_kernels.round_to_float16
    return None


def _elements(variable):
    count = 1
    for dimension in variable.shape:
        count *= int(dimension)
    return count
