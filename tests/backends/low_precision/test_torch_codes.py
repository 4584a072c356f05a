"""Block codes on torch: compiled kernels and eager operations.

`torch_codes` writes a piece of a quantized slot as codes and scales, as
one compiled kernel each way where `torch.compile` works
(`torch_kernels`), else as eager in-place torch operations. Both must be
`block_codes` bit for bit when rounding to nearest; with stochastic
rounding both must be unbiased, and the compiled kernel must be the eager
operations bit for bit when given the same random bits.
"""

import warnings

import keras
import numpy as np
import pytest
from testing import BACKEND

pytestmark = pytest.mark.skipif(
    BACKEND != "torch", reason="torch's own kernels for block codes"
)


def c_compiler():
    from keras_dtype_policy.low_precision import torch_kernels

    return torch_kernels.c_compiler()


@pytest.fixture(params=["compiled", "eager"])
def codes_path(request, monkeypatch):
    """Runs a test on the compiled kernels, then on eager operations."""
    from keras_dtype_policy.low_precision import torch_kernels

    compiled = request.param == "compiled"
    if compiled and c_compiler() is None:
        pytest.skip(
            "no C++ compiler here, so torch.compile cannot build CPU "
            "kernels: only the eager operations run on this machine"
        )
    monkeypatch.setenv(torch_kernels.SWITCH, "1" if compiled else "0")
    monkeypatch.setattr(torch_kernels, "_failed", [])
    calls = []
    run = torch_kernels.run

    def counted(*args):
        calls.append(args[0])
        return run(*args)

    monkeypatch.setattr(torch_kernels, "run", counted)
    yield request.param
    assert torch_kernels._failed == []
    assert bool(calls) == compiled


def coded_values(code, blocks, rng):
    """Values of every kind a block meets: scales far apart, zeros, a
    block of zeros, negatives in an unsigned slot, infinities, NaN."""
    values = rng.normal(size=(blocks, code.block)).astype("float32")
    values *= rng.lognormal(0.0, 5.0, size=(blocks, 1)).astype("float32")
    if not code.signed:
        values = values**2
        values[2, 5] = -values[2, 5]
    values[0] = 0.0
    values[1, ::3] = 0.0
    values[3, 7] = np.inf
    values[4, 9] = np.nan
    values[5, 11] = -np.inf
    return values.reshape(-1)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("signed", [True, False])
def test_torch_codes_are_block_codes_bit_for_bit(bits, signed, codes_path):
    import torch

    from keras_dtype_policy.low_precision import block_codes
    from keras_dtype_policy.low_precision import torch_codes

    code = block_codes.code_for(bits, signed)
    values = torch.from_numpy(coded_values(code, 40, np.random.default_rng(0)))
    finite = torch.where(torch.isfinite(values), values, 0.0)
    # With an infinity or NaN a piece goes through block_codes itself.
    for given in (values, finite):
        expected = block_codes.quantize(given, code)
        codes = torch.empty_like(expected[0])
        scales = torch.empty_like(expected[1])
        scratch = [
            torch.empty(given.numel())
            for _ in range(torch_codes.SCRATCH_TENSORS)
        ]
        torch_codes.quantize(given.clone(), codes, scales, code, scratch)
        np.testing.assert_array_equal(codes.numpy(), expected[0].numpy())
        np.testing.assert_array_equal(
            scales.numpy().view("int32"), expected[1].numpy().view("int32")
        )
        out = torch.empty(given.numel())
        torch_codes.dequantize(out, codes, scales, code, scratch[0])
        dequantized = block_codes.dequantize(codes, scales, code)
        np.testing.assert_array_equal(
            out.numpy().view("int32"), dequantized.numpy().view("int32")
        )


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("signed", [True, False])
def test_torch_codes_round_stochastically_without_bias(
    bits, signed, codes_path
):
    import torch

    from keras_dtype_policy.low_precision import block_codes
    from keras_dtype_policy.low_precision import random_bits
    from keras_dtype_policy.low_precision import torch_codes

    code = block_codes.code_for(bits, signed)
    # Each block: one 1.0 (its scale) and values between two levels.
    blocks = 64
    values = torch.full((blocks * code.block,), 0.3)
    values[:: code.block] = 1.0
    noise = random_bits.TorchNoise(3)
    codes = torch.empty((blocks, code.bytes_per_block), dtype=torch.int8)
    scales = torch.empty(blocks)
    scratch = [
        torch.empty(values.numel()) for _ in range(torch_codes.SCRATCH_TENSORS)
    ]
    total = torch.zeros(values.numel())
    out = torch.empty(values.numel())
    rounds = 20
    for _ in range(rounds):
        torch_codes.quantize(
            values.clone(), codes, scales, code, scratch, noise
        )
        torch_codes.dequantize(out, codes, scales, code, scratch[0])
        total += out
    mean = float((total / rounds).reshape(blocks, -1)[:, 1:].mean())
    # About 160,000 draws, each off by at most a level gap (< 0.3).
    assert abs(mean - 0.3) < 3e-3


