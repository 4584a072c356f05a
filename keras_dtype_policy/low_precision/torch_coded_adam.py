"""Keras' Adam on 8-bit state as one compiled torch kernel a group.

The batched torch step (`torch_step`) widens a group's weights and
moments into float32 working space, runs Adam there and codes the moments
back: a pass over memory for each end, and one hash of random bits for
each value rounded. For Keras' `Adam` and `AdamW` (without `amsgrad`)
whose two moments are 8-bit codes, this module runs a group's whole
update as one compiled kernel instead (`torch_kernels`): each block of
256 elements is dequantized, updated, requantized and its weight stored
while it is in cache, from one pair of hashes of the element's index.

- The arithmetic is Keras' torch Adam's, in float32: `m = beta_1 * m +
  (1 - beta_1) * g`, `v = beta_2 * v + (1 - beta_2) * g**2`,
  `w -= alpha * m / (sqrt(v) + epsilon)` with `alpha = lr * sqrt(1 -
  beta_2**t) / (1 - beta_1**t)`; weight decay (AdamW's, or Adam's own
  `weight_decay`) first, as Keras applies it, for the weights it applies
  to.
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
inductor could not vectorize the packing inside the fused loop), other
optimizers, and
every step where the kernels do not compile (`KDP_TORCH_COMPILE=0`, no
C++ compiler).

torch is imported inside functions, only once Keras runs on it.
"""

from keras_dtype_policy.low_precision import block_codes
from keras_dtype_policy.low_precision import random_bits
from keras_dtype_policy.low_precision import torch_arena
from keras_dtype_policy.low_precision import torch_kernels
from keras_dtype_policy.low_precision.quantized_slots import QuantizedSlot

# The codes of the first and the second moment.
SIGNED = block_codes.code_for(8, True)
UNSIGNED = block_codes.code_for(8, False)
_ADAMS = ("Adam", "AdamW")
# A group's staged blocks are a multiple of this, so that a few fixed
# sizes (each compiled once, with static shapes) cover every group.
ROWS = 512


def moments(wrapper, piece):
    """Returns a piece's `(m, v)` quantized slots where this module can
    update it, else None."""
    import torch

    inner = wrapper.inner_optimizer
    view = piece.view
    if type(inner).__name__ not in _ADAMS or inner.amsgrad:
        return None
    if wrapper.update not in ("stochastic_rounding", "kahan"):
        return None
    if _store(wrapper, view) is None or len(piece.slots) != 2:
        return None
    if piece.grad.dtype not in (torch.float32, torch.bfloat16):
        return None
    index = inner._get_variable_index(view)
    pair = (inner._momentums[index], inner._velocities[index])
    if not all(isinstance(slot, QuantizedSlot) for slot in pair):
        return None
    if (pair[0].code, pair[1].code) != (SIGNED, UNSIGNED):
        return None
    return pair


def _store(wrapper, view):
    """How a weight is stored back: `"stochastic"` (bfloat16, rounded
    stochastically), `"kahan"` (bfloat16 with a bfloat16 compensation),
    `"float32"`; None for what this module leaves to the general path."""
    import torch

    weight = view.weight._value.dtype
    compensation = view.compensation
    if weight == torch.float32:
        return "float32" if compensation is None else None
    if weight != torch.bfloat16:
        return None
    if wrapper.update == "stochastic_rounding" and compensation is None:
        return "stochastic"
    if compensation is not None and compensation.dtype == "bfloat16":
        return "kahan"
    return None


def apply(wrapper, pieces, learning_rate, noise, limit):
    """Updates the pieces `moments` accepts, in groups of at most `limit`
    elements; returns the pieces left to the general path."""
    if noise is None or not torch_kernels.enabled():
        return pieces
    rest, groups, sizes = [], {}, {}
    for piece in pieces:
        pair = moments(wrapper, piece)
        if pair is None:
            rest.append(piece)
            continue
        store = _store(wrapper, piece.view)
        kind = (piece.view.weight._value.dtype, piece.grad.dtype, store)
        group = groups.setdefault(kind, [[]])
        if group[-1] and sizes[kind] + piece.size > limit:
            group.append([])
            sizes[kind] = 0
        group[-1].append((piece, pair))
        sizes[kind] = sizes.get(kind, 0) + piece.size
    if not groups:
        return rest
    hyper = _hyperparameters(wrapper.inner_optimizer, learning_rate)
    for listed in groups.values():
        for group in listed:
            if not _update_group(wrapper, group, hyper, noise):
                rest += [piece for piece, _ in group]
    return rest


