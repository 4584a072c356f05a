"""Block codes on torch as compiled kernels: one pass a slot.

`torch_codes` dequantizes and quantizes a piece with about twenty
in-place torch operations, each a pass over the piece. Where
`torch.compile` works (inductor with a C++ compiler on a CPU, Triton on
a GPU), this module runs the same float32 operations, in the same order,
as one fused kernel for each direction: the same codes and scales bit for
bit, and with stochastic rounding the same random bits, so the same codes
too. torchao's low-bit optimizers compile their step the same way.

The kernels compile on first use, once a process for each kind of code
(inductor keeps them on disk, so later processes load them); a piece of
one block runs eagerly. Where
compiling fails (no C++ compiler, for one), a warning says so once and
the eager `torch_codes` operations run instead. `KDP_TORCH_COMPILE=0`
keeps the eager operations from the start; inside a step that torch
itself is compiling, they run too.

torch is imported inside functions, only once Keras runs on it.
"""

import os
import shutil
import types
import warnings

from keras_dtype_policy.low_precision import random_bits

# "0" in this environment variable keeps the eager operations.
SWITCH = "KDP_TORCH_COMPILE"

_compiled = {}
_failed = []


def enabled():
    """True while the compiled kernels are in use in this process."""
    return not _failed and os.environ.get(SWITCH, "1").strip() != "0"


def c_compiler():
    """The C++ compiler inductor builds CPU kernels with, or None."""
    if os.environ.get("CXX"):
        return shutil.which(os.environ["CXX"])
    names = ("g++", "clang++", "c++")
    return next((name for name in names if shutil.which(name)), None)


def dequantize(out, codes, scales, code):
    """Writes what `(codes, scales)` stand for into `out`, compiled.

    Args:
        out: A flat float32 torch tensor of `blocks * code.block` elements.
        codes: The int8 codes, shape `(blocks, code.bytes_per_block)`.
        scales: The float32 scales, shape `(blocks,)`.
        code: The `block_codes.Code`.

    Returns:
        True if done; False where the caller must run the eager
        operations instead.
    """
    kernel = _kernel(_dequantize, code, stochastic=False)
    if kernel is None or scales.shape[0] < 2:
        return False
    return _run(kernel, (out, codes, scales), code)


def quantize(values, codes, scales, code, noise=None):
    """Writes `values` as codes and scales, compiled; `values` is kept.

    Args:
        values: A flat float32 torch tensor of `blocks * code.block`
            elements (its padding zeros).
        codes: The int8 torch tensor to write, `(blocks, bytes)`.
        scales: The float32 torch tensor to write, `(blocks,)`.
        code: The `block_codes.Code`.
        noise: A `random_bits.TorchNoise` for stochastic rounding; None
            rounds to nearest.

    Returns:
        True if done. False where the caller must run the eager
        operations instead, and where the piece holds an infinity or a
        NaN (its scales then say so; codes and scales are to be written
        again by `block_codes`' own path).
    """
    kernel = _kernel(_quantize, code, stochastic=noise is not None)
    if kernel is None or scales.shape[0] < 2:
        return False
    key = None
    if noise is not None:
        # Two 16-bit draws of the step's stream make the call's key.
        key = noise.int32(2)
    done = _run(kernel, (values, codes, scales), code, key)
    return done and bool(_all_finite(scales))


def _whole(tensor):
    """`(storage, offset, size)`: the whole flat storage of a contiguous
    `tensor`, where it starts in it and its size.

    The kernels take whole storages and slice them themselves: views at
    varying offsets would make torch compile a kernel for each.
    """
    import torch

    storage = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    storage.set_(tensor.untyped_storage())
    return storage, tensor.storage_offset(), tensor.numel()


def _run(kernel, pieces, code, *rest):
    """Calls a compiled kernel on the `_whole` of each tensor of `pieces`;
    False (and eager from now on) if it cannot compile."""
    arguments = [part for tensor in pieces for part in _whole(tensor)]
    try:
        kernel(*arguments, *rest)
    except Exception as error:  # noqa: BLE001 - any compile failure
        _failed.append(error)
        warnings.warn(
            "keras_dtype_policy: torch.compile failed for the 8-bit and "
            "4-bit optimizer-state kernels, so they run as eager torch "
            f"operations, which is slower ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}). Set "
            f"{SWITCH}=0 to skip the attempt.",
            RuntimeWarning,
            stacklevel=4,
        )
        return False
    return True


def _kernel(body, code, stochastic):
    """The compiled `body` for `code`, or None where eager operations
    run.

    The code's bits, signedness and block are constants of the kernel;
    each kind of code gets its own copy of the function, so that torch's
    limit on recompilations of one function is never reached.
    """
    if not enabled():
        return None
    import torch

    if torch.compiler.is_compiling():
        return None
    key = (body.__name__, code.bits, code.signed, stochastic)
    if key not in _compiled:
        bits, signed, block = code.bits, code.signed, code.block

        def kernel(*arguments):
            return body(*arguments, bits=bits, signed=signed, block=block)

        name = "_".join(str(part) for part in key)
        copy = types.FunctionType(
            kernel.__code__.replace(co_name=name),
            kernel.__globals__,
            name,
            None,
            kernel.__closure__,
        )
        _compiled[key] = torch.compile(copy)
    return _compiled[key]


