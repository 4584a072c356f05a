"""The random bits of stochastic rounding: exact, reproducible, uniform.

`random_bits.hashed_noise` is checked bit for bit against a NumPy uint32
reference of the hash its docstring describes, so JAX, TensorFlow and
torch are checked to give the same bits. The noise `rounding_noise` gives
(on torch, torch's own generator) is checked statistically: uniform,
uncorrelated between neighbouring elements and between draws, and the
roundings it drives unbiased. Seeds are fixed, so every run is the same;
each statistical bound is one a good generator passes with a probability
of failure below about 1e-4 (4 standard errors, or as stated).
"""

import keras
import ml_dtypes
import numpy as np
import pytest
from testing import BACKEND
from testing import to_numpy

from keras_dtype_policy.low_precision import compensated_updates
from keras_dtype_policy.low_precision import random_bits

# The hash as the docstring of `random_bits` describes it: Chris Wellons'
# lowbias32 without its last xor-shift, on uint32, the key xored into the
# element's index, the top `bits` bits kept; a key is the hash of the
# seed (its low 31 bits) xored with a salt, xored with the counter (its
# low 31 bits) and hashed again.
LOWBIAS32_MULTIPLIERS = (np.uint32(0x7FEB352D), np.uint32(0x846CA68B))
SEED_SALT = 0x3C6EF372
LOW_31_BITS = 0x7FFFFFFF

NOISE_BITS = {"bfloat16": 16, "float16": 13}
NUMPY_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def reference_mix(x):
    x = np.atleast_1d(np.asarray(x, np.uint32))
    x = x ^ (x >> np.uint32(16))
    x = x * LOWBIAS32_MULTIPLIERS[0]  # uint32 products wrap modulo 2**32.
    x = x ^ (x >> np.uint32(15))
    return x * LOWBIAS32_MULTIPLIERS[1]


def reference_noise(shape, bits, key):
    index = np.arange(int(np.prod(shape)), dtype=np.uint32)
    hashed = reference_mix(index ^ np.uint32(key))
    return (hashed >> np.uint32(32 - bits)).astype(np.int64).reshape(shape)


def reference_key(seed, counter):
    seed_hash = reference_mix((seed & LOW_31_BITS) ^ SEED_SALT)
    return int(reference_mix(seed_hash ^ np.uint32(counter & LOW_31_BITS))[0])


def int32_key(key):
    """An unsigned 32-bit key as the int32 tensor `hashed_noise` takes."""
    return keras.ops.convert_to_tensor(
        np.array(key, np.uint32).view(np.int32), "int32"
    )


def as_numpy(x):
    return np.asarray(to_numpy(x)).astype(np.int64)


def as_float32(x):
    # Cast first: TensorFlow cannot turn a bfloat16 tensor into NumPy.
    return np.asarray(to_numpy(keras.ops.cast(x, "float32")))


def generator_at(seed, counter):
    """A SeedGenerator whose state is `(seed, counter)`, both unsigned
    32-bit values stored in the backend's seed dtype (int32 on torch,
    int64 on TensorFlow, uint32 on JAX)."""
    generator = keras.random.SeedGenerator(0)
    state = np.array([seed, counter], np.uint32)
    if generator.state.dtype == "int32":
        state = state.view(np.int32)
    generator.state.assign(state.astype(generator.state.dtype))
    return generator


# 1. The hash is the reference hash, on every backend.

KEYS = [0, 1, 0x7FFFFFFF, 0x80000000, 0xDEADBEEF, 0xFFFFFFFF]
SHAPES = [(), (7,), (3, 5, 4), (1000,), (16, 64)]


@pytest.mark.parametrize("bits", [16, 13])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_hashed_noise_is_the_reference_hash(shape, bits):
    for key in KEYS + [reference_key(3, 7)]:
        noise = random_bits.hashed_noise(shape, bits, int32_key(key))
        assert tuple(noise.shape) == shape
        assert keras.backend.standardize_dtype(noise.dtype) == "int32"
        np.testing.assert_array_equal(
            as_numpy(noise), reference_noise(shape, bits, key)
        )


