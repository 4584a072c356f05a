"""The numerics of the torch low-precision step, each written once.

Every function here is plain torch operations on whole tensors, with no
in-place writes: `torch_kernels` runs it inside a kernel that
`torch.compile` fuses, or eagerly as it is, and both give the same bits.
torchao's low-bit optimizers work the same way: one `single_param_adam`
that runs compiled or eager
(https://github.com/pytorch/ao/blob/main/torchao/optim/adam.py).

Their `keras.ops` references, which the tests hold them to bit for bit:
`random_bits` (the hash), `block_codes` (the codes and scales) and
`compensated_updates` (stochastic rounding, the Kahan write).
"""

import typing

import torch

from keras_dtype_policy.low_precision import block_codes
from keras_dtype_policy.low_precision import random_bits

# The high 16 bits of a float32's bit pattern are its bfloat16 value.
_LOW_HALF = 0xFFFF
_HIGH_HALF = -65536
# float16 keeps 10 of float32's 23 mantissa bits: 13 dropped.
FLOAT16_DROPPED = 13
_FLOAT16_KEPT = -(2**FLOAT16_DROPPED)
# float16's smallest normal number, the step of its subnormal values and
# its largest number (`compensated_updates`' constants).
_FLOAT16_MIN_NORMAL = 2.0**-14
_FLOAT16_SUBNORMAL_STEP = 2.0**-24
_FLOAT16_MAX = 65504.0


def logical_right_shift(x, bits):
    """Shifts int32 `x` right by `bits`, filling with zeros."""
    return (x >> bits) & ((1 << (32 - bits)) - 1)


def mix_first_round(x):
    """The first xor-shift-multiply round of `lowbias32`."""
    x = x ^ logical_right_shift(x, 16)
    return x * random_bits.MULTIPLY_1


def mix(x):
    """`lowbias32` of int32 `x`, without its last xor-shift: Chris
    Wellons' hash (https://nullprogram.com/blog/2018/07/31/, multipliers
    from https://github.com/skeeto/hash-prospector); `random_bits.mix` is
    its `keras.ops` reference."""
    x = mix_first_round(x)
    x = x ^ logical_right_shift(x, 15)
    return x * random_bits.MULTIPLY_2


def remix(words):
    """Another half round of the hash over hashed `words`: fresh high
    bits from the same words (a third draw of 16 bits an element)."""
    words = words ^ logical_right_shift(words, 15)
    return words * random_bits.MULTIPLY_1


def hashed_words(size, key, device):
    """The hash of each element's index with the key: int32 words whose
    high and low 16 bits are well mixed.

    Args:
        size: How many words.
        key: An int32 torch tensor of two values in `[0, 2**16)` (two
            draws of a `torch_noise.TorchNoise`).
        device: The torch device.
    """
    mixed = key[0] ^ (key[1] * 32768)
    index = torch.arange(size, dtype=torch.int32, device=device)
    return mix(index ^ mixed)


def high_bits(words):
    """The high 16 bits of int32 `words`, as values in `[0, 2**16)`."""
    return logical_right_shift(words, 16)


def low_bits(words):
    """The low 16 bits of int32 `words`, as values in `[0, 2**16)`."""
    return words & _LOW_HALF


def uniform(bits):
    """Uniform float32 values in (0, 1) from 16 random bits an element:
    `(bits + 0.5) / 65536`, as `block_codes.quantize` draws them."""
    return (bits.to(torch.float32) + 0.5) * (1.0 / 65536.0)


def dequantized(codes, scales, code):
    """The float32 values `(codes, scales)` stand for, one row a block
    (`block_codes.dequantize`; Dettmers et al. 2022, "8-bit Optimizers
    via Block-wise Quantization", arXiv:2110.02861, section 2)."""
    codes = codes.reshape(-1)
    if code.bits == 4:
        # The byte is the code + 128; the even element in its low half.
        byte = codes.to(torch.int32) + 128
        pairs = torch.stack([byte & 15, byte >> 4], dim=-1)
        index = pairs.reshape(-1).to(torch.float32)
        if code.signed:
            index = index - float(code.levels)
    else:
        index = codes.to(torch.float32)
        if not code.signed:
            index = index + 128.0
    if code.signed:
        level = index * torch.abs(index)
    else:
        level = _fourth_power(index + 1.0)
    scales = scales[:, None]
    tiny = scales < block_codes.TINY_SCALE
    lifted = scales * torch.where(tiny, block_codes.LIFT, 1.0)
    unit = lifted / float(code.levels**code.power)
    level = level.view(-1, code.block) * unit
    return level * torch.where(tiny, block_codes.DROP, 1.0)


