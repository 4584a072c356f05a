"""Stochastic rounding into float16 on torch, through the kernel path.

`torch_numerics.stochastic_float16` must be `compensated_updates.
stochastic_round`'s float16 arithmetic (the `keras.ops` reference) bit
for bit given the same random bits, at both ends of float16's range
too; `torch_kernels.round_to_float16` must give the same bits compiled
and eager, round without bias, and be what the torch step stores float16
weights and slots with.
"""

import keras
import numpy as np
import pytest
from testing import BACKEND

import keras_dtype_policy

pytestmark = pytest.mark.skipif(
    BACKEND != "torch",
    reason="torch's own kernel for float16 stochastic rounding",
)

# float16's smallest normal number and its largest number.
MIN_NORMAL = 2.0**-14
LARGEST = 65504.0


def c_compiler():
    from keras_dtype_policy.low_precision import torch_kernels

    return torch_kernels.c_compiler()


def kernel_key(key):
    import torch

    return torch.tensor(key, dtype=torch.int32)


def edge_values(rng, size):
    """float32 values of every kind float16 storage meets: normal values
    of both signs and of many scales, subnormal float16 values, values
    between 65504 and 65520 and above, infinities, NaN and zeros."""
    values = rng.normal(size=size).astype("float32")
    values *= rng.lognormal(0.0, 4.0, size=size).astype("float32")
    quarter = size // 4
    subnormal = rng.uniform(-MIN_NORMAL, MIN_NORMAL, size=quarter)
    values[:quarter] = subnormal.astype("float32")
    special = [
        np.inf,
        -np.inf,
        np.nan,
        0.0,
        -0.0,
        MIN_NORMAL,
        -MIN_NORMAL,
        np.nextafter(np.float32(MIN_NORMAL), np.float32(0.0)),
        2.0**-24,
        -(2.0**-25),
        2.0**-30,
        LARGEST,
        -LARGEST,
        65505.0,
        65519.0,
        -65519.99,
        65520.0,
        70000.0,
        -3.3e38,
        1.0 + 2.0**-12,
        -(1.0 + 2.0**-12),
    ]
    values[quarter : quarter + len(special)] = special
    more = rng.uniform(LARGEST, 65530.0, size=40).astype("float32")
    values[quarter + len(special) : quarter + len(special) + 40] = more
    return values


def reference(values, bits, monkeypatch):
    """`compensated_updates.stochastic_round(values, "float16", _)` with
    `bits` as its random bits, as float16 bit patterns (int16)."""
    import torch

    from keras_dtype_policy.low_precision import compensated_updates
    from keras_dtype_policy.low_precision import random_bits

    def given(shape, count, seed):
        assert count == 13 and tuple(shape) == tuple(bits.shape)
        return torch.as_tensor(bits)

    with monkeypatch.context() as patch:
        patch.setattr(random_bits, "rounding_noise", given)
        rounded = compensated_updates.stochastic_round(
            torch.from_numpy(values), "float16", 0
        )
    return rounded.view(torch.int16).numpy()


def assert_same_bits(got, expected, values):
    """Equal float16 bit patterns; NaN only needs to stay NaN (its sign
    and payload are the conversion's)."""
    nan = np.isnan(values)
    np.testing.assert_array_equal(got[~nan], expected[~nan])
    assert np.isnan(got[nan].view("float16")).all()


def test_stochastic_float16_is_the_keras_ops_rounding(monkeypatch):
    import torch

    from keras_dtype_policy.low_precision import torch_numerics

    rng = np.random.default_rng(0)
    values = edge_values(rng, 20000)
    bits = rng.integers(0, 2**13, size=values.shape, dtype=np.int32)
    # The extreme bits: nothing added, and everything but one.
    bits[::7] = 0
    bits[3::7] = 2**13 - 1
    working = torch.from_numpy(values)
    rounded = torch_numerics.stochastic_float16(
        working, working.view(torch.int32), torch.from_numpy(bits)
    )
    got = rounded.to(torch.float16).view(torch.int16).numpy()
    assert_same_bits(got, reference(values, bits, monkeypatch), values)


