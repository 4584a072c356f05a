"""block_codes: the 8-bit and 4-bit block codes of optimizer state.

Every expectation holds on tensorflow, jax and torch alike.
"""

import keras
import numpy as np
import pytest
from testing import to_numpy

from keras_dtype_policy.low_precision import block_codes

CODES = {
    "8bit_signed": block_codes.code_for(8, True),
    "8bit_unsigned": block_codes.code_for(8, False),
    "4bit_signed": block_codes.code_for(4, True),
    "4bit_unsigned": block_codes.code_for(4, False),
}


def round_trip(values, code, seed=None):
    codes, scales = block_codes.quantize(
        keras.ops.convert_to_tensor(values), code, seed
    )
    return to_numpy(block_codes.dequantize(codes, scales, code)), codes, scales


def blocks_of(code, count=8, seed=0):
    """`count` blocks of values spread over several orders of magnitude."""
    rng = np.random.RandomState(seed)
    values = rng.randn(count * code.block) * 10.0 ** rng.uniform(-6, 1)
    if not code.signed:
        values = values**2
    return values.astype("float32")


def half_gap_bound(relative, code):
    """Half the gap between the two levels around `relative` (of the
    scale), an upper bound of the nearest rounding's error."""
    n = code.levels
    if code.signed:
        # level(k) = (k/n)**2, gap (2k + 1)/n**2, k <= sqrt(r) n.
        k = np.sqrt(relative) * n
        return (2 * k + 1) / (2 * n**2)
    # level(k) = ((k+1)/n)**4; j = k + 1 <= r**(1/4) n. Below the lowest
    # level a value rounds up to it: an error of at most 1/n**4.
    j = relative**0.25 * n
    gap = (4 * j**3 + 6 * j**2 + 4 * j + 1) / (2 * n**4)
    return np.maximum(gap, 1.0 / n**4)


@pytest.mark.parametrize("name", sorted(CODES))
def test_nearest_round_trip_is_within_half_a_gap(name):
    code = CODES[name]
    values = blocks_of(code)
    restored, _, scales = round_trip(values, code)
    scale = np.repeat(to_numpy(scales), code.block)
    np.testing.assert_array_equal(
        to_numpy(scales),
        np.abs(values).reshape(-1, code.block).max(axis=1),
    )
    relative = np.abs(values) / scale
    error = np.abs(restored - values)
    # One float32 rounding of slack on top of the level arithmetic.
    bound = half_gap_bound(relative, code) * scale * (1 + 1e-5) + 1e-7 * scale
    assert np.all(error <= bound)
    # Each block's largest element is stored exactly.
    largest = np.abs(values).reshape(-1, code.block).argmax(axis=1)
    blocks = np.arange(len(largest))
    np.testing.assert_allclose(
        restored.reshape(-1, code.block)[blocks, largest],
        values.reshape(-1, code.block)[blocks, largest],
        rtol=1e-6,
    )


@pytest.mark.parametrize("name", sorted(CODES))
def test_stochastic_rounding_is_unbiased(name):
    code = CODES[name]
    draws = 64
    # Each block: its scale (1.0) first, then values between two levels.
    value = 0.37 if code.signed else 0.0123
    block = np.full(code.block, value, "float32")
    block[0] = 1.0
    values = np.tile(block, draws)
    generator = keras.random.SeedGenerator(5)
    restored, _, _ = round_trip(values, code, generator)
    kept = restored.reshape(draws, code.block)[:, 1:]
    nearest, _, _ = round_trip(values, code)
    levels = np.unique(kept)
    assert len(levels) == 2
    assert levels[0] < value < levels[1]
    gap = levels[1] - levels[0]
    # The mean of N draws is off by about gap / (2 sqrt N); N ~ 16000 (8
    # bits) or 8000 (4 bits): 5 standard deviations stay below 0.03 gap.
    assert abs(kept.mean() - value) < 0.03 * gap
    assert abs(nearest[1] - value) <= gap / 2
    assert abs(kept.mean() - value) < abs(nearest[1] - value)


def test_stochastic_rounding_is_seeded():
    code = CODES["8bit_signed"]
    values = blocks_of(code, count=2)

    def codes_with(seed):
        return to_numpy(block_codes.quantize(values, code, seed)[0])

    np.testing.assert_array_equal(codes_with(3), codes_with(3))
    generator = keras.random.SeedGenerator(3)
    first, second = codes_with(generator), codes_with(generator)
    assert not np.array_equal(first, second)
    again = keras.random.SeedGenerator(3)
    np.testing.assert_array_equal(codes_with(again), first)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "sr"])
def test_unsigned_code_never_stores_zero_for_a_positive_value(bits, stochastic):
    code = block_codes.code_for(bits, False)
    block = np.geomspace(1e-30, 1.0, code.block).astype("float32")
    block[:4] = [0.0, 1e-38, 1e-20, 2.0 ** -(4 * bits) * 0.3]
    seed = keras.random.SeedGenerator(0) if stochastic else None
    restored, _, scales = round_trip(np.tile(block, 4), code, seed)
    lowest = float(to_numpy(scales)[0]) / code.levels**4
    assert lowest > 0
    assert np.all(restored >= lowest * (1 - 1e-6))
    # sqrt of the stored second moment never vanishes: m / sqrt(v) stays
    # bounded.
    assert np.all(np.sqrt(restored) > 0)