def test_reference_hash_is_lowbias32_without_its_last_xorshift():
    # Published lowbias32 ends with `x ^= x >> 16`, which leaves the top
    # 16 bits alone: the top bits of the full hash are the reference's.
    x = np.arange(4096, dtype=np.uint32) * np.uint32(0x9E3779B9)
    full = reference_mix(x)
    full = full ^ (full >> np.uint32(16))
    np.testing.assert_array_equal(full >> 16, reference_mix(x) >> 16)
    # And the reference scrambles: no collisions, not the identity.
    assert len(np.unique(reference_mix(x))) == 4096
    assert not np.array_equal(reference_mix(x), x)


SEEDS_AND_COUNTERS = [
    (0, 0),
    (0, 1),
    (1, 0),
    (42, 12345),
    (2**31 - 1, 0),
    (2**31 - 1, 2**31 - 1),
    (2**31, 5),  # Only a seed's low 31 bits count: seed 0's key.
    (7, 2**31 + 9),  # Likewise a counter's: counter 9's key.
    (123456789, 10**9),
    (2**32 - 1, 2**32 - 1),
]


@pytest.mark.parametrize("seed, counter", SEEDS_AND_COUNTERS, ids=str)
def test_python_key_is_the_key_of_the_same_state(seed, counter):
    expected = reference_key(seed, counter)
    assert random_bits.python_key(seed, counter) == expected
    generator = generator_at(seed, counter)
    key = as_numpy(random_bits.key_of(generator.state.value))
    assert int(key) & 0xFFFFFFFF == expected
    # next_key takes the same key and moves the counter on by one.
    key = as_numpy(random_bits.next_key(generator))
    assert int(key) & 0xFFFFFFFF == expected
    assert (
        random_bits.python_key(seed, counter + 1)
        == int(as_numpy(random_bits.next_key(generator))) & 0xFFFFFFFF
    )


def test_int_seed_is_counter_zero():
    for seed in (0, 5, 2**31 - 1):
        key = as_numpy(random_bits.next_key(seed))
        assert int(key) & 0xFFFFFFFF == random_bits.python_key(seed, 0)


def test_distinct_states_give_distinct_keys():
    keys = {
        random_bits.python_key(seed, counter)
        for seed in range(32)
        for counter in range(32)
    }
    assert len(keys) == 32 * 32


@pytest.mark.parametrize("seed", [1.5, "3", True, None])
def test_bad_seed(seed):
    with pytest.raises(TypeError, match="seed"):
        random_bits.next_key(seed)


# 2. Reproducibility: same seed, same bits; eagerly, compiled, resumed.


def draws(generator, count, shape=(257,), bits=16):
    return [
        as_numpy(random_bits.rounding_noise(shape, bits, generator))
        for _ in range(count)
    ]


def test_same_seed_same_noise():
    first = draws(keras.random.SeedGenerator(5), 3)
    again = draws(keras.random.SeedGenerator(5), 3)
    for one, other in zip(first, again, strict=True):
        np.testing.assert_array_equal(one, other)
    # Each draw moves the generator on: the three draws differ, and
    # another seed gives other bits.
    assert not np.array_equal(first[0], first[1])
    assert not np.array_equal(first[1], first[2])
    other_seed = draws(keras.random.SeedGenerator(6), 1)[0]
    assert not np.array_equal(first[0], other_seed)


def test_int_seed_gives_the_same_noise_every_time():
    one = as_numpy(random_bits.rounding_noise((64,), 16, 9))
    np.testing.assert_array_equal(
        one, as_numpy(random_bits.rounding_noise((64,), 16, 9))
    )


@pytest.mark.skipif(
    BACKEND == "torch",
    reason="torch's rounding_noise draws from torch's own generator, not "
    "the hash; the hash itself is checked on torch by the reference tests",
)
def test_rounding_noise_is_the_hash_of_the_next_key():
    generator = keras.random.SeedGenerator(11)
    noise = as_numpy(random_bits.rounding_noise((5, 9), 13, generator))
    expected = reference_noise((5, 9), 13, reference_key(11, 0))
    np.testing.assert_array_equal(noise, expected)