def test_stochastic_float16_at_the_ends_of_float16(monkeypatch):
    import torch

    from keras_dtype_policy.low_precision import torch_numerics

    step = 2.0**-24
    values = np.array(
        [
            2.5 * step,  # subnormal: on the 2**-24 grid
            -2.5 * step,
            65510.0,  # beyond the largest: the cast's nearest
            65520.0,
            -70000.0,
            np.inf,
            -np.inf,
            np.nan,
            0.0,
            -0.0,
            1.0 + 2.0**-11,  # half an ulp above 1.0
        ],
        "float32",
    )
    low = np.zeros(values.shape, np.int32)
    high = np.full(values.shape, 2**13 - 1, np.int32)
    working = torch.from_numpy(values)

    def rounded(bits):
        stored = torch_numerics.stochastic_float16(
            working, working.view(torch.int32), torch.from_numpy(bits)
        )
        return stored.to(torch.float16).float().numpy()

    down, up = rounded(low), rounded(high)
    last = 1.0 + 2.0**-10
    np.testing.assert_array_equal(
        down,
        [2 * step, -3 * step, LARGEST, np.inf, -np.inf, np.inf, -np.inf]
        + [np.nan, 0.0, 0.0, 1.0],
    )
    np.testing.assert_array_equal(
        up,
        [3 * step, -2 * step, LARGEST, np.inf, -np.inf, np.inf, -np.inf]
        + [np.nan, 0.0, 0.0, last],
    )
    for bits in (low, high):
        expected = reference(values, bits, monkeypatch)
        got = torch.from_numpy(rounded(bits)).half().view(torch.int16)
        assert_same_bits(got.numpy(), expected, values)


STEP = 2.0**-24


@pytest.mark.parametrize(
    "value, below, above",
    [
        (1.0 + 0.3 * 2.0**-10, 1.0, 1.0 + 2.0**-10),
        (-27.2 * STEP, -28 * STEP, -27 * STEP),
        (5.7 * STEP, 5 * STEP, 6 * STEP),
        (40000.3, 40000.0, 40032.0),
    ],
    ids=["normal", "negative", "subnormal", "large"],
)
def test_float16_rounding_is_unbiased(value, below, above):
    import torch

    from keras_dtype_policy.low_precision import torch_kernels

    size = 100_000
    working = torch.full((size,), value, dtype=torch.float32)
    stored = torch.empty(size, dtype=torch.float16)
    torch_kernels.round_to_float16(stored, working, kernel_key((11, 4242)))
    rounded = stored.double().numpy()
    # Every rounding is one of the two float16 neighbours, both taken.
    assert set(np.unique(rounded)) == {below, above}
    # 100,000 roundings, each off by at most a gap: the mean's standard
    # deviation is below 0.0016 of a gap; allow 0.01 of one.
    gap = above - below
    assert abs(rounded.mean() - value) < 0.01 * gap


def test_float16_rounding_is_the_same_on_every_path(monkeypatch):
    """Compiled and eager, the kernel stores the same bits, and they are
    the `keras.ops` rounding with the bits the kernel hashes."""
    import torch

    from keras_dtype_policy.low_precision import random_bits
    from keras_dtype_policy.low_precision import torch_kernels

    rng = np.random.default_rng(3)
    values = edge_values(rng, 5000)
    working = torch.from_numpy(values)
    key = (5, 51234)
    monkeypatch.setattr(torch_kernels, "_failed", [])
    monkeypatch.setattr(torch_kernels, "_compiled", {})
    switches = ("1", "0") if c_compiler() is not None else ("0",)
    results = []
    for switch in switches:
        monkeypatch.setenv(torch_kernels.SWITCH, switch)
        stored = torch.zeros(6000, dtype=torch.float16)
        # At an offset in its storage, as a piece of a weight is.
        torch_kernels.round_to_float16(
            stored[700:5700], working, kernel_key(key)
        )
        assert not stored[:700].any() and not stored[5700:].any()
        results.append(stored[700:5700].view(torch.int16).numpy().copy())
    assert torch_kernels._failed == []
    assert bool(torch_kernels._compiled) == (len(switches) == 2)
    mixed = keras.ops.convert_to_tensor(key[0] ^ (key[1] * 32768), "int32")
    bits = random_bits.hashed_noise(values.shape, 13, mixed)
    expected = reference(values, bits.numpy(), monkeypatch)
    for got in results:
        assert_same_bits(got, expected, values)
    # The rounding is stochastic: some values went up, some down.
    normal = np.abs(values) > 1e-3
    normal &= np.abs(values) < 6e4
    rounded = torch.from_numpy(results[0]).view(torch.float16).float()
    up = rounded.numpy()[normal] > values[normal]
    assert 0.2 < np.mean(up) < 0.8


def counting(monkeypatch, module, name):
    """Counts the calls of `module.name`, still calling it."""
    calls = []
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(args[0].dtype)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def no_portable_rounding(monkeypatch):
    """Makes the `keras.ops` stochastic rounding fail if called."""
    from keras_dtype_policy.low_precision import compensated_updates

    def refused(*args, **kwargs):
        raise AssertionError("the keras.ops stochastic rounding ran")

    monkeypatch.setattr(compensated_updates, "stochastic_round", refused)


