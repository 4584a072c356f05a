"""Keras' Adam on 8-bit state as one torch kernel a group.

The batched torch step (`torch_step`) widens a group's weights and
moments into float32 working space, runs Adam there and codes the moments
back: a pass over memory for each end, and one hash of random bits for
each value rounded. For Keras' `Adam` and `AdamW` (without `amsgrad`)
whose two moments are 8-bit codes, this module runs a group's whole
update as one kernel instead (`torch_kernels`: compiled where
`torch.compile` works, else the same body eagerly): each block of 256
elements is dequantized, updated, requantized and its weight stored
while it is in cache, from one pair of hashes of the element's index.

- The arithmetic is the package's Adam (`torch_numerics.adam_update`,
  Keras' torch Adam's in float32), the one `torch_step` runs for other
  state; weight decay (AdamW's, or Adam's own `weight_decay`) first, as
  Keras applies it, for the weights it applies to.
- The codes and scales are `block_codes`' (the same map, scale and
  stochastic rounding with 16 random bits); a bfloat16 weight is rounded
  stochastically with 16 more (`update="stochastic_rounding"`), or to
  nearest with its bfloat16 Kahan compensation keeping the rest
  (`update="kahan"`); a float32 weight is stored as it is.
- The weights, gradients, codes and scales of a group are staged
  side by side in whole blocks (the padding zeros), so the kernel works
  on copies: a group whose step makes an infinity or a NaN writes
  nothing and goes through `torch_step`'s general path, which stores such
  values as `block_codes` does.

Everything else takes the general path: float16 weights or
compensations, `update="nearest"`, 4-bit state (its two codes a byte
made the same kernel three times slower than the general path's:
inductor could not vectorize the packing inside the fused loop), and
other optimizers.

The 8-bit block-wise state follows Dettmers et al. 2022 ("8-bit
Optimizers via Block-wise Quantization", arXiv:2110.02861); a fused
low-bit Adam step a parameter, compiled, follows torchao
(https://github.com/pytorch/ao/tree/main/torchao/optim).
"""

import typing

import torch

from keras_dtype_policy.low_precision import block_codes
from keras_dtype_policy.low_precision import torch_arena
from keras_dtype_policy.low_precision import torch_kernels
from keras_dtype_policy.low_precision import torch_numerics
from keras_dtype_policy.low_precision.quantized_slots import QuantizedSlot

# The codes of the first and the second moment.
SIGNED = block_codes.code_for(8, True)
UNSIGNED = block_codes.code_for(8, False)
# A group's staged blocks are a multiple of this, so that a few fixed
# sizes (each compiled once, with static shapes) cover every group.
ROWS = 512
# How a weight is stored back: bfloat16 rounded stochastically, bfloat16
# with a bfloat16 Kahan compensation, or float32 as it is.
STOCHASTIC = "stochastic"
KAHAN = "kahan"
FLOAT32 = "float32"


class Moments(typing.NamedTuple):
    """A piece's two quantized Adam slots."""

    m: QuantizedSlot
    v: QuantizedSlot


class Member(typing.NamedTuple):
    """A piece of a group, and its moments."""

    piece: object
    moments: Moments


class AdamTensors(typing.NamedTuple):
    """A group's staged tensors, the kernel's arguments: flat weights,
    compensations (empty without) and gradients, each moment's codes
    `(blocks, bytes)` and scales, and each block's decay rate."""

    weight: torch.Tensor
    compensation: torch.Tensor
    grad: torch.Tensor
    m_codes: torch.Tensor
    m_scales: torch.Tensor
    v_codes: torch.Tensor
    v_scales: torch.Tensor
    decay: torch.Tensor


def moments(wrapper, piece):
    """Returns a piece's `Moments` where this module can update it (its
    inner optimizer one whose update is the package's Adam:
    `torch_step.is_package_adam`), else None."""
    inner = wrapper.inner_optimizer
    view = piece.view
    if wrapper.update_rule not in ("stochastic_rounding", "kahan"):
        return None
    if _store(wrapper, view) is None or len(piece.slots) != 2:
        return None
    if piece.grad.dtype not in (torch.float32, torch.bfloat16):
        return None
    index = inner._get_variable_index(view)
    pair = Moments(inner._momentums[index], inner._velocities[index])
    if not all(isinstance(slot, QuantizedSlot) for slot in pair):
        return None
    if (pair.m.code, pair.v.code) != (SIGNED, UNSIGNED):
        return None
    return pair


