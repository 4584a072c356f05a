"""Block-wise 8-bit and 4-bit codes for optimizer state.

A slot of the optimizer state is stored as small integer codes and one
float32 scale a block of `Code.block` consecutive elements (the block's
largest magnitude, so every block uses its whole range: one outlier only
coarsens its own block). A code stands for a level of a power map, fine
near zero and coarse near the scale:

- signed (first moments, momenta): `level(k) = scale * sign(k) *
  (|k| / n) ** 2` for `k` in `[-n, n]`, with `n = 127` (8 bits) or `7`
  (4 bits); zero is a level;
- unsigned (second moments, accumulators, every value >= 0):
  `level(k) = scale * ((k + 1) / n) ** 4` for `k` in `[0, n)`, `n = 256`
  or `16`. No level is zero: a positive value never comes back as zero,
  so `m / (sqrt(v) + epsilon)` cannot blow up on a zero code; the
  lowest level is `scale / n**4` and a smaller value rounds up to it. The
  fourth power makes `sqrt(v)` a square map, as fine as the first moment's.

A value between two levels goes to the one below or above it, to the
nearer one (`stochastic=False`) or at random, with the probability that
makes the stored level equal to the value on average (stochastic
rounding, in the value's units, not the code's). Infinities and NaN take
no part in a block's scale: they are stored as the largest level of their
sign (NaN as zero), so one bad element never spreads over its block. A
block of a tiny scale (below `TINY_SCALE`) is coded as if its values were
`LIFT` times larger, which is exact, so float32 never overflows on it.

All of it is `keras.ops`, so it runs eagerly and under `jit` on every
backend. Codes are int8: signed codes as they are, unsigned ones shifted
by -128, 4-bit codes two to a byte.

Sources: block-wise quantization of optimizer state, one absolute-max
scale a block so that an outlier stays in its block (Dettmers et al.
2022, "8-bit Optimizers via Block-wise Quantization", arXiv:2110.02861,
section 2); 4-bit state with smaller blocks, and a second moment whose
code has no zero level (Li et al. 2023, "Memory Efficient Optimizers with
4-bit States", arXiv:2309.01507, sections 3 and 4); unbiased stochastic
rounding (Gupta et al. 2015, "Deep Learning with Limited Numerical
Precision", arXiv:1502.02551, section 3). The power maps are this
package's own (bitsandbytes and torchao use a dynamic tree code).
"""

import dataclasses

from keras import ops

from keras_dtype_policy.low_precision import random_bits


@dataclasses.dataclass(frozen=True)
class Code:
    """How one kind of slot is coded.

    Args:
        bits: 8 or 4.
        signed: True for a slot that may be negative.
        block: How many consecutive elements share one scale.
    """

    bits: int
    signed: bool
    block: int

    @property
    def levels(self):
        """`n` of the power map (see the module docstring)."""
        if self.signed:
            return 2 ** (self.bits - 1) - 1
        return 2**self.bits

    @property
    def power(self):
        """The power of the map: 2 signed, 4 unsigned."""
        return 2 if self.signed else 4

    @property
    def bytes_per_block(self):
        """Bytes of codes a block takes."""
        return self.block * self.bits // 8


BLOCKS = {8: 256, 4: 128}

# A small integer-valued float32 `k` plus 1.5 * 2**23 has the bits
# `_MAGIC_BITS + k`: an exact conversion to int32 without the saturating
# float-to-integer cast, which XLA compiles into a slower loop on a CPU.
_MAGIC = 12582912.0
_MAGIC_BITS = 0x4B400000

# A block whose scale is below `TINY_SCALE` is coded at `LIFT` times its
# values (exact: a power of two), then its levels are brought back by
# `DROP`: `grid / scale` overflows float32 for a scale below `grid` /
# 3.4e38 (about 1.3e-29 for the 8-bit unsigned code), and `scale / grid`
# loses bits as a subnormal below `grid` * 1.2e-38.
TINY_SCALE = 2.0**-64
LIFT = 2.0**64
DROP = 2.0**-64