def keyed_noise(key):
    """A `TorchNoise` whose bits are the compiled kernels' hash: `int32(2)`
    gives the key, `uint16` the eager operations' bits."""
    from keras_dtype_policy.low_precision import random_bits

    class KeyedNoise(random_bits.TorchNoise):
        def __init__(self):
            import torch

            self.device = torch.device("cpu")
            self.key = key

        def int32(self, size, bits=16):
            import torch

            assert (size, bits) == (2, 16)
            return torch.tensor(self.key, dtype=torch.int32)

        def uint16(self, size):
            from keras_dtype_policy.low_precision import random_bits

            first, second = self.key
            key = keras.ops.convert_to_tensor(first ^ (second * 32768), "int32")
            bits = random_bits.hashed_noise((size,), 16, key)
            return keras.ops.convert_to_numpy(bits).astype("uint16")

    return KeyedNoise()


def quantized(values, code, noise=None):
    """`torch_codes.quantize` then `dequantize` of `values`."""
    import torch

    from keras_dtype_policy.low_precision import torch_codes

    blocks = values.numel() // code.block
    codes = torch.empty((blocks, code.bytes_per_block), dtype=torch.int8)
    scales = torch.empty(blocks)
    scratch = [
        torch.empty(values.numel()) for _ in range(torch_codes.SCRATCH_TENSORS)
    ]
    torch_codes.quantize(values.clone(), codes, scales, code, scratch, noise)
    out = torch.empty(values.numel())
    torch_codes.dequantize(out, codes, scales, code, scratch[0])
    return codes.numpy(), scales.numpy().view("int32"), out.numpy()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("signed", [True, False])
def test_compiled_stochastic_codes_are_eager_ones_given_the_same_bits(
    bits, signed, monkeypatch
):
    import torch

    from keras_dtype_policy.low_precision import block_codes
    from keras_dtype_policy.low_precision import torch_kernels

    if c_compiler() is None:
        pytest.skip("no C++ compiler here: torch.compile cannot run")
    code = block_codes.code_for(bits, signed)
    rng = np.random.default_rng(1)
    values = coded_values(code, 40, rng)
    finite = torch.from_numpy(np.where(np.isfinite(values), values, 0.0))
    monkeypatch.setattr(torch_kernels, "_failed", [])
    results = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(torch_kernels.SWITCH, switch)
        results[switch] = quantized(finite, code, keyed_noise((40961, 65535)))
    assert torch_kernels._failed == []
    for compiled, eager in zip(results["1"], results["0"], strict=True):
        np.testing.assert_array_equal(compiled, eager)
    # And the key matters: another one moves some codes.
    other = quantized(finite, code, keyed_noise((7, 3)))
    assert np.mean(other[0] != results["1"][0]) > 0.01


def test_a_compile_failure_warns_once_then_runs_eagerly(monkeypatch):
    import torch

    from keras_dtype_policy.low_precision import block_codes
    from keras_dtype_policy.low_precision import torch_kernels

    def no_compiler(function, **options):
        def fails(*args, **kwargs):
            raise RuntimeError("InvalidCxxCompiler: no working C++ compiler")

        return fails

    monkeypatch.setenv(torch_kernels.SWITCH, "1")
    monkeypatch.setattr(torch_kernels, "_compiled", {})
    monkeypatch.setattr(torch_kernels, "_failed", [])
    monkeypatch.setattr(torch, "compile", no_compiler)
    code = block_codes.code_for(8, True)
    values = torch.from_numpy(
        np.random.default_rng(2).normal(size=8 * code.block).astype("float32")
    )
    with pytest.warns(RuntimeWarning, match="torch.compile failed") as caught:
        first = quantized(values, code)
        second = quantized(values, code)
    assert len(caught) == 1
    assert "InvalidCxxCompiler" in str(caught[0].message)
    assert not torch_kernels.enabled()
    expected = block_codes.quantize(values, code)
    np.testing.assert_array_equal(first[0], expected[0].numpy())
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_switch_keeps_the_eager_operations(monkeypatch):
    import torch

    from keras_dtype_policy.low_precision import block_codes
    from keras_dtype_policy.low_precision import torch_kernels

    def never(*args, **kwargs):
        raise AssertionError("torch.compile was called")

    monkeypatch.setenv(torch_kernels.SWITCH, "0")
    monkeypatch.setattr(torch_kernels, "_compiled", {})
    monkeypatch.setattr(torch, "compile", never)
    code = block_codes.code_for(8, False)
    values = torch.rand(4 * code.block)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        codes, _, _ = quantized(values, code)
    assert not torch_kernels.enabled()
    np.testing.assert_array_equal(
        codes, block_codes.quantize(values, code)[0].numpy()
    )