def _hyperparameters(inner, learning_rate):
    """The step's float32 constants: `beta_1`, `1 - beta_1`, `beta_2`,
    `1 - beta_2`, `alpha`, `epsilon` and the weight decay rate."""
    import torch

    step = float(inner.iterations.numpy()) + 1.0
    rate = float(learning_rate)
    beta_1, beta_2 = float(inner.beta_1), float(inner.beta_2)
    alpha = rate * (1.0 - beta_2**step) ** 0.5 / (1.0 - beta_1**step)
    decay = float(inner.weight_decay or 0.0) * rate
    values = (beta_1, 1.0 - beta_1, beta_2, 1.0 - beta_2, alpha)
    values += (float(inner.epsilon), decay)
    return torch.tensor(values, dtype=torch.float32)


def _update_group(wrapper, group, hyper, noise):
    """Runs the kernel on one group; False (nothing written) where the
    kernel is not available or the step is not finite."""
    import torch

    inner = wrapper.inner_optimizer
    view = group[0][0].view
    total = sum(torch_arena.padded(p, m) for p, (m, _) in group)
    block = SIGNED.block
    blocks = -(-total // (ROWS * block)) * ROWS
    kernel = torch_kernels.compiled(
        _adam_body, "adam", store=_store(wrapper, view), rows=blocks
    )
    if kernel is None:
        return False
    space = _Staging(wrapper, group, blocks)
    # (staged, stored) pairs: all copied in; weights and compensations
    # copied back.
    gathered, written, tails, decays, offset = ([], []), [], [], [], 0
    listed = {"m_codes": [], "m_scales": [], "v_codes": [], "v_scales": []}
    for piece, (m, v) in group:
        size, padded = piece.size, torch_arena.padded(piece, m)
        staged_pairs = [
            (space.weight, piece.view.weight._value),
            (space.grad, piece.grad),
        ]
        if space.compensation is not None:
            staged_pairs.append(
                (space.compensation, piece.view.compensation._value)
            )
        for staged, source in staged_pairs:
            gathered[0].append(staged[offset : offset + size])
            gathered[1].append(piece.flat(source))
            if source is not piece.grad:
                written.append((gathered[1][-1], gathered[0][-1]))
            if padded > size:
                tails.append(staged[offset + size : offset + padded])
        first, stop = torch_arena.blocks_of(piece, m)
        for name, slot in (("m", m), ("v", v)):
            listed[f"{name}_codes"].append(slot.codes._value[first:stop])
            listed[f"{name}_scales"].append(slot.scales._value[first:stop])
        decays.append(1.0 if inner._use_weight_decay(piece.view) else 0.0)
        offset += padded
    used = total // block
    if used < blocks:
        # The rows after the group's: zeros, never written back.
        tails += [space.weight[total:], space.grad[total:]]
        if space.compensation is not None:
            tails.append(space.compensation[total:])
        tails += [getattr(space, name)[used:] for name in listed]
    torch._foreach_copy_(*gathered)
    if tails:
        torch._foreach_zero_(tails)
    for name, pieces in listed.items():
        torch.cat(pieces, out=getattr(space, name)[:used])
    rate = float(hyper[6])
    if len(set(decays)) == 1:
        space.decay.fill_(rate * decays[0])
    else:
        row = 0
        for (piece, (m, _)), flag in zip(group, decays, strict=True):
            count = torch_arena.padded(piece, m) // block
            space.decay[row : row + count].fill_(rate * flag)
            row += count
        space.decay[row:].zero_()
    arguments = (
        space.weight,
        space.compensation if space.compensation is not None else space.none,
        space.grad,
        space.m_codes,
        space.m_scales,
        space.v_codes,
        space.v_scales,
    )
    key = noise.int32(2)
    if not torch_kernels.run(kernel, arguments, hyper, space.decay, key):
        return False
    finite = torch.isfinite(space.m_scales).all()
    if not bool(finite & torch.isfinite(space.v_scales).all()):
        return False
    for name, pieces in listed.items():
        row = 0
        for piece in pieces:
            count = piece.shape[0]
            written.append((piece, getattr(space, name)[row : row + count]))
            row += count
    torch._foreach_copy_(*zip(*written, strict=True))
    return True


class _Staging:
    """A group's staged weights, gradients, codes and scales, in space of
    the wrapper's reused from step to step."""

    def __init__(self, wrapper, group, blocks):
        import torch

        piece = group[0][0]
        total = blocks * SIGNED.block
        width = SIGNED.bytes_per_block
        needs = {
            "weight": (piece.view.weight._value.dtype, total),
            "grad": (piece.grad.dtype, total),
            "m_codes": (torch.int8, blocks * width),
            "v_codes": (torch.int8, blocks * width),
            "m_scales": (torch.float32, blocks),
            "v_scales": (torch.float32, blocks),
            "decay": (torch.float32, blocks),
        }
        self.none = torch.empty(0, device=piece.view.weight._value.device)
        if piece.view.compensation is not None:
            needs["compensation"] = (
                piece.view.compensation._value.dtype,
                total,
            )
        else:
            self.compensation = None
        spaces = getattr(wrapper._targets, "coded_adam_space", None)
        if spaces is None:
            spaces = wrapper._targets.coded_adam_space = {}
        device = piece.view.weight._value.device
        for name, (dtype, size) in needs.items():
            held = spaces.get((name, dtype))
            if held is None or held.numel() < size or held.device != device:
                held = torch.empty(size, dtype=dtype, device=device)
                spaces[(name, dtype)] = held
            value = held[:size]
            if name.endswith("codes"):
                value = value.view(blocks, width)
            setattr(self, name, value)


def _adam_body(
    weight,
    compensation,
    grad,
    m_codes,
    m_scales,
    v_codes,
    v_scales,
    hyper,
    decay,
    key,
    *,
    store,
    rows,
):
    """The body of the kernel: a group's Adam step on 8-bit moments
    (`rows` blocks, a constant of the kernel: its shapes are static)."""
    import torch

    signed = torch_kernels.constants(SIGNED)
    unsigned = torch_kernels.constants(UNSIGNED)
    block = signed["block"]
    m = torch_kernels.dequantized(m_codes, m_scales, **signed)
    v = torch_kernels.dequantized(v_codes, v_scales, **unsigned)
    g = grad.view(-1, block).to(torch.float32)
    w = weight.view(-1, block).to(torch.float32)
    if store == "kahan":
        w = w + compensation.view(-1, block).to(torch.float32)
    w = w - w * decay[:, None]
    m = m * hyper[0] + g * hyper[1]
    v = v * hyper[2] + (g * g) * hyper[3]
    w = w - (m * hyper[4]) / (torch.sqrt(v) + hyper[5])
    # Two hashes of the index give three 16-bit draws: the first's high
    # half rounds the weight, its low half the second moment; the high
    # half of a further mix of it rounds the first moment.
    words = torch_kernels.hashed_words(weight.shape[0], key, weight.device)
    words = words.view(-1, block)
    mixed = words ^ ((words >> 15) & 0x1FFFF)
    mixed = mixed * random_bits.MULTIPLY_1
    coded, m_largest = torch_kernels.quantized(
        m, _uniform((mixed >> 16) & 0xFFFF), **signed
    )
    m_codes.copy_(coded)
    m_scales.copy_(m_largest)
    coded, v_largest = torch_kernels.quantized(
        v, _uniform(words & 0xFFFF), **unsigned
    )
    v_codes.copy_(coded)
    v_scales.copy_(v_largest)
    if store == "float32":
        weight.copy_(w.view(-1))
        return
    # The bfloat16 value as float32 bits, rounded in integers (inductor
    # may drop a float32 -> bfloat16 -> float32 round trip): half a unit
    # and 16 random bits (stochastic rounding), or half a unit less one
    # plus the kept bit (to nearest, ties to even); the low half cleared.
    pattern = w.view(torch.int32)
    if store == "stochastic":
        pattern = pattern + ((words >> 16) & 0xFFFF)
    else:
        pattern = pattern + (0x7FFF + ((pattern >> 16) & 1))
    rounded = (pattern & -65536).view(torch.float32)
    weight.copy_(rounded.view(-1).to(weight.dtype))
    if store == "kahan":
        # The compensation keeps what rounding took off.
        left = w - rounded
        compensation.copy_(left.view(-1).to(compensation.dtype))


def _uniform(bits):
    import torch

    return (bits.to(torch.float32) + 0.5) * (1.0 / 65536.0)
