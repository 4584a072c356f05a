"""The low-precision step as batched `torch._foreach` updates.

On torch, Keras' own optimizers update every variable at once through
their `_parallel_update_step` (one `torch._foreach_*` call an operation,
over all tensors). The wrapper runs that same step: for a group of
weights it reads each low-precision weight once into a float32 working
tensor (its Kahan compensation added), widens the optimizer slots stored
in bfloat16 or float16 the same way, lets the inner optimizer's
`_parallel_update_step` update them all in place, then writes every
result back rounded, with batched operations. Each end of a group's step
is one operation for the whole group, not one a tensor: one batched copy
widens what is stored narrow, one pass (or compiled kernel) dequantizes
each code's slots and one quantizes them back, one rounds every value
stored stochastically into bfloat16; staging space and one batched copy
carry codes and rounded values between the group's working space and
each tensor. Groups hold at most
`GROUP_ELEMENTS` elements, so the float32 working copies never exceed a
bounded size whatever the model, and each lives only for its group.

Adam and AdamW go through torch's fused Adam kernel (one pass over
weights, gradients and moments, where Keras' own torch Adam makes ten),
the others through their own `_parallel_update_step`. Used for Keras'
torch Adam, AdamW, Adamax, Adagrad, Adadelta, Lion,
RMSprop and SGD, exactly those classes (a subclass may change the
update). Nadam (its step also updates a shared product, which groups
would repeat), optimizers with gradient accumulation or an average of
the weights (EMA), and every other optimizer take the general path of
the wrapper, one variable at a time.

torch is imported inside functions, only once Keras runs on it.
"""

import sys

import keras
import numpy as np

from keras_dtype_policy.low_precision import compensated_updates
from keras_dtype_policy.low_precision import random_bits
from keras_dtype_policy.low_precision import torch_arena
from keras_dtype_policy.low_precision import torch_coded_adam
from keras_dtype_policy.low_precision import torch_codes
from keras_dtype_policy.low_precision import torch_kernels
from keras_dtype_policy.low_precision.quantized_slots import QuantizedSlot

# The most elements one group's float32 working tensors cover.
GROUP_ELEMENTS = 2**20
_BATCHED_CLASSES = (
    "Adam",
    "AdamW",
    "Adamax",
    "Adagrad",
    "Adadelta",
    "Lion",
    "RMSprop",
    "SGD",
)
_TORCH_OPTIMIZERS = "keras.src.backend.torch.optimizers."


def can_batch(wrapper):
    """True where `wrapper`'s step runs as batched updates."""
    inner = wrapper.inner_optimizer
    cls = type(inner)
    if keras.backend.backend() != "torch":
        return False
    if not cls.__module__.startswith(_TORCH_OPTIMIZERS):
        return False
    if cls.__name__ not in _BATCHED_CLASSES:
        return False
    if inner.gradient_accumulation_steps or inner.use_ema:
        return False
    return _slots_by_variable(wrapper) is not None


def batched_apply(wrapper, grads, variables, learning_rate):
    """Updates `variables` from `grads`, group by group.

    `grads` are already summed, unscaled and clipped; the caller advances
    the iteration count afterwards. Variables the wrapper keeps no view of
    (float32 weights with float32 state) are updated in place, all at
    once; the others in pieces of at most `GROUP_ELEMENTS` elements.

    Args:
        wrapper: The `LowPrecisionOptimizer`.
        grads: The gradients, one per variable.
        variables: The model's variables.
        learning_rate: The inner optimizer's learning rate.
    """
    inner = wrapper.inner_optimizer
    targets = wrapper._targets
    slots = _slots_by_variable(wrapper)
    plain_grads, plain, pieces = [], [], []
    for grad, variable in zip(grads, variables, strict=True):
        view = targets.views.get(id(variable))
        if view is None:
            plain_grads.append(grad)
            plain.append(variable)
            continue
        size = _elements(variable)
        length = _piece_length(slots[id(variable)])
        for start in range(0, max(size, 1), length):
            stop = min(start + length, size)
            pieces.append(_Piece(view, grad, slots[id(variable)], start, stop))
    if plain:
        _inner_update(inner, plain_grads, plain, learning_rate)
    noise = None
    if wrapper.seed_generator is not None and wrapper.update != "nearest":
        # One key a step; every rounding of the step draws from it in turn.
        noise = random_bits.TorchNoise(wrapper.seed_generator)
    pieces = torch_coded_adam.apply(
        wrapper, pieces, learning_rate, noise, GROUP_ELEMENTS
    )
    group, filled = [], 0
    for piece in pieces:
        if group and filled + piece.size > GROUP_ELEMENTS:
            _update_pieces(wrapper, group, learning_rate, noise)
            group, filled = [], 0
        group.append(piece)
        filled += piece.size
    if group:
        _update_pieces(wrapper, group, learning_rate, noise)


