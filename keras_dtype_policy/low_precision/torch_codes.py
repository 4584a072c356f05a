"""Block codes on torch: in-place dequantize and quantize of a piece.

The batched torch step (`torch_step`) reads a piece of a quantized slot
into float32 working space, lets the update run there, and writes it back
as codes. Where `torch.compile` works, `torch_kernels` does both ends as
one compiled kernel each. Otherwise this module does them with in-place
torch operations into space the caller owns, one kernel an operation and
no allocation of the piece's size. Both compute exactly what
`block_codes` computes: the same float32 operations in the same order, so
rounding to nearest gives the same codes and scales bit for bit, and
stochastic rounding the same distribution (here its bits come from a
`random_bits.TorchNoise`). A piece with an infinity or a NaN goes through
`block_codes.quantize` itself.

torch is imported inside functions, only once Keras runs on it.
"""

import numpy as np

from keras_dtype_policy.low_precision import block_codes
from keras_dtype_policy.low_precision import torch_kernels

# How many float32 scratch tensors of a piece's size `quantize` needs.
SCRATCH_TENSORS = 4


def dequantize(out, codes, scales, code, scratch):
    """Writes the float32 values `(codes, scales)` stand for into `out`.

    Args:
        out: A flat float32 torch tensor of `blocks * code.block` elements.
        codes: The int8 codes, shape `(blocks, code.bytes_per_block)`.
        scales: The float32 scales, shape `(blocks,)`.
        code: The `block_codes.Code`.
        scratch: A flat float32 torch tensor of at least `out`'s size.
    """
    import torch

    if torch_kernels.dequantize(out, codes, scales, code):
        return
    if code.bits == 4:
        _unpack(out, codes, code)
    else:
        out.copy_(codes.reshape(-1))
        if not code.signed:
            # The unsigned index is the code + 128.
            out.add_(128.0)
    if code.signed:
        # k * |k| on the grid.
        magnitude = scratch[: out.numel()]
        torch.abs(out, out=magnitude)
        out.mul_(magnitude)
    else:
        # (k + 1)**4 on the grid, k the unsigned index.
        out.add_(1.0)
        out.mul_(out)
        out.mul_(out)
    grid = float(code.levels**code.power)
    out.view(-1, code.block).mul_((scales / grid)[:, None])


def quantize(values, codes, scales, code, scratch, noise=None):
    """Writes `values` as codes and scales; `values` is overwritten.

    Args:
        values: A flat float32 torch tensor of `blocks * code.block`
            elements (its padding zeros).
        codes: The int8 torch tensor to write, `(blocks, bytes)`.
        scales: The float32 torch tensor to write, `(blocks,)`.
        code: The `block_codes.Code`.
        scratch: `SCRATCH_TENSORS` flat float32 torch tensors of at least
            `values`' size.
        noise: A `random_bits.TorchNoise` for stochastic rounding; None
            rounds to nearest.
    """
    import torch

    if torch_kernels.quantize(values, codes, scales, code, noise):
        return
    size = values.numel()
    relative, index, level, high = (s[:size] for s in scratch)
    # The largest magnitude of each block (of each positive value for an
    # unsigned code). Infinities and NaN make a scale non-finite: such a
    # piece takes `block_codes`' own path, which leaves them out.
    if code.signed:
        torch.abs(values, out=relative)
    else:
        torch.clamp(values, min=0.0, out=relative)
    torch.amax(relative.view(-1, code.block), 1, out=scales)
    if not bool(torch.isfinite(scales).all()):
        _quantize_in_general(values, codes, scales, code, noise)
        return
    if not code.signed:
        scales.add_(0.0)  # -0.0 (a block of no positive value) to 0.0.
    # The position on the grid and the level below it
    # (`block_codes.quantize`, `block_codes._level_below`).
    grid = float(code.levels**code.power)
    inverse = grid / torch.where(scales > 0.0, scales, 1.0)
    position = relative
    position.view(-1, code.block).mul_(inverse[:, None])
    # No `minimum(position, grid)`: the piece is finite, so position
    # exceeds the grid by a rounding at most, and the index's clip and the
    # comparison below (position - low >= gap > gap * u) give the same code.
    torch.sqrt(position, out=index)
    if code.signed:
        index.floor_()
        index.clamp_(max=code.levels - 1.0)
        torch.mul(index, index, out=level)
        # The gap to the level above, (k + 1)**2 - k**2.
        torch.add(index, index, out=high)
        high.add_(1.0)
    else:
        index.sqrt_()
        index.floor_()
        index.sub_(1.0)
        index.clamp_(0.0, code.levels - 2.0)
        _grid_level(index, 1.0, level)
        _grid_level(index, 2.0, high)
        high.sub_(level)
    # Up where position - low >= gap * u: u = 1/2 rounds to nearest, u
    # uniform in (0, 1) at random.
    position.sub_(level)
    if noise is None:
        high.mul_(0.5)
    else:
        _uniform(noise, level)
        high.mul_(level)
    position.ge_(high)
    index.add_(position)
    if code.signed:
        index.copysign_(values)
    if code.bits == 4:
        _pack(index, codes, code, relative)
    else:
        if not code.signed:
            index.sub_(128.0)
        codes.view(-1).copy_(index)


def _grid_level(index, offset, out):
    """`(index + offset)**4` into `out`."""
    import torch

    torch.add(index, offset, out=out)
    out.mul_(out)
    out.mul_(out)


def _uniform(noise, out):
    """`(bits + 0.5) / 65536` for 16 random bits an element, into `out`."""
    size = out.numel()
    if noise.device.type == "cpu":
        np.copyto(out.numpy(), noise.uint16(size), casting="unsafe")
    else:
        out.copy_(noise.int32(size))
    out.add_(0.5)
    out.mul_(1.0 / 65536.0)


def _unpack(out, codes, code):
    """Two 4-bit indices a byte (the even element low) into `out`."""
    import torch

    # The byte is the code + 128: the int8's bits with the top bit flipped.
    byte = torch.bitwise_xor(codes.reshape(-1).view(torch.uint8), 128)
    pairs = out.view(-1, 2)
    pairs[:, 0].copy_(torch.bitwise_and(byte, 15))
    pairs[:, 1].copy_(torch.bitwise_right_shift(byte, 4))
    if code.signed:
        out.sub_(float(code.levels))


def _pack(index, codes, code, space):
    """Packs float `index` (even element low) into the int8 `codes`."""
    import torch

    if code.signed:
        index.add_(float(code.levels))
    pairs = index.view(-1, 2)
    packed = space[: pairs.shape[0]]
    torch.mul(pairs[:, 1], 16.0, out=packed)
    packed.add_(pairs[:, 0])
    packed.sub_(128.0)
    codes.view(-1).copy_(packed)


def _quantize_in_general(values, codes, scales, code, noise):
    """`block_codes.quantize` of a piece holding an infinity or a NaN."""
    seed = None
    if noise is not None:
        seed = int(noise.int32(2).sum()) & 0x7FFFFFFF
    new_codes, new_scales = block_codes.quantize(values, code, seed)
    codes.copy_(new_codes)
    scales.copy_(new_scales)