@pytest.mark.filterwarnings("ignore::keras_dtype_policy.SlowFloat16Warning")
def test_stochastic_float16_fit_takes_the_kernel(monkeypatch):
    from keras_dtype_policy.low_precision import torch_kernels

    calls = counting(monkeypatch, torch_kernels, "round_to_float16")
    no_portable_rounding(monkeypatch)
    monkeypatch.setattr(torch_kernels, "_failed", [])
    keras.utils.set_random_seed(0)
    with keras_dtype_policy.policy_scope("stochastic_float16"):
        model = keras.Sequential(
            [
                keras.Input((8,)),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(1),
            ]
        )
    model.compile(keras.optimizers.Adam(0.01), "mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    start = [np.array(w) for w in model.get_weights()]
    history = model.fit(x, y, batch_size=16, epochs=3, verbose=0)
    # One call a step applied (all four weights of this model in one
    # group); loss scaling skips the steps whose gradients overflow.
    applied = int(keras.ops.convert_to_numpy(model.optimizer.iterations))
    assert len(calls) == applied >= 8
    # Where the kernel compiles, it compiled inside `fit` too.
    assert torch_kernels._failed == []
    assert all(dtype == "torch.float16" for dtype in map(str, calls))
    end = model.get_weights()
    for before, after in zip(start, end, strict=True):
        assert after.dtype == np.float16
        assert np.isfinite(after).all()
        assert np.abs(after.astype("float32") - before).max() > 1e-3
    losses = history.history["loss"]
    assert np.isfinite(losses).all() and losses[-1] < losses[0]


@pytest.mark.filterwarnings("ignore::keras_dtype_policy.SlowFloat16Warning")
def test_float16_weights_with_bfloat16_state_take_both_kernels(monkeypatch):
    """Mixed storage (float16 weights, bfloat16 slots) in one group is
    rounded tensor by tensor, each through its dtype's kernel."""
    from keras_dtype_policy import LowPrecisionOptimizer
    from keras_dtype_policy.low_precision import torch_kernels

    half = counting(monkeypatch, torch_kernels, "round_to_float16")
    brain = counting(monkeypatch, torch_kernels, "round_to_bfloat16")
    no_portable_rounding(monkeypatch)
    weights = [
        keras.Variable(np.full((5, 3), 0.5), dtype="float16"),
        keras.Variable(np.full((3,), -0.25), dtype="float16"),
    ]
    optimizer = LowPrecisionOptimizer(
        keras.optimizers.Adam(1e-3),
        update="stochastic_rounding",
        state_dtype="bfloat16",
        seed=1,
    )
    grads = [keras.ops.ones(w.shape, "float16") for w in weights]
    for _ in range(3):
        optimizer.apply(grads, weights)
    # Each step: two weights into float16, two moments each into bfloat16.
    assert len(half) == 6 and len(brain) == 12
    for weight, start in zip(weights, (0.5, -0.25), strict=True):
        value = keras.ops.convert_to_numpy(weight.value).astype("float32")
        assert np.isfinite(value).all()
        assert (value < start).all()


def float16_neighbours(values):
    """The float16 values just below and just above float32 `values`
    (the same where a value is a float16 value)."""
    nearest = values.astype("float16")
    too_high = nearest.astype("float32") > values
    too_low = nearest.astype("float32") < values
    below = np.where(too_high, np.nextafter(nearest, -np.inf), nearest)
    above = np.where(too_low, np.nextafter(nearest, np.inf), nearest)
    return below, above


def test_a_group_of_float16_weights_is_each_stored_in_place(monkeypatch):
    """Weights of several shapes in one group, rounded in one pass into
    staging space, each get their own values back: every stored value
    is a float16 neighbour of its exact update."""
    from keras_dtype_policy import LowPrecisionOptimizer
    from keras_dtype_policy.low_precision import torch_kernels

    calls = counting(monkeypatch, torch_kernels, "round_to_float16")
    no_portable_rounding(monkeypatch)
    rng = np.random.default_rng(7)
    shapes = [(33, 17), (17,), (5, 3, 2), (1,)]
    starts = [
        rng.normal(size=shape).astype("float16") * (i + 1)
        for i, shape in enumerate(shapes)
    ]
    grads = [rng.normal(size=shape).astype("float16") for shape in shapes]
    weights = [keras.Variable(start, dtype="float16") for start in starts]
    optimizer = LowPrecisionOptimizer(
        keras.optimizers.SGD(0.01), update="stochastic_rounding", seed=3
    )
    optimizer.apply([keras.ops.convert_to_tensor(g) for g in grads], weights)
    assert len(calls) == 1
    for weight, start, grad in zip(weights, starts, grads, strict=True):
        exact = start.astype("float32") - np.float32(0.01) * grad.astype(
            "float32"
        )
        below, above = float16_neighbours(exact)
        stored = keras.ops.convert_to_numpy(weight.value)
        assert stored.dtype == np.float16
        assert ((stored == below) | (stored == above)).all()
