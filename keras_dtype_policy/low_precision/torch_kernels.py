"""Compiled torch kernels of the low-precision step: one pass each.

On torch every operation is a pass over memory. Where `torch.compile`
works (inductor with a C++ compiler on a CPU, Triton on a GPU), this
module runs the step's elementwise ends as one fused kernel each, with
the float32 arithmetic of the eager operations in the same order:

- `dequantize` and `quantize`: the block codes of 8-bit and 4-bit state
  (`torch_codes`' eager operations): the same codes and scales bit for
  bit when rounding to nearest;
- `round_to_bfloat16`: stochastic rounding of float32 values into
  bfloat16 storage (`torch_step.store_rounded`).

Stochastic rounding hashes each element's index with a key drawn from
the step's stream (`lowbias32`, as `random_bits.hashed_noise` does)
inside the kernel instead of reading random bits from memory: given the
same bits, the kernels give what the eager operations give, bit for bit.
torchao's low-bit optimizers compile their step the same way.

The kernels compile on first use, once a process for each kind (inductor
keeps them on disk, so later processes load them); a piece of one block
runs eagerly. Where compiling fails (no C++ compiler, for one), a warning
says so once and the eager operations run instead. `KDP_TORCH_COMPILE=0`
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

    The arguments are `torch_codes.dequantize`'s, without its scratch
    space.

    Returns:
        True if done; False where the caller must run the eager
        operations instead.
    """
    kernel = compiled(_dequantize, None, **constants(code))
    if kernel is None or scales.shape[0] < 2:
        return False
    return run(kernel, (out, codes, scales))


def quantize(values, codes, scales, code, noise=None):
    """Writes `values` as codes and scales, compiled; `values` is kept.

    The arguments are `torch_codes.quantize`'s, without its scratch space.

    Returns:
        True if done. False where the caller must run the eager
        operations instead, and where the piece holds an infinity or a
        NaN (its scales then say so; codes and scales are to be written
        again by `block_codes`' own path).
    """
    stochastic = noise is not None
    kernel = compiled(_quantize, stochastic, **constants(code))
    if kernel is None or scales.shape[0] < 2:
        return False
    key = None
    if noise is not None:
        # Two 16-bit draws of the step's stream make the call's key.
        key = noise.int32(2)
    done = run(kernel, (values, codes, scales), key)
    import torch

    return done and bool(torch.isfinite(scales).all())


def round_to_bfloat16(stored, working, noise):
    """Stores float32 `working` into bfloat16 `stored`, rounded
    stochastically, compiled (`torch_step.store_rounded`'s arithmetic).

    Args:
        stored: The contiguous bfloat16 torch tensor to write.
        working: The contiguous float32 values, as many.
        noise: A `random_bits.TorchNoise`.

    Returns:
        True if done; False where the caller must run the eager
        operations instead.
    """
    import torch

    kernel = compiled(_round_to_bfloat16, True)
    if kernel is None:
        return False
    # The bit pattern as integers: no bit cast of the input in the kernel.
    pieces = (stored, working.view(torch.int32))
    return run(kernel, pieces, noise.int32(2))


def constants(code):
    """The code's settings, constants of its kernels."""
    return {
        "bits": code.bits,
        "signed": code.signed,
        "block": code.block,
        "levels": code.levels,
        "power": code.power,
    }


def run(kernel, pieces, *rest):
    """Calls a compiled kernel on the tensors `pieces` (views written in
    place as a whole, never sliced inside a kernel) and `rest`; False (and
    eager from now on) if it cannot compile."""
    try:
        kernel(*pieces, *rest)
    except Exception as error:  # noqa: BLE001 - any compile failure
        _failed.append(error)
        warnings.warn(
            "keras_dtype_policy: torch.compile failed for the kernels of "
            "the low-precision step (8-bit and 4-bit state, stochastic "
            "rounding), so they run as eager torch operations, which is "
            f"slower ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}). Set "
            f"{SWITCH}=0 to skip the attempt.",
            RuntimeWarning,
            stacklevel=4,
        )
        return False
    return True