def _piece_length(slots):
    """`GROUP_ELEMENTS`, rounded down to whole blocks where a slot of the
    weight is quantized (never below one block)."""
    blocks = [s.code.block for s in slots if isinstance(s, QuantizedSlot)]
    if not blocks:
        return GROUP_ELEMENTS
    block = max(blocks)
    return max(GROUP_ELEMENTS // block, 1) * block


class _Piece:
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


def _inner_update(inner, grads, targets, learning_rate):
    inner._apply_weight_decay(targets)
    if _has_fused_adam(inner):
        _fused_adam(inner, grads, targets, learning_rate)
    else:
        inner._parallel_update_step(grads, targets, learning_rate)


def _update_pieces(wrapper, group, learning_rate, noise):
    """Updates one group: each end of the step is one batched operation
    (or one kernel) for the whole group, never one a tensor."""
    import torch

    arena = torch_arena.Arena(wrapper, group)
    widened = ([], [])  # (float32 copies, what they copy), one batched copy
    compensated = ([], [])  # (working weights, their compensations)
    swapped, views, grads = [], [], []
    try:
        for piece in group:
            view = piece.view
            weight = piece.flat(view.weight._value)
            if weight.dtype == torch.float32:
                working = weight
            else:
                working = arena.take(
                    torch_arena.weight_role(wrapper, view), piece.size
                )
                _pair(widened, working, weight)
                if view.compensation is not None:
                    compensation = arena.take(torch_arena.OTHER, piece.size)
                    stored = piece.flat(view.compensation._value)
                    _pair(widened, compensation, stored)
                    _pair(compensated, working, compensation)
            if working is not weight:
                arena.stored[id(working)] = weight
            view.working = working
            views.append(view)
            grad = piece.flat(piece.grad)
            if grad.dtype != torch.float32:
                copy = arena.take(torch_arena.OTHER, piece.size)
                _pair(widened, copy, grad)
                grad = copy
            grads.append(grad)
            for slot in piece.slots:
                if isinstance(slot, QuantizedSlot):
                    arena.coded.setdefault(slot.code, []).append((piece, slot))
                    continue
                stored = slot._value
                flat = piece.flat(stored)
                if flat.dtype != torch.float32:
                    role = torch_arena.slot_role(wrapper)
                    slot._value = arena.take(role, piece.size)
                    _pair(widened, slot._value, flat)
                    arena.stored[id(slot._value)] = flat
                    swapped.append((slot, stored, flat))
                else:
                    slot._value = flat
                    swapped.append((slot, stored, None))
        if widened[0]:
            torch._foreach_copy_(*widened)
        if compensated[0]:
            torch._foreach_add_(*compensated)
        for code, entries in arena.coded.items():
            _read_codes(code, entries, arena)
        _inner_update(wrapper.inner_optimizer, grads, views, learning_rate)
        narrowed = ([], [])  # stored to nearest, one batched copy
        for piece in group:
            _write_weight(wrapper, piece, arena, narrowed)
        if wrapper.update == "nearest":
            for slot, _, flat in swapped:
                if flat is not None:
                    _pair(narrowed, flat, slot._value)
        if narrowed[0]:
            torch._foreach_copy_(*narrowed)
        _store_rounded_region(arena, noise)
        for code, entries in arena.coded.items():
            _write_codes(code, entries, arena, noise)
    finally:
        for view in views:
            view.working = None
        for entries in arena.coded.values():
            for _, slot in entries:
                slot.working = None
        for slot, stored, _ in swapped:
            slot._value = stored


def _pair(pairs, destination, source):
    pairs[0].append(destination)
    pairs[1].append(source)


def _store_rounded_region(arena, noise):
    """Stores every value of the rounded region, rounded stochastically.

    Into bfloat16 the whole region is rounded in one pass into staging
    space, then copied out in one batched copy; other storage (float16)
    is rounded tensor by tensor.
    """
    import torch

    workings = arena.rounded
    if not workings:
        return
    stored = [arena.stored[id(working)] for working in workings]
    if any(s.dtype != torch.bfloat16 for s in stored):
        for target, working in zip(stored, workings, strict=True):
            store_rounded(target, working, noise, arena.sum_space)
        return
    region = arena.region(torch_arena.ROUNDED)
    staged = arena.staging.view(torch.bfloat16)[: region.numel()]
    store_rounded(staged, region, noise, arena.sum_space)
    pieces, start = [], 0
    for working in workings:
        pieces.append(staged[start : start + working.numel()])
        start += working.numel()
    torch._foreach_copy_(stored, pieces)


def _read_codes(code, entries, arena):
    """Dequantizes every slot piece of `code` in the group at once into
    the code's region; each slot reads its piece of it as its value until
    written back."""
    import torch

    region = arena.region(code)
    listed = list(torch_arena.coded_pieces(entries))
    if len(listed) == 1:
        codes, scales = listed[0][:2]
    else:
        blocks = region.numel() // code.block
        codes, scales = torch_arena.staged_codes(code, blocks, arena)
        torch.cat([item[0] for item in listed], out=codes)
        torch.cat([item[1] for item in listed], out=scales)
    torch_codes.dequantize(region, codes, scales, code, arena.code_space[0])
    for (piece, slot), (_, _, offset, _) in zip(entries, listed, strict=True):
        slot.working = region[offset : offset + piece.size]


def _write_codes(code, entries, arena, noise):
    """Quantizes the updated code region back into every slot's codes."""
    import torch

    region = arena.region(code)
    listed = list(torch_arena.coded_pieces(entries))
    for (piece, _), (_, _, offset, padded) in zip(entries, listed, strict=True):
        # The padding of a weight's last block is stored as zeros.
        region[offset + piece.size : offset + padded].zero_()
    if len(listed) == 1:
        codes, scales = listed[0][:2]
        torch_codes.quantize(
            region, codes, scales, code, arena.code_space, noise
        )
        return
    blocks = region.numel() // code.block
    codes, scales = torch_arena.staged_codes(code, blocks, arena)
    torch_codes.quantize(region, codes, scales, code, arena.code_space, noise)
    targets, sources, block = [], [], 0
    for item in listed:
        count = item[0].shape[0]
        targets += [item[0], item[1]]
        sources += [codes[block : block + count], scales[block : block + count]]
        block += count
    torch._foreach_copy_(targets, sources)


def _has_fused_adam(inner):
    import torch

    return type(inner).__name__ in ("Adam", "AdamW") and hasattr(
        torch, "_fused_adam_"
    )


def _fused_adam(inner, grads, order, learning_rate):
    """Keras' Adam update in one pass: torch's fused Adam kernel.

    torch adds epsilon to the bias-corrected square root, Keras to the
    uncorrected one; an epsilon divided by `sqrt(1 - beta_2**t)` makes
    torch's update Keras' own. Weight decay is applied before, as Keras
    does, so the kernel gets none.
    """
    import torch

    def slots(name):
        held = getattr(inner, name)
        return [held[inner._get_variable_index(t)].value for t in order]

    step = float(inner.iterations.numpy()) + 1.0
    correction = (1.0 - float(inner.beta_2) ** step) ** 0.5
    device = grads[0].device
    steps = [torch.tensor(step, dtype=torch.float32, device=device)] * len(
        order
    )
    torch._fused_adam_(
        [t.value for t in order],
        list(grads),
        slots("_momentums"),
        slots("_velocities"),
        slots("_velocity_hats") if inner.amsgrad else [],
        steps,
        amsgrad=bool(inner.amsgrad),
        lr=float(learning_rate),
        beta1=float(inner.beta_1),
        beta2=float(inner.beta_2),
        weight_decay=0.0,
        eps=float(inner.epsilon) / correction,
        maximize=False,
    )


def _write_weight(wrapper, piece, arena, narrowed):
    """Writes a piece's weight back: Kahan-compensated or rounded to
    nearest here (nearest through the batched copy `narrowed`); rounded
    stochastically with its region (`_store_rounded_region`)."""
    view = piece.view
    working = view.working
    stored = arena.stored.get(id(working))
    if (
        stored is None
        or torch_arena.weight_role(wrapper, view) == torch_arena.ROUNDED
    ):
        return
    if view.compensation is not None:
        # Rounded to nearest; the compensation keeps what it took off.
        stored.copy_(working)
        rounded = arena.sum_space[: piece.size].copy_(stored)
        working.sub_(rounded)
        piece.flat(view.compensation._value).copy_(working)
    else:
        _pair(narrowed, stored, working)


def store_rounded(stored, working, noise, scratch=None):
    """Stores float32 `working` into `stored`, rounded stochastically.

    For bfloat16 storage the random 16 bits are added to the float32 bit
    pattern and the high half of the sum is the bfloat16 result, written
    straight into the storage: one addition and one copy besides the
    draw. Infinities and NaNs produced by arithmetic stay what they are
    (only a NaN whose payload sets all of bfloat16's mantissa bits could
    carry over into the sign, and arithmetic never makes one). float16
    goes through `compensated_updates.stochastic_round`.

    Args:
        stored: The bfloat16 or float16 torch tensor to write.
        working: The float32 values, a torch tensor of the same shape.
        noise: A `random_bits.TorchNoise` (a compiled kernel may then
            hash a key drawn from it: `torch_kernels`), or a
            `keras.random.SeedGenerator` (advanced by one; the bits of
            `compensated_updates.stochastic_round`).
        scratch: Optional float32 torch tensor of at least as many
            elements, to hold the sum on a CPU.
    """
    import torch

    # The step's stream may use the compiled kernel's hashed bits; a
    # seed gives the bits `compensated_updates.stochastic_round` draws.
    from_stream = isinstance(noise, random_bits.TorchNoise)
    if not from_stream:
        noise = random_bits.TorchNoise(noise, working.device)
    if stored.dtype != torch.bfloat16 or sys.byteorder != "little":
        seed = int(noise.int32(2).sum()) & 0x7FFFFFFF
        stored.copy_(
            compensated_updates.stochastic_round(working, stored.dtype, seed)
        )
        return
    if from_stream and stored.is_contiguous() and working.is_contiguous():
        if torch_kernels.round_to_bfloat16(stored, working, noise):
            return
    size = working.numel()
    if noise.device.type == "cpu":
        bits = working.reshape(-1).view(torch.int32).numpy()
        if scratch is None:
            summed = torch.from_numpy(bits + noise.uint16(size))
        else:
            summed = scratch[:size].view(torch.int32)
            np.add(bits, noise.uint16(size), out=summed.numpy())
    else:
        summed = noise.int32(size)
        summed.add_(working.reshape(-1).view(torch.int32))
    stored.view(torch.int16).view(-1).copy_(summed.view(torch.int16)[1::2])


def _elements(variable):
    count = 1
    for dimension in variable.shape:
        count *= int(dimension)
    return count


def _slots_by_variable(wrapper):
    """Returns `{id(model variable): [its optimizer slots]}`, or None where
    the inner optimizer keeps its slots in a way this module cannot see.

    Keras' optimizers keep each kind of slot in a list with one entry a
    variable (`_momentums`, `_velocities`, ...), in the order they were
    built on; every slot must have its variable's shape.
    """
    targets = wrapper._targets
    cached = getattr(targets, "slots_by_variable", False)
    if cached is not False:
        return cached
    inner = wrapper.inner_optimizer
    order = targets.order
    lists = [
        value
        for name, value in vars(inner).items()
        if name not in ("_trainable_variables", "_variables")
        and isinstance(value, list)
        and len(value) == len(order)
        and all(isinstance(v, keras.Variable) or v is None for v in value)
        and any(isinstance(v, keras.Variable) for v in value)
    ]
    by_variable, found, shapes_match = {}, set(), True
    for index, target in enumerate(order):
        variable = getattr(target, "weight", target)
        held = [slots[index] for slots in lists if slots[index] is not None]
        shapes_match &= all(
            tuple(slot.shape) == tuple(variable.shape) for slot in held
        )
        found.update(id(slot) for slot in held)
        by_variable[id(variable)] = held
    covered = set(targets.rounded_slots) <= found and (
        set(targets.quantized_slots) <= found
    )
    result = by_variable if covered and shapes_match else None
    targets.slots_by_variable = result
    return result