def _all_finite(scales):
    import torch

    return torch.isfinite(scales).all()


def _hashed_uniform(size, key, device):
    """Uniform float32 values in (0, 1), 16 bits each: the `lowbias32`
    hash of each element's index with the key (`random_bits.hashed_noise`,
    computed inside the kernel instead of read from memory).

    Args:
        size: How many values.
        key: An int32 torch tensor of two values in `[0, 2**16)`.
        device: The torch device.
    """
    import torch

    mixed = key[0] ^ (key[1] * 32768)
    hashed = torch.arange(size, dtype=torch.int32, device=device) ^ mixed
    hashed = hashed ^ ((hashed >> 16) & 0xFFFF)
    hashed = hashed * random_bits.MULTIPLY_1
    hashed = hashed ^ ((hashed >> 15) & 0x1FFFF)
    hashed = hashed * random_bits.MULTIPLY_2
    top = (hashed >> 16) & 0xFFFF
    return (top.to(torch.float32) + 0.5) * (1.0 / 65536.0)


def _levels(bits, signed):
    """`Code.levels` of a `bits`-bit code."""
    return 2 ** (bits - 1) - 1 if signed else 2**bits


def _dequantize(
    out,
    at,
    size,
    codes,
    codes_at,
    codes_size,
    scales,
    scales_at,
    blocks,
    *,
    bits,
    signed,
    block,
):
    """The body of the dequantize kernel (`torch_codes.dequantize`)."""
    import torch

    levels = _levels(bits, signed)
    codes = codes[codes_at : codes_at + codes_size]
    scales = scales[scales_at : scales_at + blocks]
    if bits == 4:
        # The byte is the code + 128; the even element in its low half.
        byte = codes.to(torch.int32) + 128
        pairs = torch.stack([byte & 15, byte >> 4], dim=-1)
        index = pairs.reshape(-1).to(torch.float32)
        if signed:
            index = index - float(levels)
    else:
        index = codes.to(torch.float32)
        if not signed:
            index = index + 128.0
    if signed:
        level = index * torch.abs(index)
    else:
        level = index + 1.0
        level = level * level
        level = level * level
    grid = float(levels ** (2 if signed else 4))
    step = (scales / grid)[:, None]
    result = (level.view(-1, block) * step).view(-1)
    out[at : at + size].copy_(result)


def _quantize(
    values,
    at,
    size,
    codes,
    codes_at,
    codes_size,
    scales,
    scales_at,
    blocks,
    key,
    *,
    bits,
    signed,
    block,
):
    """The body of the quantize kernel (`torch_codes.quantize`)."""
    import torch

    levels = _levels(bits, signed)
    # Blocks as rows throughout: each row's largest magnitude and its codes
    # come from one loop over the row, which stays in cache.
    values = values[at : at + size].view(-1, block)
    if signed:
        relative = torch.abs(values)
    else:
        relative = torch.clamp(values, min=0.0)
    largest = torch.amax(relative, 1, keepdim=True)
    if not signed:
        largest = largest + 0.0
    grid = float(levels ** (2 if signed else 4))
    inverse = grid / torch.where(largest > 0.0, largest, 1.0)
    position = relative * inverse
    index = torch.sqrt(position)
    if signed:
        index = torch.clamp(torch.floor(index), max=levels - 1.0)
        level = index * index
        gap = index + index
        gap = gap + 1.0
    else:
        index = torch.floor(torch.sqrt(index)) - 1.0
        index = torch.clamp(index, 0.0, levels - 2.0)
        level = _fourth_power(index + 1.0)
        gap = _fourth_power(index + 2.0) - level
    if key is None:
        threshold = gap * 0.5
    else:
        uniform = _hashed_uniform(size, key, values.device)
        threshold = gap * uniform.view(-1, block)
    index = index + ((position - level) >= threshold).to(torch.float32)
    if signed:
        index = torch.copysign(index, values)
    if bits == 4:
        if signed:
            index = index + float(levels)
        pairs = index.view(-1, block // 2, 2)
        packed = pairs[:, :, 1] * 16.0 + pairs[:, :, 0]
        coded = packed - 128.0
    elif signed:
        coded = index
    else:
        coded = index - 128.0
    written = codes[codes_at : codes_at + codes_size].view(
        -1, block * bits // 8
    )
    written.copy_(coded.to(torch.int8))
    scales[scales_at : scales_at + blocks].copy_(largest.view(-1))


def _fourth_power(base):
    squared = base * base
    return squared * squared