@pytest.mark.skipif(
    BACKEND != "jax",
    reason="jax.jit is JAX's; the other backends' "
    "compiled forms are not under test here",
)
def test_hashed_noise_under_jit_is_the_eager_noise():
    import jax

    @jax.jit
    def noise_of_state(state):
        return random_bits.hashed_noise((33, 17), 16, random_bits.key_of(state))

    for seed, counter in [(0, 0), (2**31 - 1, 3), (42, 10**9)]:
        generator = generator_at(seed, counter)
        compiled = as_numpy(noise_of_state(generator.state.value))
        eager = as_numpy(random_bits.rounding_noise((33, 17), 16, generator))
        np.testing.assert_array_equal(compiled, eager)
        np.testing.assert_array_equal(
            compiled,
            reference_noise((33, 17), 16, reference_key(seed, counter)),
        )


@pytest.mark.parametrize(
    "draw",
    [
        lambda generator: random_bits.rounding_noise((129,), 16, generator),
        lambda generator: compensated_updates.stochastic_round(
            keras.ops.full((129,), 1.0 + 2.0**-10, "float32"),
            "bfloat16",
            generator,
        ),
    ],
    ids=["rounding_noise", "stochastic_round"],
)
def test_restored_state_continues_the_same_noise(draw):
    def draw_numpy(generator):
        return as_float32(draw(generator))

    uninterrupted = keras.random.SeedGenerator(21)
    expected = [draw_numpy(uninterrupted) for _ in range(4)]

    interrupted = keras.random.SeedGenerator(21)
    first = [draw_numpy(interrupted) for _ in range(2)]
    saved = np.asarray(to_numpy(interrupted.state))  # state.numpy()
    # A fresh generator of another seed, given the saved state.
    resumed = keras.random.SeedGenerator(1000)
    resumed.state.assign(saved)
    rest = [draw_numpy(resumed) for _ in range(2)]

    for one, other in zip(expected, first + rest, strict=True):
        np.testing.assert_array_equal(one, other)
    assert not np.array_equal(expected[1], expected[2])


# 3. Statistics: uniform, and no correlation between neighbours or draws.

SAMPLES = 2**17
CORRELATION_BOUND = 4 / np.sqrt(SAMPLES)
# Pearson's chi-square over 64 equal bins has 63 degrees of freedom
# (mean 63, standard deviation 11.2); a uniform sample exceeds 130 with
# a probability of about 1e-6.
CHI_SQUARE_BINS = 64
CHI_SQUARE_BOUND = 130.0


def hashed(shape, bits, generator):
    return random_bits.hashed_noise(
        shape, bits, random_bits.next_key(generator)
    )


SOURCES = {"rounding_noise": random_bits.rounding_noise, "hash": hashed}


def correlation(x, y):
    return np.corrcoef(x.astype(np.float64), y.astype(np.float64))[0, 1]


@pytest.mark.parametrize("bits", [16, 13])
@pytest.mark.parametrize("source", list(SOURCES))
def test_noise_is_uniform(source, bits):
    noise = as_numpy(
        SOURCES[source]((SAMPLES,), bits, keras.random.SeedGenerator(3))
    )
    levels = 2**bits
    assert noise.min() >= 0 and noise.max() < levels
    # Both ends are reached.
    assert noise.min() < levels // 256 and noise.max() >= levels - levels // 256
    # The mean of a uniform draw from {0, ..., levels - 1}.
    standard_error = np.sqrt((levels**2 - 1) / 12 / SAMPLES)
    assert abs(noise.mean() - (levels - 1) / 2) < 4 * standard_error
    counts = np.bincount(
        noise // (levels // CHI_SQUARE_BINS), minlength=CHI_SQUARE_BINS
    )
    expected = SAMPLES / CHI_SQUARE_BINS
    chi_square = ((counts - expected) ** 2 / expected).sum()
    assert chi_square < CHI_SQUARE_BOUND
    # Every bit is a fair coin.
    for bit in range(bits):
        ones = ((noise >> bit) & 1).mean()
        assert abs(ones - 0.5) < 4 * 0.5 / np.sqrt(SAMPLES)