def code_for(bits, signed):
    """Returns the `Code` of `bits`-bit state, signed or not."""
    return Code(bits=bits, signed=signed, block=BLOCKS[bits])


def block_count(size, code):
    """How many blocks `size` elements take."""
    return -(-int(size) // code.block)


def element_count(shape):
    """How many elements a tensor of `shape` has (1 for a scalar)."""
    count = 1
    for dimension in shape:
        count *= int(dimension)
    return count


def uniform_of_bits(noise):
    """The uniform number in (0, 1) that 16 random bits stand for.

    `(noise + 0.5) / 2**16`: the midpoint of the bits' interval, so the
    threshold of a stochastic rounding is never exactly 0 or 1.

    Args:
        noise: A tensor of integers in `[0, 2**16)`.

    Returns:
        A float32 tensor of the same shape.
    """
    return ops.multiply(ops.add(ops.cast(noise, "float32"), 0.5), 1.0 / 65536.0)


def quantize(values, code, seed=None):
    """Returns `(codes, scales)` storing float `values` block by block.

    Args:
        values: A float tensor of `blocks * code.block` elements, any
            shape (its elements taken in order).
        code: The `Code`.
        seed: A `keras.random.SeedGenerator` (advanced by one), or an int,
            for stochastic rounding; None rounds to the nearer level.

    Returns:
        int8 codes of shape `(blocks, code.bytes_per_block)` and float32
        scales of shape `(blocks,)`.
    """
    values = ops.reshape(ops.cast(values, "float32"), (-1, code.block))
    if code.signed:
        magnitude = ops.abs(values)
    else:
        magnitude = ops.maximum(values, 0.0)
    # Infinities and NaN take no part in the scale.
    finite = ops.where(ops.isfinite(values), magnitude, 0.0)
    scales = ops.max(finite, axis=1)
    # The position on the `n**power` grid: the level of index `k` is at
    # `k**power` (signed) or `(k + 1)**power` (unsigned). An infinity lands
    # on the top level (the minimum), NaN on zero.
    grid = float(code.levels**code.power)
    lift = ops.where(ops.less(scales, TINY_SCALE), LIFT, 1.0)[:, None]
    lifted = ops.multiply(scales[:, None], lift)
    inverse = ops.divide(grid, ops.where(ops.greater(lifted, 0.0), lifted, 1.0))
    # No `minimum(position, grid)`: finite values exceed the grid by a
    # rounding at most, an infinity gets the top index either way.
    position = ops.multiply(ops.multiply(magnitude, lift), inverse)
    position = ops.where(ops.isnan(position), 0.0, position)
    index = _level_below(position, code)
    low = _grid_level(index, code)
    if code.signed:
        # (k + 1)**2 - k**2, exact in float32 for these small integers.
        gap = ops.add(ops.add(index, index), 1.0)
    else:
        gap = ops.subtract(_grid_level(ops.add(index, 1.0), code), low)
    # Up with the probability that keeps the stored level unbiased:
    # (position - low) / gap, compared without a division.
    if seed is None:
        threshold = ops.multiply(gap, 0.5)
    else:
        noise = random_bits.rounding_noise(ops.shape(values), 16, seed)
        threshold = ops.multiply(gap, uniform_of_bits(noise))
    up = ops.greater_equal(ops.subtract(position, low), threshold)
    index = ops.add(index, ops.cast(up, "float32"))
    if code.signed:
        stored = ops.where(ops.less(values, 0.0), ops.negative(index), index)
    else:
        stored = ops.subtract(index, 128.0 if code.bits == 8 else 0.0)
    if code.bits == 4:
        packed = _pack(ops.subtract(_float_bits(stored), _MAGIC_BITS), code)
        return ops.cast(packed, "int8"), scales
    # The low byte of the bits is the code.
    return ops.cast(_float_bits(stored), "int8"), scales


def dequantize(codes, scales, code):
    """Returns the float32 values `(codes, scales)` stand for, flat.

    Args:
        codes: int8 codes of shape `(blocks, code.bytes_per_block)`.
        scales: float32 scales of shape `(blocks,)`.
        code: The `Code`.

    Returns:
        A float32 tensor of `blocks * code.block` elements.
    """
    index = ops.cast(codes, "int32")
    if code.bits == 4:
        index = _unpack(index, code)
    elif not code.signed:
        index = ops.add(index, 128)
    index = ops.cast(index, "float32")
    if code.signed:
        level = ops.multiply(index, ops.abs(index))
    else:
        level = _grid_level(index, code)
    scales = ops.cast(scales, "float32")[:, None]
    tiny = ops.less(scales, TINY_SCALE)
    lifted = ops.multiply(scales, ops.where(tiny, LIFT, 1.0))
    unit = ops.divide(lifted, float(code.levels**code.power))
    level = ops.multiply(ops.multiply(level, unit), ops.where(tiny, DROP, 1.0))
    return ops.reshape(level, (-1,))


def _level_below(position, code):
    """The highest index whose grid level is at most `position` (clipped
    so that the index above it exists)."""
    if code.signed:
        index = ops.floor(ops.sqrt(position))
        return ops.minimum(index, code.levels - 1.0)
    index = ops.subtract(ops.floor(ops.sqrt(ops.sqrt(position))), 1.0)
    return ops.clip(index, 0.0, code.levels - 2.0)


def _grid_level(index, code):
    """The level of (non-negative, float) `index` on the `n**power`
    grid: `index**2` signed, `(index + 1)**4` unsigned."""
    if code.signed:
        return ops.multiply(index, index)
    x = ops.add(index, 1.0)
    x = ops.multiply(x, x)
    return ops.multiply(x, x)


def _float_bits(index):
    """The bits of integer-valued float32 `index` (|index| < 2**22) plus
    `_MAGIC`, as int32."""
    return ops.view(ops.add(index, _MAGIC), "int32")


def _pack(index, code):
    """Two 4-bit codes a byte: the even element low, the odd one high.

    The codes as int8, viewed two at a time as int16: on a little-endian
    machine (x86, Arm, every GPU) its low byte is the even element's. A
    pairing by strided slices (`pairs[:, :, 0]`) gives the same bytes,
    but XLA's CPU compiler makes a slow loop of it inside a `fori_loop`
    (the 4-bit quantization of a chunked update ran at 1.8 times its
    whole-variable time; with the view, as fast as 8-bit codes).
    """
    if code.signed:
        index = ops.add(index, code.levels)
    pairs = ops.cast(ops.view(ops.cast(index, "int8"), "int16"), "int32")
    high = ops.right_shift(pairs, 8)
    low = ops.subtract(pairs, ops.multiply(high, 256))
    return ops.subtract(ops.add(low, ops.multiply(high, 16)), 128)


def _unpack(packed, code):
    """Two 4-bit codes of each byte, the low one first (`_pack`'s order).

    Each byte's two nibbles go to the low and high byte of an int16,
    viewed as two int8 (little-endian: the low byte first). An
    elementwise computation and a view, which XLA fuses into what reads
    the codes, inside a `fori_loop` too (a shift broadcast against
    `(0, 4)` and a reshape ran a chunked 4-bit update at twice its
    whole-variable time; a stack would be a materialized concatenation).
    """
    byte = ops.add(ops.cast(packed, "int32"), 128)
    low = ops.bitwise_and(byte, 15)
    high = ops.right_shift(byte, 4)
    pairs = ops.cast(ops.add(low, ops.multiply(high, 256)), "int16")
    index = ops.cast(ops.view(pairs, "int8"), "int32")
    if code.signed:
        index = ops.subtract(index, code.levels)
    return index
