"""block_codes against a brute-force oracle: the nearest of all levels.

For every code (8 and 4 bits, signed and unsigned), `quantize` with no
seed and then `dequantize` must give each finite element a level of its
block at the minimum distance among ALL the block's levels, computed here
in float64 from the level formula of `block_codes`' module docstring (an
argmin over every level, as torchao's test/test_low_bit_optim.py checks
its quantizer), not from the code's own arithmetic. Ties may go either
way. The code computes its levels in float32: the comparison allows 8
float32 ulps of the block's scale (`TOLERANCE_ULPS`).

Every expectation holds on tensorflow, jax and torch alike.
"""

import keras
import numpy as np
import pytest
from testing import to_numpy

from keras_dtype_policy.low_precision import block_codes

CODES = {
    f"{bits}bit_{'signed' if signed else 'unsigned'}": block_codes.code_for(
        bits, signed
    )
    for bits in (8, 4)
    for signed in (True, False)
}
# Slack for the float32 arithmetic of the code's levels and positions, in
# float32 units in the last place of the block's scale.
TOLERANCE_ULPS = 8
BLOCKS = 12


def levels_of(code):
    """Every level of `code` for a scale of 1, in float64 (the module
    docstring's formula)."""
    n = code.levels
    if code.signed:
        k = np.arange(-n, n + 1, dtype=np.float64)
        return np.sign(k) * (np.abs(k) / n) ** 2
    k = np.arange(0, n, dtype=np.float64)
    return ((k + 1) / n) ** 4


def scale_of(block, code):
    """The block's scale: its largest finite magnitude (signed) or value
    (unsigned), zero for a block with none."""
    finite = block[np.isfinite(block)].astype(np.float64)
    if not code.signed:
        finite = np.maximum(finite, 0.0)
    return float(np.abs(finite).max()) if finite.size else 0.0


def hard_blocks(code, seed=0):
    """`BLOCKS` blocks of the cases a rounding gets wrong first.

    Each block has its largest element (its scale, positive or, signed,
    negative), zeros, tiny values, values exactly on levels and at the
    midpoints between neighbouring levels, random values over several
    orders of magnitude, negative values (which an unsigned code stores
    as its lowest level) and, in some blocks, infinities and NaN.
    """
    rng = np.random.default_rng(seed)
    levels = levels_of(code)
    midpoints = (levels[:-1] + levels[1:]) / 2
    blocks = []
    for index in range(BLOCKS):
        scale = 10.0 ** rng.uniform(-12, 6)
        parts = [
            np.zeros(4),
            scale * np.array([1e-30, 1e-20, 1e-9, 1e-4]),
            scale * rng.choice(levels, 24),
            scale * rng.choice(midpoints, 24),
            scale * rng.uniform(-1, 1, 24) * 10.0 ** rng.uniform(-6, 0, 24),
            -scale * rng.uniform(0, 1, 4),
        ]
        block = np.concatenate(parts)
        block = np.resize(block, code.block).astype(np.float32)
        if not code.signed:
            # Random values of an unsigned slot are mostly >= 0.
            block[32:] = np.abs(block[32:])
        block = rng.permutation(block)
        block[rng.integers(code.block)] = np.float32(scale)
        if code.signed and index % 3 == 1:
            block[rng.integers(code.block)] = -np.float32(scale) * 1.5
        if index % 2:
            bad = rng.choice(code.block, 3, replace=False)
            block[bad] = [np.inf, -np.inf, np.nan]
        blocks.append(block)
    # A block of zeros, and one of every level of a tiny scale.
    blocks.append(np.zeros(code.block, np.float32))
    tiny = np.zeros(code.block, np.float32)
    tiny[: len(levels)] = 1e-20 * levels
    blocks.append(tiny)
    return np.stack(blocks)


def round_trip(values, code):
    codes, scales = block_codes.quantize(
        keras.ops.convert_to_tensor(values.reshape(-1)), code, seed=None
    )
    restored = to_numpy(block_codes.dequantize(codes, scales, code))
    return restored.reshape(values.shape), to_numpy(scales)


def elements_off_the_nearest_level(values, code):
    """Checks the round trip of `values` (blocks in rows) against the
    oracle; returns a line for each finite element that did not come back
    as a nearest level of its block."""
    restored, scales = round_trip(values, code)
    levels = levels_of(code)
    wrong_elements = []
    for index, (block, stored) in enumerate(zip(values, restored, strict=True)):
        scale = scale_of(block, code)
        assert scales[index] == np.float32(scale), (index, scales[index])
        assert np.all(np.isfinite(stored)), index
        tolerance = TOLERANCE_ULPS * float(np.spacing(np.float32(scale)))
        finite = np.isfinite(block)
        value = block[finite].astype(np.float64)[:, None]
        got = stored[finite].astype(np.float64)
        block_levels = scale * levels[None, :]
        distance = np.abs(value - block_levels)
        nearest = distance.min(axis=1)
        error = np.abs(got - value[:, 0])
        # A level of the block, at the minimum distance of all levels.
        off_level = np.abs(got[:, None] - block_levels).min(axis=1)
        wrong = (error > nearest + tolerance) | (off_level > tolerance)
        for position in np.flatnonzero(wrong):
            best = levels[distance[position].argmin()] * scale
            wrong_elements.append(
                f"block {index} value {value[position, 0]!r}: got "
                f"{got[position]!r}, nearest level {best!r} "
                f"(scale {scale!r})"
            )
    return wrong_elements


@pytest.mark.parametrize("name", sorted(CODES))
def test_nearest_rounding_is_the_argmin_over_every_level(name):
    code = CODES[name]
    wrong_elements = elements_off_the_nearest_level(hard_blocks(code), code)
    assert not wrong_elements, "\n".join(wrong_elements[:20])


# 1e-30: `n**4 / scale` (2**32 / scale for the 8-bit unsigned code)
# overflows float32 below about 1.3e-29, and `scale / n**4` is subnormal;
# `block_codes` codes such a block `LIFT` times larger. (Much smaller
# scales put levels among the subnormals, which XLA and TensorFlow flush
# to zero on a CPU.)
@pytest.mark.parametrize("name", sorted(CODES))
def test_a_block_of_tiny_scale_keeps_its_levels(name):
    code = CODES[name]
    levels = levels_of(code)
    block = np.zeros(code.block, np.float32)
    block[: len(levels)] = 1e-30 * levels
    wrong_elements = elements_off_the_nearest_level(block[None], code)
    assert not wrong_elements, "\n".join(wrong_elements[:20])


@pytest.mark.parametrize("name", sorted(CODES))
def test_infinities_and_nan_take_their_documented_levels(name):
    # Not the oracle's business (no distance to a non-finite value): the
    # module docstring's rule, checked on the same blocks.
    code = CODES[name]
    values = hard_blocks(code)
    restored, scales = round_trip(values, code)
    lowest = 0.0 if code.signed else 1.0 / code.levels**code.power
    for block, stored, scale in zip(values, restored, scales, strict=True):
        expected = {
            np.inf: scale,
            -np.inf: -scale if code.signed else lowest * scale,
        }
        for value, level in expected.items():
            for got in stored[block == value]:
                assert got == pytest.approx(level, rel=1e-6)
        for got in stored[np.isnan(block)]:
            assert got == pytest.approx(lowest * scale, rel=1e-6)