@pytest.mark.parametrize("source", list(SOURCES))
def test_neighbouring_elements_are_uncorrelated(source):
    noise = as_numpy(
        SOURCES[source]((512, 256), 16, keras.random.SeedGenerator(4))
    )
    flat = noise.reshape(-1)
    # Along the last axis, and from one row to the next.
    assert abs(correlation(flat[:-1], flat[1:])) < CORRELATION_BOUND
    assert abs(correlation(flat[:-256], flat[256:])) < CORRELATION_BOUND
    # Nor between the top bit of neighbours (a coarser dependence).
    top = flat >> 15
    assert abs(correlation(top[:-1], top[1:])) < CORRELATION_BOUND


@pytest.mark.parametrize("source", list(SOURCES))
def test_consecutive_draws_are_uncorrelated(source):
    generator = keras.random.SeedGenerator(8)
    first, second, third = (
        as_numpy(SOURCES[source]((SAMPLES,), 16, generator)) for _ in range(3)
    )
    assert abs(correlation(first, second)) < CORRELATION_BOUND
    assert abs(correlation(second, third)) < CORRELATION_BOUND
    # Not merely a shuffle of the same values either.
    assert np.mean(first == second) < 0.01


def test_hash_of_consecutive_counters_and_seeds_is_uncorrelated():
    def noise(seed, counter):
        key = int32_key(random_bits.python_key(seed, counter))
        return as_numpy(random_bits.hashed_noise((SAMPLES,), 16, key))

    base = noise(17, 1000)
    for other in (noise(17, 1001), noise(17, 999), noise(18, 1000)):
        assert abs(correlation(base, other)) < CORRELATION_BOUND
        assert np.mean(base == other) < 0.01


# 4. Unbiased rounding.

FRACTIONS = [0.01, 0.3, 0.5, 0.99]
ROUNDINGS = 100_000


def neighbours(start, dtype):
    """`start` (a number of `dtype`) and the next one away from zero."""
    low = np.array(start, NUMPY_DTYPES[dtype])
    direction = np.array(np.sign(start) * np.inf, NUMPY_DTYPES[dtype])
    high = np.nextafter(low, direction)
    return float(low), float(high)


def value_between(low, high, fraction):
    """The float32 value `fraction` of the way from `low` to `high`, and
    the exact fraction it lies at."""
    value = np.float32(low + fraction * (high - low))
    return value, (float(value) - low) / (high - low)


def assert_unbiased(rounded, low, high, fraction):
    assert set(np.unique(rounded).tolist()) <= {low, high}
    spacing = abs(high - low)
    standard_error = np.sqrt(fraction * (1 - fraction) / rounded.size)
    exact = low + fraction * (high - low)
    assert abs(rounded.astype(np.float64).mean() - exact) < (
        4 * standard_error * spacing
    )


STARTS = [
    ("bfloat16", 1.0),
    ("bfloat16", -3.0e4),
    ("bfloat16", 2.0**-120),
    ("bfloat16", 2.0**-133 * 3),  # Subnormal (float32's too).
    ("float16", 1.0),
    ("float16", -1000.0),
    ("float16", 2.0**-24 * 5),  # Subnormal: steps of 2**-24.
    ("float16", -(2.0**-24) * 1000),  # Subnormal near the normal range.
]


def seed_of_case(*case):
    """A fixed seed of its own for each case, so that the cases' noise is
    independent (one seed for all made one 4-standard-error draw of
    torch's, seed 13, fail every float16 case at p = 0.01 at once)."""
    return sum(ord(c) * 31**i for i, c in enumerate(repr(case))) % 2**31


@pytest.mark.parametrize("fraction", FRACTIONS, ids=str)
@pytest.mark.parametrize("dtype, start", STARTS, ids=str)
def test_stochastic_round_is_unbiased(dtype, start, fraction):
    low, high = neighbours(start, dtype)
    value, fraction = value_between(low, high, fraction)
    rounded = as_float32(
        compensated_updates.stochastic_round(
            keras.ops.full((ROUNDINGS,), value, "float32"),
            dtype,
            keras.random.SeedGenerator(seed_of_case(dtype, start, fraction)),
        )
    )
    assert_unbiased(rounded, low, high, fraction)


TORCH_ONLY = pytest.mark.skipif(
    BACKEND != "torch",
    reason="store_rounded is the torch step's own writer of torch tensors",
)


def torch_tensor(values):
    import torch

    return torch.as_tensor(
        np.asarray(values, np.float32), device=keras.ops.zeros(()).device
    )


