"""Kernels of the torch low-precision step: compiled, or eager.

On torch every operation is a pass over memory. Where `torch.compile`
works (inductor with a C++ compiler on a CPU, Triton on a GPU), this
module runs each end of the step as one fused kernel, whose body is
`torch_numerics`' functions; elsewhere the same body runs eagerly, as
torchao's low-bit optimizers run their step
(https://github.com/pytorch/ao/blob/main/torchao/optim/adam.py). Both
give the same bits:

- `dequantize` and `quantize`: the block codes of 8-bit and 4-bit state,
  `block_codes`' codes and scales bit for bit when rounding to nearest;
- `round_to_bfloat16` and `round_to_float16`: stochastic rounding of
  float32 values into bfloat16 and float16 storage.

Stochastic rounding hashes each element's index with a key drawn from
the step's stream (`torch_noise.TorchNoise.kernel_key`) inside the kernel
instead of reading random bits from memory.

The kernels compile on first use, once a process for each kind (inductor
keeps them on disk, so later processes load them); a piece of one block
runs eagerly. Where compiling fails (no C++ compiler, for one), a warning
says so once and the bodies run eagerly instead. `KDP_TORCH_COMPILE=0`
keeps them eager from the start; inside a step that torch itself is
compiling, they run eagerly too (in torch's own graph).
"""

import os
import shutil
import types
import warnings

import torch

from keras_dtype_policy.low_precision import block_codes
from keras_dtype_policy.low_precision import torch_numerics

# "0" in this environment variable keeps the kernels eager.
SWITCH = "KDP_TORCH_COMPILE"

_compiled: dict = {}
_failed: list = []


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
    """Writes the float32 values `(codes, scales)` stand for into `out`.

    Args:
        out: A flat float32 torch tensor of `blocks * code.block` elements.
        codes: The int8 codes, shape `(blocks, code.bytes_per_block)`.
        scales: The float32 scales, shape `(blocks,)`.
        code: The `block_codes.Code`.
    """
    tensors = (out, codes, scales)
    run(_dequantize, tensors, eager=scales.shape[0] < 2, code=code)


def quantize(values, codes, scales, code, key=None):
    """Writes flat float32 `values` as codes and scales.

    A piece holding an infinity or a NaN is written again by
    `block_codes.quantize`, which keeps them out of the block scales.

    Args:
        values: A flat float32 torch tensor of `blocks * code.block`
            elements (its padding zeros); kept.
        codes: The int8 torch tensor to write, `(blocks, bytes)`.
        scales: The float32 torch tensor to write, `(blocks,)`.
        code: The `block_codes.Code`.
        key: A kernel key (`torch_noise.TorchNoise.kernel_key`) for
            stochastic rounding; None rounds to nearest.
    """
    stochastic = key is not None
    run(
        _quantize,
        (values, codes, scales),
        key,
        eager=scales.shape[0] < 2,
        code=code,
        stochastic=stochastic,
    )
    if not bool(torch.isfinite(scales).all()):
        seed = None
        if stochastic:
            seed = int(key[0]) | (int(key[1]) << 15)
        new_codes, new_scales = block_codes.quantize(values, code, seed)
        codes.copy_(new_codes)
        scales.copy_(new_scales)


def round_to_bfloat16(stored, working, key):
    """Stores float32 `working` into bfloat16 `stored`, rounded
    stochastically (`torch_numerics.stochastic_bfloat16`).

    Args:
        stored: The bfloat16 torch tensor to write.
        working: The float32 values, a torch tensor of as many elements.
        key: A kernel key (`torch_noise.TorchNoise.kernel_key`).
    """
    # The bit pattern as integers: no bit cast of an input in the kernel.
    run(_round_to_bfloat16, (stored, working.view(torch.int32)), key)


def round_to_float16(stored, working, key):
    """Stores float32 `working` into float16 `stored`, rounded
    stochastically (`torch_numerics.stochastic_float16`, 13 random bits
    an element hashed from `key`).

    Args:
        stored: The float16 torch tensor to write.
        working: The float32 values, a torch tensor of as many elements.
        key: A kernel key (`torch_noise.TorchNoise.kernel_key`).
    """
    # The bit pattern as integers: no bit cast of an input in the kernel
    # (and no second view of `working`, which shares `stored`'s storage
    # in the torch step: aot_autograd refuses aliased inputs beside a
    # written one).
    run(_round_to_float16, (stored, working.view(torch.int32)), key)


def run(body, tensors, *rest, eager=False, **constants):
    """Calls `body(*tensors, *rest, **constants)` as a compiled kernel
    where one compiles (`eager` False), else as it is.

    `tensors` are views written in place as a whole, never sliced inside
    a kernel; `constants` (a code, for one) are constants of the kernel.
    A failed compile warns once; the bodies run eagerly from then on.
    """
    kernel = None if eager else compiled(body, **constants)
    if kernel is not None:
        try:
            kernel(*tensors, *rest)
            return
        except Exception as error:  # noqa: BLE001 - any compile failure
            _failed.append(error)
            _warn(error)
    body(*tensors, *rest, **constants)


def _warn(error):
    first_line = str(error).splitlines()[0] if str(error) else ""
    warnings.warn(
        "keras_dtype_policy: torch.compile failed for the kernels of "
        "the low-precision step (8-bit and 4-bit state, stochastic "
        "rounding), so they run as eager torch operations, which is "
        f"slower ({type(error).__name__}: {first_line}). Set "
        f"{SWITCH}=0 to skip the attempt.",
        RuntimeWarning,
        stacklevel=5,
    )


def compiled(body, **constants):
    """The compiled `body`, or None where it runs eagerly
    (`KDP_TORCH_COMPILE=0`, a failed compile, inside a step torch itself
    compiles).

    Each kind of kernel (a body and its constants) gets its own copy of
    the function, so that torch's limit on recompilations of one
    function is never reached.
    """
    if not enabled() or torch.compiler.is_compiling():
        return None
    key = (body.__name__, *sorted(constants.items()))
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


def _dequantize(out, codes, scales, *, code):
    out.copy_(torch_numerics.dequantized(codes, scales, code).view(-1))


def _quantize(values, codes, scales, key, *, code, stochastic):
    rows = values.view(-1, code.block)
    noise = None
    if stochastic:
        words = torch_numerics.hashed_words(values.shape[0], key, values.device)
        noise = torch_numerics.uniform(torch_numerics.high_bits(words))
        noise = noise.view(rows.shape)
    coded, largest = torch_numerics.quantized(rows, noise, code)
    codes.copy_(coded.view(codes.shape))
    scales.copy_(largest)


def _round_to_bfloat16(stored, pattern, key):
    pattern = pattern.reshape(-1)
    words = torch_numerics.hashed_words(pattern.shape[0], key, pattern.device)
    bits = torch_numerics.high_bits(words)
    rounded = torch_numerics.stochastic_bfloat16(pattern, bits)
    # The low half cleared, the float32 is a bfloat16 value: exact.
    stored.copy_(rounded.view(stored.shape).to(torch.bfloat16))


def _round_to_float16(stored, pattern, key):
    pattern = pattern.reshape(-1)
    # The values from their bits: a bit cast of a computed tensor (as in
    # `torch_numerics.stochastic_bfloat16`), not of the input.
    values = (pattern | 0).view(torch.float32)
    words = torch_numerics.hashed_words(pattern.shape[0], key, pattern.device)
    bits = torch_numerics.float16_bits(words)
    rounded = torch_numerics.stochastic_float16(values, pattern, bits)
    stored.copy_(rounded.view(stored.shape).to(torch.float16))