def quantized(rows, noise, code):
    """`(int8 codes, float32 scales)` of `rows`, one row a block
    (`block_codes.quantize`, the same float32 operations in order).

    Args:
        rows: Finite float32 values, shape `(blocks, code.block)`; a
            non-finite value makes its block's scale non-finite, which
            the caller checks.
        noise: Uniform float32 values in (0, 1) of `rows`' shape for
            stochastic rounding (Gupta et al. 2015, "Deep Learning with
            Limited Numerical Precision", arXiv:1502.02551, section 3);
            None rounds to the nearer level.
        code: The `block_codes.Code`.
    """
    if code.signed:
        relative = torch.abs(rows)
    else:
        relative = torch.clamp(rows, min=0.0)
    # + 0.0: a block of no positive value has the scale 0.0, not -0.0.
    largest = torch.amax(relative, 1, keepdim=True) + 0.0
    grid = float(code.levels**code.power)
    # A tiny block is coded `LIFT` times larger (`block_codes.TINY_SCALE`).
    lift = torch.where(largest < block_codes.TINY_SCALE, block_codes.LIFT, 1.0)
    lifted = largest * lift
    inverse = grid / torch.where(lifted > 0.0, lifted, 1.0)
    position = (relative * lift) * inverse
    # No `minimum(position, grid)`: finite values exceed the grid by a
    # rounding at most, and the index's clip gives the same code.
    index = torch.sqrt(position)
    if code.signed:
        index = torch.clamp(torch.floor(index), max=code.levels - 1.0)
        level = index * index
        gap = (index + index) + 1.0
    else:
        index = torch.floor(torch.sqrt(index)) - 1.0
        index = torch.clamp(index, 0.0, code.levels - 2.0)
        level = _fourth_power(index + 1.0)
        gap = _fourth_power(index + 2.0) - level
    threshold = gap * (0.5 if noise is None else noise)
    index = index + ((position - level) >= threshold).to(torch.float32)
    return _codes_of(index, rows, code), largest.view(-1)