def stored_by_store_rounded(working, dtype, seed=13):
    import torch

    from keras_dtype_policy.low_precision import torch_noise
    from keras_dtype_policy.low_precision import torch_step

    stored = torch.empty(working.shape, dtype=getattr(torch, dtype)).to(
        working.device
    )
    noise = torch_noise.TorchNoise(keras.random.SeedGenerator(seed))
    torch_step.store_rounded(stored, working, noise)
    assert stored.dtype == getattr(torch, dtype)
    return stored


@TORCH_ONLY
@pytest.mark.parametrize("fraction", FRACTIONS, ids=str)
@pytest.mark.parametrize(
    "dtype, start",
    [("bfloat16", 1.0), ("bfloat16", -3.0e4), ("float16", 1.0)],
    ids=str,
)
def test_store_rounded_is_unbiased(dtype, start, fraction):
    low, high = neighbours(start, dtype)
    value, fraction = value_between(low, high, fraction)
    working = torch_tensor(np.full((ROUNDINGS,), value))
    seed = seed_of_case("store_rounded", dtype, start, fraction)
    stored = stored_by_store_rounded(working, dtype, seed)
    assert_unbiased(stored.float().cpu().numpy(), low, high, fraction)


@TORCH_ONLY
def test_store_rounded_is_reproducible():
    # The same seed, the same bits; another seed, others. (That its
    # rounding is the keras.ops form's bit for bit, given the same bits,
    # is test_torch_codes.py's.)
    values = np.random.default_rng(0).standard_normal((64, 33)) * 10.0
    working = torch_tensor(values)
    stored = stored_by_store_rounded(working, "bfloat16", seed=5)
    again = stored_by_store_rounded(working, "bfloat16", seed=5)
    other = stored_by_store_rounded(working, "bfloat16", seed=6)
    got = stored.float().cpu().numpy()
    np.testing.assert_array_equal(got, again.float().cpu().numpy())
    assert np.mean(got != other.float().cpu().numpy()) > 0.1
    # And it rounds: some values went down, some up.
    values = np.float32(values)
    assert (got < values).any()
    assert (got > values).any()


BFLOAT16_MAX = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)


@TORCH_ONLY
def test_store_rounded_special_values():
    import torch

    infinity = torch.tensor(np.inf)
    special = [
        np.inf,
        -np.inf,
        np.nan,
        float(infinity - infinity),  # The NaN arithmetic makes.
        0.0,
        -0.0,
        BFLOAT16_MAX,
        -BFLOAT16_MAX,
        -1.5,
        2.0**-133,  # bfloat16's smallest subnormal.
    ]
    repeats = 4096  # Enough to meet every high noise value.
    working = torch_tensor(np.tile(np.array(special, np.float32), repeats))
    stored = stored_by_store_rounded(working, "bfloat16")
    got = stored.float().cpu().numpy().reshape(repeats, len(special)).T
    assert np.all(got[0] == np.inf) and np.all(got[1] == -np.inf)
    assert np.all(np.isnan(got[2])) and np.all(np.isnan(got[3]))
    for row, zero in zip(got[4:6], (0.0, -0.0), strict=True):
        assert np.all(row == 0.0)
        assert np.all(np.signbit(row) == np.signbit(zero))
    assert np.all(got[6] == BFLOAT16_MAX)
    assert np.all(got[7] == -BFLOAT16_MAX)
    assert np.all(got[8] == -1.5)
    assert np.all(got[9] == 2.0**-133)


@TORCH_ONLY
def test_store_rounded_past_the_largest_finite_value():
    # float32's largest value lies between bfloat16's largest and
    # infinity, almost all the way up: it rounds to one or the other.
    float32_max = float(np.finfo(np.float32).max)
    working = torch_tensor(np.full((ROUNDINGS,), float32_max))
    got = stored_by_store_rounded(working, "bfloat16").float().cpu().numpy()
    assert set(np.unique(got).tolist()) <= {BFLOAT16_MAX, np.inf}
    assert np.mean(got == np.inf) > 0.99
    got = stored_by_store_rounded(-working, "bfloat16").float().cpu().numpy()
    assert set(np.unique(got).tolist()) <= {-BFLOAT16_MAX, -np.inf}