def _store(wrapper, view):
    """How a weight is stored back (`STOCHASTIC`, `KAHAN`, `FLOAT32`);
    None for what this module leaves to the general path."""
    weight = view.weight._value.dtype
    compensation = view.compensation
    if weight == torch.float32:
        return FLOAT32 if compensation is None else None
    if weight != torch.bfloat16:
        return None
    if wrapper.update_rule == "stochastic_rounding" and compensation is None:
        return STOCHASTIC
    if compensation is not None and compensation.dtype == "bfloat16":
        return KAHAN
    return None


def apply(wrapper, pieces, learning_rate, noise, limit):
    """Updates the pieces `moments` accepts, in groups of at most `limit`
    elements; returns the pieces left to the general path."""
    if noise is None:
        return pieces
    rest, groups = _groups(wrapper, pieces, limit)
    if not groups:
        return rest
    inner = wrapper.inner_optimizer
    hyper = torch_numerics.AdamHyperparameters.of(inner, learning_rate)
    for group in groups:
        if not _update_group(wrapper, group, hyper, noise):
            rest += [member.piece for member in group]
    return rest


def _groups(wrapper, pieces, limit):
    """`(rest, groups)`: the pieces `moments` refuses, and the others as
    lists of `Member`s of one kind (weight, gradient, store), each of at
    most `limit` elements."""
    rest, by_kind, sizes = [], {}, {}
    for piece in pieces:
        pair = moments(wrapper, piece)
        if pair is None:
            rest.append(piece)
            continue
        store = _store(wrapper, piece.view)
        kind = (piece.view.weight._value.dtype, piece.grad.dtype, store)
        listed = by_kind.setdefault(kind, [[]])
        if listed[-1] and sizes[kind] + piece.size > limit:
            listed.append([])
            sizes[kind] = 0
        listed[-1].append(Member(piece, pair))
        sizes[kind] = sizes.get(kind, 0) + piece.size
    return rest, [group for listed in by_kind.values() for group in listed]