def _codes_of(index, rows, code):
    """The int8 codes of the float level indices of `rows`."""
    if code.signed:
        index = torch.copysign(index, rows)
    if code.bits == 4:
        if code.signed:
            index = index + float(code.levels)
        pairs = index.view(-1, code.block // 2, 2)
        coded = pairs[:, :, 1] * 16.0 + pairs[:, :, 0] - 128.0
    elif code.signed:
        coded = index
    else:
        coded = index - 128.0
    return coded.to(torch.int8)


def _fourth_power(base):
    squared = base * base
    return squared * squared


def stochastic_bfloat16(pattern, bits):
    """float32 values rounded stochastically to bfloat16 values (still
    float32): 16 random bits added to the bit pattern, its low half then
    cleared (`compensated_updates.stochastic_round`; Gupta et al. 2015,
    arXiv:1502.02551). Infinities and NaN stay what they are.

    Args:
        pattern: The float32 values' bit patterns, as int32.
        bits: int32 values in `[0, 2**16)` of `pattern`'s shape.
    """
    return ((pattern + bits) & _HIGH_HALF).view(torch.float32)


def stochastic_float16(values, pattern, bits):
    """float32 values rounded stochastically to float16 values (still
    float32), `compensated_updates.stochastic_round`'s float16 arithmetic
    in the same float32 operations: 13 random bits added below float16's
    mantissa and cleared; below float16's normal range (2**-14) rounded
    on its 2**-24 grid with the same bits; beyond its largest number
    (65504) and where not finite, the values themselves, for the cast.

    Args:
        values: float32 values.
        pattern: Their bit patterns, as int32.
        bits: int32 values in `[0, 2**13)` of `values`' shape.

    Returns:
        float32 values; cast to float16 they are the stored values.
    """
    rounded = ((pattern + bits) & _FLOAT16_KEPT).view(torch.float32)
    uniform = bits.to(torch.float32) * (1.0 / float(2**FLOAT16_DROPPED))
    grid = torch.floor(values * (1.0 / _FLOAT16_SUBNORMAL_STEP) + uniform)
    grid = grid * _FLOAT16_SUBNORMAL_STEP
    magnitude = torch.abs(values)
    rounded = torch.where(magnitude < _FLOAT16_MIN_NORMAL, grid, rounded)
    keep = (magnitude > _FLOAT16_MAX) | ~torch.isfinite(values)
    return torch.where(keep, values, rounded)


def float16_bits(words):
    """13 random bits an element from hashed int32 `words` (their top
    bits), as values in `[0, 2**13)`."""
    return logical_right_shift(words, 32 - FLOAT16_DROPPED)


def nearest(values, dtype):
    """float32 `values` rounded to the nearest `dtype` value, as float32.

    bfloat16 rounds in integers (half a unit less one plus the kept bit:
    ties to even), since inductor may drop a float32 -> bfloat16 ->
    float32 round trip; float16 goes through the cast.
    """
    if dtype != torch.bfloat16:
        return values.to(dtype).to(torch.float32)
    pattern = values.view(torch.int32)
    pattern = pattern + (0x7FFF + (logical_right_shift(pattern, 16) & 1))
    return (pattern & _HIGH_HALF).view(torch.float32)


def kahan_split(values, dtype):
    """`(rounded, compensation)`: float32 `values` rounded to nearest in
    `dtype` and what the rounding took off, both float32 (Kahan-
    compensated low-precision weights: Zamirai et al. 2020,
    arXiv:2010.06192; optimi,
    https://optimi.benjaminwarner.dev/kahan_summation/;
    `compensated_updates.kahan_write` is the `keras.ops` reference)."""
    rounded = nearest(values, dtype)
    return rounded, values - rounded


def decayed(weights, rate):
    """Keras' decoupled weight decay: `w - w * rate` (`rate` is the
    learning rate times the decay, 0 where a weight takes none)."""
    return weights - weights * rate


class AdamHyperparameters(typing.NamedTuple):
    """The float32 constants of one Adam step (Kingma & Ba 2015,
    arXiv:1412.6980, algorithm 1, with Keras' epsilon outside the
    bias correction: `alpha` folds both corrections into the rate)."""

    beta_1: float
    one_minus_beta_1: float
    beta_2: float
    one_minus_beta_2: float
    alpha: float
    epsilon: float
    decay: float

    @classmethod
    def of(cls, inner, learning_rate):
        """The constants of `inner`'s (a Keras Adam's) next step."""
        step = float(inner.iterations.numpy()) + 1.0
        rate = float(learning_rate)
        beta_1, beta_2 = float(inner.beta_1), float(inner.beta_2)
        correction = (1.0 - beta_2**step) ** 0.5 / (1.0 - beta_1**step)
        return cls(
            beta_1=beta_1,
            one_minus_beta_1=1.0 - beta_1,
            beta_2=beta_2,
            one_minus_beta_2=1.0 - beta_2,
            alpha=rate * correction,
            epsilon=float(inner.epsilon),
            decay=float(inner.weight_decay or 0.0) * rate,
        )

    def as_tensor(self, device=None):
        """The constants as one float32 tensor, a kernel's argument."""
        return torch.tensor(self, dtype=torch.float32, device=device)

    @classmethod
    def of_tensor(cls, tensor):
        """The record back from `as_tensor`'s tensor (inside a kernel)."""
        return cls(*tensor.unbind())


def adam_update(weights, grads, m, v, hyper):
    """Adam's update as Keras' torch Adam computes it, in float32:
    `m = beta_1 m + (1 - beta_1) g`, `v = beta_2 v + (1 - beta_2) g**2`,
    `w -= alpha m / (sqrt(v) + epsilon)`.

    Returns:
        The new `(weights, m, v)`.
    """
    m = m * hyper.beta_1 + grads * hyper.one_minus_beta_1
    v = v * hyper.beta_2 + (grads * grads) * hyper.one_minus_beta_2
    weights = weights - (m * hyper.alpha) / (_sqrt(v) + hyper.epsilon)
    return weights, m, v


def _sqrt(x):
    """The correctly rounded square root of float32 `x`.

    Inductor's compiled square root is correctly rounded; torch 2.13's
    eager `torch.sqrt` of float32 on a CPU is an ulp off on about 0.7% of
    values (measured against float64). Eagerly the root is taken in
    float64 and rounded once, which is exact in float32, so compiled and
    eager give the same bits; the compiled kernel keeps float32 (the
    float64 round trip made the 8-bit step about 15% slower).
    """
    if torch.compiler.is_compiling():
        return torch.sqrt(x)
    return torch.sqrt(x.to(torch.float64)).to(torch.float32)