# 5. The stall test: updates far below half an ulp add up on average.

STEPS = 2000
INCREMENT = 1e-4
WEIGHTS = 4096


def compiled_loop_step(generator):
    """One update of both weights: `stochastic_round(w + 1e-4)` and the
    cast Keras does, compiled as an optimizer's step is where the backend
    compiles (2000 eager steps take 5 to 11 s on jax and TensorFlow)."""

    def step(stochastic, nearest):
        stochastic = compensated_updates.stochastic_round(
            keras.ops.add(keras.ops.cast(stochastic, "float32"), INCREMENT),
            "bfloat16",
            generator,
        )
        nearest = keras.ops.cast(
            keras.ops.add(keras.ops.cast(nearest, "float32"), INCREMENT),
            "bfloat16",
        )
        return stochastic, nearest

    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.function(step)
    if BACKEND != "jax":
        return step
    import jax

    @jax.jit
    def stateless_step(stochastic, nearest, state):
        mapping = [(generator.state, state)]
        with keras.StatelessScope(state_mapping=mapping) as scope:
            stochastic, nearest = step(stochastic, nearest)
        return stochastic, nearest, scope.get_current_value(generator.state)

    def jax_step(stochastic, nearest):
        stochastic, nearest, state = stateless_step(
            stochastic, nearest, generator.state.value
        )
        generator.state.assign(state)
        return stochastic, nearest

    return jax_step


def test_small_updates_add_up_under_stochastic_rounding_only():
    # Between 1 and 2 bfloat16's spacing is 2**-7; each step adds the
    # float32 increment (exactly `step`, as the weight stays on the
    # bfloat16 grid) and rounds up with probability p = step / spacing.
    spacing = 2.0**-7
    step = float(np.float32(1.0) + np.float32(INCREMENT)) - 1.0
    p = step / spacing
    expected = 1.0 + STEPS * step  # 1.2, give or take float32's rounding.
    assert abs(expected - 1.2) < 1e-3
    # A weight's final value is 1 + spacing * Binomial(STEPS, p).
    spread = spacing * np.sqrt(STEPS * p * (1 - p))

    generator = keras.random.SeedGenerator(2024)
    update = compiled_loop_step(generator)
    stochastic = keras.ops.ones((WEIGHTS,), "bfloat16")
    nearest = keras.ops.ones((WEIGHTS,), "bfloat16")
    for _ in range(STEPS):
        stochastic, nearest = update(stochastic, nearest)
    # The generator moved on once a step.
    assert int(np.asarray(to_numpy(generator.state))[1]) == STEPS
    final = as_float32(stochastic).astype(np.float64)
    assert np.all(as_float32(nearest) == 1.0)
    # Every weight moved, and their mean is the exact sum.
    assert final.min() > 1.0
    assert abs(final.mean() - expected) < 3 * spread / np.sqrt(WEIGHTS)
    # Their spread is the binomial one: the steps' roundings are
    # independent (bits repeated from step to step would make some
    # weights always round up and the others never).
    assert 0.9 * spread < final.std() < 1.1 * spread


def test_chunk_keys_draw_the_whole_tensors_bits_at_its_elements():
    """A chunk of a tensor gets, draw after draw, the bits the whole
    tensor gets at those elements from a generator in the same state;
    the generator advanced by the chunk's draws is where the whole
    tensor's draws leave it."""
    whole_generator = keras.random.SeedGenerator(7)
    # A copy: torch's variable is updated in place.
    start = keras.ops.convert_to_tensor(whole_generator.state.numpy())
    whole = [
        keras.ops.convert_to_numpy(
            random_bits.hashed_noise(
                (1000,), 16, random_bits.next_key(whole_generator)
            )
        )
        for _ in range(3)
    ]
    keys = random_bits.ChunkKeys(start, 300)
    chunk = [
        keras.ops.convert_to_numpy(keys.noise((200,), 16)) for _ in range(3)
    ]
    for full, piece in zip(whole, chunk, strict=True):
        np.testing.assert_array_equal(piece, full[300:500])
    assert not np.array_equal(chunk[0], chunk[1])
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(random_bits.advanced_state(start, 3)),
        keras.ops.convert_to_numpy(whole_generator.state.value),
    )