def compiled(body, variant, **constants):
    """The compiled `body`, or None where eager operations run
    (`KDP_TORCH_COMPILE=0`, a failed compile, inside a step torch itself
    compiles).

    `variant` tells kernels of one body apart; `constants` (a code's
    bits, signedness and block, for one) are constants of the kernel.
    Each kind of kernel gets its own copy of the function, so that
    torch's limit on recompilations of one function is never reached.
    """
    if not enabled():
        return None
    import torch

    if torch.compiler.is_compiling():
        return None
    key = (body.__name__, variant, *sorted(constants.items()))
    if key not in _compiled:

        def kernel(*arguments):
            return body(*arguments, **constants)

        name = "_".join(str(part) for part in key)
        name = "".join(c if c.isalnum() else "_" for c in name)
        copy = types.FunctionType(
            kernel.__code__.replace(co_name=name),
            kernel.__globals__,
            name,
            None,
            kernel.__closure__,
        )
        _compiled[key] = torch.compile(copy)
    return _compiled[key]


def hashed_words(size, key, device):
    """The `lowbias32` hash of each element's index with the key
    (`random_bits.mix`, computed inside a kernel instead of read from
    memory): int32 values whose high 16 bits are well mixed.

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
    return hashed * random_bits.MULTIPLY_2


def _hashed_bits(size, key, device):
    """16 random bits an element, as int32 values in `[0, 2**16)`: the
    high half of `hashed_words` (`random_bits.hashed_noise`)."""
    return (hashed_words(size, key, device) >> 16) & 0xFFFF


def _hashed_uniform(size, key, device):
    """Uniform float32 values in (0, 1) from `_hashed_bits`."""
    import torch

    bits = _hashed_bits(size, key, device)
    return (bits.to(torch.float32) + 0.5) * (1.0 / 65536.0)


def _dequantize(out, codes, scales, **constants):
    """The body of the dequantize kernel (`torch_codes.dequantize`)."""
    out.copy_(dequantized(codes, scales, **constants).view(-1))


def dequantized(codes, scales, *, bits, signed, block, levels, power):
    """The float32 values `(codes, scales)` stand for, one row a block;
    torch operations for a kernel's body (`torch_codes.dequantize`)."""
    import torch

    codes = codes.reshape(-1)
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
    grid = float(levels**power)
    step = (scales / grid)[:, None]
    return level.view(-1, block) * step


def _quantize(values, codes, scales, key, **constants):
    """The body of the quantize kernel (`torch_codes.quantize`)."""
    size = values.shape[0]
    rows = values.view(-1, constants["block"])
    uniform = None
    if key is not None:
        uniform = _hashed_uniform(size, key, values.device).view(rows.shape)
    coded, largest = quantized(rows, uniform, **constants)
    codes.copy_(coded.view(codes.shape))
    scales.copy_(largest)


def quantized(values, uniform, *, bits, signed, block, levels, power):
    """`(int8 codes, scales)` of `values`, one row a block, rounded to
    nearest (`uniform` None) or stochastically with `uniform` values in
    (0, 1) of `values`' shape; torch operations for a kernel's body
    (`torch_codes.quantize`)."""
    import torch

    # Blocks as rows throughout: each row's largest magnitude and its codes
    # come from one loop over the row, which stays in cache.
    if signed:
        relative = torch.abs(values)
    else:
        relative = torch.clamp(values, min=0.0)
    largest = torch.amax(relative, 1, keepdim=True)
    if not signed:
        largest = largest + 0.0
    grid = float(levels**power)
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
    if uniform is None:
        threshold = gap * 0.5
    else:
        threshold = gap * uniform
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
    return coded.to(torch.int8), largest.view(-1)


def _round_to_bfloat16(stored, working, key):
    """The body of the bfloat16 rounding kernel: 16 random bits added to
    the float32 bit pattern (int32 `working`), the low half of the sum
    cleared: a bfloat16 value, stored exactly."""
    import torch

    summed = working + _hashed_bits(working.shape[0], key, working.device)
    # The low half cleared, the float32 is a bfloat16 value: exact.
    rounded = (summed & -65536).view(torch.float32)
    stored.copy_(rounded.to(torch.bfloat16))


def _fourth_power(base):
    squared = base * base
    return squared * squared