@pytest.mark.parametrize("name", sorted(CODES))
def test_infinities_and_nan_stay_in_their_element(name):
    code = CODES[name]
    values = blocks_of(code, count=3)
    spoiled = values.copy()
    spoiled[5], spoiled[9], spoiled[code.block + 2] = np.inf, np.nan, -np.inf
    restored, _, scales = round_trip(spoiled, code)
    clean, _, clean_scales = round_trip(values, code)
    scales, clean_scales = to_numpy(scales), to_numpy(clean_scales)
    assert np.all(np.isfinite(restored)) and np.all(np.isfinite(scales))
    # The last block has no bad element: untouched.
    last = slice(2 * code.block, None)
    np.testing.assert_array_equal(restored[last], clean[last])
    assert scales[2] == clean_scales[2]
    # Finite elements of a spoiled block keep the nearest rounding's bound
    # of the block's finite scale.
    first_finite = np.delete(values[: code.block], [5, 9])
    assert scales[0] == np.abs(first_finite).max()
    assert restored[5] == pytest.approx(scales[0], rel=1e-6)
    if code.signed:
        assert restored[9] == 0.0
        assert restored[code.block + 2] == pytest.approx(-scales[1], rel=1e-6)
    else:
        # Unsigned: NaN and -inf take the lowest level of their block.
        assert restored[9] == pytest.approx(scales[0] / code.levels**4)
        lowest = scales[1] / code.levels**4
        assert restored[code.block + 2] == pytest.approx(lowest)
    keep = np.ones(len(values), bool)
    keep[[5, 9, code.block + 2]] = False
    scale = np.repeat(scales, code.block)
    bound = half_gap_bound(np.abs(values) / scale, code) * scale * (1 + 1e-5)
    within = np.abs(restored - values) <= bound + 1e-7 * scale
    assert np.all(within[keep])


@pytest.mark.parametrize("name", sorted(CODES))
def test_zero_blocks_and_shapes(name):
    code = CODES[name]
    values = np.zeros(3 * code.block, "float32")
    values[code.block : 2 * code.block] = blocks_of(code, count=1)
    restored, codes, scales = round_trip(values.reshape(3, -1, 2), code)
    assert keras.backend.standardize_dtype(codes.dtype) == "int8"
    assert keras.backend.standardize_dtype(scales.dtype) == "float32"
    assert tuple(codes.shape) == (3, code.block * code.bits // 8)
    assert tuple(scales.shape) == (3,)
    assert restored.shape == (3 * code.block,)
    scales = to_numpy(scales)
    assert scales[0] == scales[2] == 0.0
    assert np.all(restored[: code.block] == 0.0)
    assert np.all(restored[2 * code.block :] == 0.0)
    # A zero block's codes are those of zero-initialized state.
    zero_codes = to_numpy(codes)[0]
    assert np.all(zero_codes == zero_codes[0])


def test_block_counts_and_sizes():
    eight, four = CODES["8bit_signed"], CODES["4bit_unsigned"]
    assert (eight.block, eight.bytes_per_block) == (256, 256)
    assert (four.block, four.bytes_per_block) == (128, 64)
    assert [block_codes.block_count(n, eight) for n in (1, 256, 257)] == [
        1,
        1,
        2,
    ]
    assert (eight.levels, eight.power) == (127, 2)
    assert (CODES["8bit_unsigned"].levels, four.levels, four.power) == (
        256,
        16,
        4,
    )


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_four_bit_codes_are_packed_two_to_a_byte(signed):
    code = block_codes.code_for(4, signed)
    n = code.levels
    rng = np.random.RandomState(1)
    # Values exactly on levels, the block's scale 1.0 first.
    if signed:
        index = rng.randint(-n, n + 1, code.block)
        index[0] = n
        values = np.sign(index) * (np.abs(index) / n) ** 2
        stored = index + n
    else:
        index = rng.randint(0, n, code.block)
        index[0] = n - 1
        values = ((index + 1) / n) ** 4
        stored = index
    _, codes, _ = round_trip(values.astype("float32"), code)
    byte = to_numpy(codes)[0].astype(np.int32) + 128
    assert byte.shape == (code.block // 2,)
    np.testing.assert_array_equal(byte % 16, stored[0::2])
    np.testing.assert_array_equal(byte // 16, stored[1::2])


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_four_bit_unpack_of_every_byte(signed):
    # Every byte value: the low 4 bits first, then the high 4, as the
    # stacked `byte % 16` and `byte // 16` gave them.
    code = block_codes.code_for(4, signed)
    byte = np.arange(256, dtype=np.int32)
    packed = (byte - 128).astype(np.int8).reshape(4, 64)
    index = to_numpy(
        block_codes._unpack(
            keras.ops.cast(keras.ops.convert_to_tensor(packed), "int32"), code
        )
    )
    expected = np.stack([byte % 16, byte // 16], axis=-1).reshape(4, 128)
    if signed:
        expected = expected - code.levels
    np.testing.assert_array_equal(index, expected)