def _update_group(wrapper, group, hyper, noise):
    """Runs the kernel on one group; False (nothing written) where the
    step is not finite."""
    total = sum(torch_arena.padded(m.piece, m.moments.m) for m in group)
    blocks = -(-total // (ROWS * SIGNED.block)) * ROWS
    staged = _staging(wrapper, group, blocks)
    written = _stage(group, staged)
    _fill_decay(wrapper.inner_optimizer, group, staged.decay, hyper.decay)
    torch_kernels.run(
        _adam_body,
        (staged,),
        hyper.as_tensor(staged.weight.device),
        noise.kernel_key(),
        store=_store(wrapper, group[0].piece.view),
        rows=blocks,
    )
    finite = torch.isfinite(staged.m_scales).all()
    if not bool(finite & torch.isfinite(staged.v_scales).all()):
        return False
    written.run()
    return True


def _staging(wrapper, group, blocks):
    """The group's `AdamTensors`, in space of the wrapper's reused from
    step to step (`StepTargets.coded_adam_space`)."""
    view = group[0].piece.view
    total = blocks * SIGNED.block
    width = SIGNED.bytes_per_block
    compensation = view.compensation
    needs = {
        "weight": (view.weight._value.dtype, total),
        "compensation": (
            (compensation._value.dtype, total)
            if compensation is not None
            else (torch.float32, 0)
        ),
        "grad": (group[0].piece.grad.dtype, total),
        "m_codes": (torch.int8, blocks * width),
        "m_scales": (torch.float32, blocks),
        "v_codes": (torch.int8, blocks * width),
        "v_scales": (torch.float32, blocks),
        "decay": (torch.float32, blocks),
    }
    spaces = wrapper._targets.coded_adam_space
    device = view.weight._value.device
    tensors = {}
    for name, (dtype, size) in needs.items():
        held = spaces.get((name, dtype))
        if held is None or held.numel() < size or held.device != device:
            held = torch.empty(size, dtype=dtype, device=device)
            spaces[(name, dtype)] = held
        tensors[name] = held[:size]
    for name in ("m_codes", "v_codes"):
        tensors[name] = tensors[name].view(blocks, width)
    return AdamTensors(**tensors)


def _stage(group, staged):
    """Copies the group into `staged`, padding zeros and all; returns the
    `torch_arena.Copies` that write the results back."""
    gathered, written = torch_arena.Copies(), torch_arena.Copies()
    tails, offset = [], 0
    for member in group:
        piece = member.piece
        stop = offset + piece.size
        padded = offset + torch_arena.padded(piece, member.moments.m)
        for into, source in _sources(staged, piece):
            gathered.add(into[offset:stop], piece.flat(source))
            if source is not piece.grad:
                written.add(piece.flat(source), into[offset:stop])
            if padded > stop:
                tails.append(into[stop:padded])
        offset = padded
    used = offset // SIGNED.block
    # The rows after the group's: zeros, never written back.
    tails += [staged.weight[offset:], staged.grad[offset:]]
    tails.append(staged.compensation[offset:])
    for name in ("m_codes", "m_scales", "v_codes", "v_scales"):
        tails.append(getattr(staged, name)[used:])
    gathered.run()
    tails = [tail for tail in tails if tail.numel()]
    if tails:
        torch._foreach_zero_(tails)
    _stage_codes(group, staged, used, written)
    return written


def _sources(staged, piece):
    """`(staged tensor, the piece's tensor)` of what the kernel reads."""
    view = piece.view
    yield staged.weight, view.weight._value
    yield staged.grad, piece.grad
    if view.compensation is not None:
        yield staged.compensation, view.compensation._value


def _stage_codes(group, staged, used, written):
    """Stages each moment's codes and scales of the group's blocks;
    `written` gets their copies back."""
    for name in ("m", "v"):
        for part in ("codes", "scales"):
            pieces, row = [], 0
            into = getattr(staged, f"{name}_{part}")
            for member in group:
                slot = getattr(member.moments, name)
                first, stop = torch_arena.blocks_of(member.piece, slot)
                held = getattr(slot, part)._value[first:stop]
                pieces.append(held)
                written.add(held, into[row : row + stop - first])
                row += stop - first
            torch.cat(pieces, out=into[:used])


def _fill_decay(inner, group, decay, rate):
    """Each staged block's decay rate: `rate` where Keras decays the
    weight (`_use_weight_decay`), else 0."""
    flags = [
        1.0 if inner._use_weight_decay(m.piece.view) else 0.0 for m in group
    ]
    if len(set(flags)) == 1:
        decay.fill_(rate * flags[0])
        return
    row = 0
    for member, flag in zip(group, flags, strict=True):
        count = torch_arena.padded(member.piece, member.moments.m)
        count //= SIGNED.block
        decay[row : row + count].fill_(rate * flag)
        row += count
    decay[row:].zero_()


def _adam_body(staged, hyper, key, *, store, rows):
    """The body of the kernel: a group's Adam step on 8-bit moments.

    `rows`, the staged blocks, is a constant of the kernel: each of the
    few sizes (`ROWS` blocks apart) has its own, with static shapes.
    """
    del rows  # Only a constant of the kernel.
    hyper = torch_numerics.AdamHyperparameters.of_tensor(hyper)
    block = SIGNED.block
    m = torch_numerics.dequantized(staged.m_codes, staged.m_scales, SIGNED)
    v = torch_numerics.dequantized(staged.v_codes, staged.v_scales, UNSIGNED)
    g = staged.grad.view(-1, block).to(torch.float32)
    w = staged.weight.view(-1, block).to(torch.float32)
    if store == KAHAN:
        w = w + staged.compensation.view(-1, block).to(torch.float32)
    w = torch_numerics.decayed(w, staged.decay[:, None])
    w, m, v = torch_numerics.adam_update(w, g, m, v, hyper)
    # Two hashes of the index give three 16-bit draws: the first's high
    # half rounds the weight, its low half the second moment; the high
    # half of a further mix of it rounds the first moment.
    size = staged.weight.shape[0]
    words = torch_numerics.hashed_words(size, key, staged.weight.device)
    words = words.view(-1, block)
    high = torch_numerics.high_bits(torch_numerics.remix(words))
    _write_codes(m, high, SIGNED, staged.m_codes, staged.m_scales)
    low = torch_numerics.low_bits(words)
    _write_codes(v, low, UNSIGNED, staged.v_codes, staged.v_scales)
    _write_weight(w, torch_numerics.high_bits(words), staged, store)


def _write_codes(values, bits, code, codes, scales):
    """Writes `values` (rows of blocks) as codes and scales, rounded
    stochastically with the 16-bit `bits`."""
    noise = torch_numerics.uniform(bits)
    coded, largest = torch_numerics.quantized(values, noise, code)
    codes.copy_(coded)
    scales.copy_(largest)


def _write_weight(w, bits, staged, store):
    """Stores the float32 weights `w` as `store` says."""
    if store == FLOAT32:
        staged.weight.copy_(w.view(-1))
        return
    if store == STOCHASTIC:
        pattern = w.view(torch.int32)
        rounded = torch_numerics.stochastic_bfloat16(pattern, bits)
    else:
        rounded, left = torch_numerics.kahan_split(w, torch.bfloat16)
        compensation = staged.compensation
        compensation.copy_(left.view(-1).to(compensation.dtype))
    staged.weight.copy_(rounded.view(-1).to(staged.weight.dtype))