@pytest.mark.parametrize("update", ["nearest", "stochastic_rounding"])
def test_a_step_on_compiled_kernels(update, monkeypatch):
    # Rounded to nearest, a step on compiled kernels is the eager step
    # bit for bit. Stochastically, each path draws its own bits (the
    # compiled kernel hashes a key, the eager operations read a stream):
    # both are reproducible from the seed, and they agree on average.
    from keras_dtype_policy import LowPrecisionOptimizer
    from keras_dtype_policy.low_precision import torch_kernels

    if c_compiler() is None:
        pytest.skip("no C++ compiler here: torch.compile cannot run")
    monkeypatch.setattr(torch_kernels, "_failed", [])
    rng = np.random.default_rng(3)
    start = rng.normal(size=(300, 260)).astype("float32")
    grads = [rng.normal(size=start.shape).astype("float32") for _ in range(3)]

    def train(switch):
        monkeypatch.setenv(torch_kernels.SWITCH, switch)
        weight = keras.Variable(start, dtype="float32")
        optimizer = LowPrecisionOptimizer(
            keras.optimizers.Adam(1e-2),
            update=update,
            state_dtype="8bit",
            seed=5,
        )
        for grad in grads:
            optimizer.apply([keras.ops.convert_to_tensor(grad)], [weight])
        codes = [
            keras.ops.convert_to_numpy(s.codes)
            for s in optimizer.quantized_slots
        ]
        return keras.ops.convert_to_numpy(weight), codes

    compiled, compiled_codes = train("1")
    again, again_codes = train("1")
    eager, eager_codes = train("0")
    assert torch_kernels._failed == []
    assert len(compiled_codes) == 2
    np.testing.assert_array_equal(compiled, again)
    if update == "nearest":
        np.testing.assert_array_equal(compiled, eager)
        for a, b in zip(compiled_codes, eager_codes, strict=True):
            np.testing.assert_array_equal(a, b)
    else:
        # Each of the 3 steps moves a weight by at most about the
        # learning rate, 1e-2: other codes change a step's size a little.
        np.testing.assert_allclose(compiled, eager, atol=1e-2)
        moved = np.mean(np.abs(eager - start))
        assert np.mean(np.abs(compiled - eager)) < 0.02 * moved


def test_compiled_bfloat16_rounding_is_the_eager_one_given_the_same_bits(
    monkeypatch,
):
    import torch

    from keras_dtype_policy.low_precision import torch_kernels
    from keras_dtype_policy.low_precision import torch_step

    if c_compiler() is None:
        pytest.skip("no C++ compiler here: torch.compile cannot run")
    rng = np.random.default_rng(4)
    values = rng.normal(size=5000).astype("float32")
    values *= rng.lognormal(0.0, 8.0, size=5000).astype("float32")
    values[:4] = [np.inf, -np.inf, 3.3e38, -0.0]
    values[4] = np.nan
    working = torch.from_numpy(values)
    monkeypatch.setattr(torch_kernels, "_failed", [])
    results = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(torch_kernels.SWITCH, switch)
        stored = torch.zeros(6000, dtype=torch.bfloat16)
        # At an offset in its storage, as a piece of a weight is.
        torch_step.store_rounded(
            stored[700:5700], working, keyed_noise((3, 60000))
        )
        results[switch] = stored.view(torch.int16).numpy().copy()
    assert torch_kernels._failed == []
    compiled, eager = results["1"], results["0"]
    # Bit for bit but for the NaN, a NaN either way (its sign and payload
    # are the conversion's).
    nan = 700 + 4
    finite = np.arange(6000) != nan
    np.testing.assert_array_equal(compiled[finite], eager[finite])
    as_float = torch.from_numpy(compiled).view(torch.bfloat16).float()
    assert torch.isnan(as_float[nan])
    # The rounding is stochastic: some values went up, some down.
    rounded = as_float[700:5700].numpy()
    assert 0.2 < np.mean(rounded[5:] > values[5:]) < 0.8


def test_compiled_kernels_write_only_their_piece(codes_path):
    # Pieces of slots of several sizes at several offsets, in one process:
    # each kernel writes exactly its piece of the codes and scales (a
    # kernel that sliced whole storages itself once wrote past its piece
    # after a recompilation for a larger slot).
    import torch

    from keras_dtype_policy.low_precision import block_codes
    from keras_dtype_policy.low_precision import torch_codes

    code = block_codes.code_for(8, True)
    rng = np.random.default_rng(5)
    arena = torch.from_numpy(rng.normal(size=20 * code.block).astype("f4"))
    for total in (20, 32, 45):
        codes = torch.zeros((total, code.bytes_per_block), dtype=torch.int8)
        scales = torch.zeros(total)
        for first in range(0, total - 1, 3):
            stop = min(first + 3, total)
            size = (stop - first) * code.block
            values = arena[first * 7 : first * 7 + size]
            before = codes.clone(), scales.clone()
            scratch = [torch.empty(size) for _ in range(4)]
            torch_codes.quantize(
                values.clone(),
                codes[first:stop],
                scales[first:stop],
                code,
                scratch,
            )
            expected = block_codes.quantize(values, code)
            np.testing.assert_array_equal(
                codes[first:stop].numpy(), expected[0].numpy()
            )
            outside = np.ones(total, bool)
            outside[first:stop] = False
            np.testing.assert_array_equal(
                codes.numpy()[outside], before[0].numpy()[outside]
            )
            np.testing.assert_array_equal(
                scales.numpy()[outside], before[1].numpy()[outside]
            )
