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
sign (NaN as zero), so one bad element never spreads over its block.

All of it is `keras.ops`, so it runs eagerly and under `jit` on every
backend. Codes are int8: signed codes as they are, unsigned ones shifted
by -128, 4-bit codes two to a byte.
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


def code_for(bits, signed):
    """Returns the `Code` of `bits`-bit state, signed or not."""
    return Code(bits=bits, signed=signed, block=BLOCKS[bits])


def block_count(size, code):
    """How many blocks `size` elements take."""
    return -(-int(size) // code.block)


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
    finite = ops.isfinite(values)
    magnitude = ops.where(finite, ops.abs(values), 0.0)
    if not code.signed:
        magnitude = ops.where(ops.greater(values, 0.0), magnitude, 0.0)
    scales = ops.max(magnitude, axis=1)
    safe = ops.where(ops.greater(scales, 0.0), scales, 1.0)
    # Infinities go to the top level, NaN to zero (its magnitude is 0).
    relative = ops.where(
        ops.logical_and(ops.logical_not(finite), ops.greater(values, 0.0)),
        1.0,
        ops.divide(magnitude, safe[:, None]),
    )
    if code.signed:
        relative = ops.where(
            ops.logical_and(ops.logical_not(finite), ops.less(values, 0.0)),
            1.0,
            relative,
        )
    relative = ops.minimum(relative, 1.0)
    index = _level_below(relative, code)
    low = _level(index, code)
    high = _level(ops.add(index, 1.0), code)
    fraction = ops.divide(
        ops.subtract(relative, low), ops.maximum(ops.subtract(high, low), 1e-30)
    )
    fraction = ops.clip(fraction, 0.0, 1.0)
    if seed is None:
        threshold = 0.5
    else:
        noise = random_bits.rounding_noise(ops.shape(values), 16, seed)
        threshold = ops.multiply(
            ops.add(ops.cast(noise, "float32"), 0.5), 1.0 / 65536.0
        )
    up = ops.cast(ops.greater_equal(fraction, threshold), "float32")
    index = ops.add(index, up)
    if code.signed:
        negative = ops.less(values, 0.0)
        index = ops.where(negative, ops.negative(index), index)
        stored = index
    else:
        stored = ops.subtract(index, 128.0 if code.bits == 8 else 0.0)
    codes = ops.cast(stored, "int32")
    if code.bits == 4:
        codes = _pack(codes, code)
    return ops.cast(codes, "int8"), scales


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
        level = ops.multiply(ops.sign(index), _level(ops.abs(index), code))
    else:
        level = _level(index, code)
    level = ops.multiply(level, ops.cast(scales, "float32")[:, None])
    return ops.reshape(level, (-1,))


def _level(index, code):
    """The level of (non-negative, float) `index`, relative to the scale."""
    if code.signed:
        x = ops.multiply(index, 1.0 / code.levels)
        return ops.multiply(x, x)
    x = ops.multiply(ops.add(index, 1.0), 1.0 / code.levels)
    x = ops.multiply(x, x)
    return ops.multiply(x, x)


def _level_below(relative, code):
    """The highest index whose level is at most `relative` (clipped so
    that the index above it exists)."""
    if code.signed:
        index = ops.floor(ops.multiply(ops.sqrt(relative), code.levels))
        return ops.clip(index, 0.0, code.levels - 1.0)
    root = ops.sqrt(ops.sqrt(relative))
    index = ops.subtract(ops.floor(ops.multiply(root, code.levels)), 1.0)
    return ops.clip(index, 0.0, code.levels - 2.0)


def _pack(index, code):
    """Two 4-bit codes a byte: the even element low, the odd one high."""
    if code.signed:
        index = ops.add(index, code.levels)
    pairs = ops.reshape(index, (ops.shape(index)[0], -1, 2))
    return ops.subtract(
        ops.add(pairs[:, :, 0], ops.multiply(pairs[:, :, 1], 16)), 128
    )


def _unpack(packed, code):
    byte = ops.add(packed, 128)
    low = ops.mod(byte, 16)
    high = ops.floor_divide(byte, 16)
    index = ops.reshape(
        ops.stack([low, high], axis=-1), (ops.shape(byte)[0], -1)
    )
    if code.signed:
        index = ops.subtract(index, code.levels)
    return index
