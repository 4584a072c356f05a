"""Block codes and bfloat16 rounding on torch: every path, the same bits.

`torch_kernels` runs `torch_numerics`' functions as one compiled kernel
each where `torch.compile` works, else eagerly as they are. Rounding to
nearest, both paths must be `block_codes` (the `keras.ops` reference)
bit for bit; rounding stochastically, both paths and the reference must
agree bit for bit given the same random bits, and be unbiased.
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
    """Runs a test on the compiled kernels, then eagerly."""
    from keras_dtype_policy.low_precision import torch_kernels

    compiled = request.param == "compiled"
    if compiled and c_compiler() is None:
        pytest.skip(
            "no C++ compiler here, so torch.compile cannot build CPU "
            "kernels: only the eager operations run on this machine"
        )
    monkeypatch.setenv(torch_kernels.SWITCH, "1" if compiled else "0")
    monkeypatch.setattr(torch_kernels, "_failed", [])
    monkeypatch.setattr(torch_kernels, "_compiled", {})
    yield request.param
    assert torch_kernels._failed == []
    assert bool(torch_kernels._compiled) == compiled


def coded_values(code, blocks, rng):
    """Values of every kind a block meets: scales far apart, zeros, a
    block of zeros, a block of a tiny scale, negatives in an unsigned
    slot, infinities, NaN."""
    values = rng.normal(size=(blocks, code.block)).astype("float32")
    values *= rng.lognormal(0.0, 5.0, size=(blocks, 1)).astype("float32")
    if not code.signed:
        values = values**2
        values[2, 5] = -values[2, 5]
    values[0] = 0.0
    values[1, ::3] = 0.0
    # A scale of 1e-30: `block_codes.TINY_SCALE`'s case.
    values[6] *= np.float32(1e-30) / np.abs(values[6]).max()
    values[3, 7] = np.inf
    values[4, 9] = np.nan
    values[5, 11] = -np.inf
    return values.reshape(-1)


def quantized(values, code, key=None):
    """`torch_kernels.quantize` then `dequantize` of `values`: codes,
    scales (as int32 bits) and the values they stand for."""
    import torch

    from keras_dtype_policy.low_precision import torch_kernels

    blocks = values.numel() // code.block
    codes = torch.empty((blocks, code.bytes_per_block), dtype=torch.int8)
    scales = torch.empty(blocks)
    given = values.clone()
    torch_kernels.quantize(given, codes, scales, code, key)
    assert torch.equal(given.view(torch.int32), values.view(torch.int32))
    out = torch.empty(values.numel())
    torch_kernels.dequantize(out, codes, scales, code)
    return codes.numpy(), scales.numpy().view("int32"), out.numpy()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("signed", [True, False])
def test_torch_codes_are_block_codes_bit_for_bit(bits, signed, codes_path):
    import torch

    from keras_dtype_policy.low_precision import block_codes

    code = block_codes.code_for(bits, signed)
    values = torch.from_numpy(coded_values(code, 40, np.random.default_rng(0)))
    finite = torch.where(torch.isfinite(values), values, 0.0)
    # With an infinity or NaN a piece goes through block_codes itself.
    for given in (values, finite):
        expected = block_codes.quantize(given, code)
        codes, scales, out = quantized(given, code)
        np.testing.assert_array_equal(codes, expected[0].numpy())
        np.testing.assert_array_equal(scales, expected[1].numpy().view("int32"))
        dequantized = block_codes.dequantize(*expected, code)
        np.testing.assert_array_equal(
            out.view("int32"), dequantized.numpy().view("int32")
        )


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("signed", [True, False])
def test_torch_codes_round_stochastically_without_bias(
    bits, signed, codes_path
):
    import torch

    from keras_dtype_policy.low_precision import block_codes
    from keras_dtype_policy.low_precision import torch_noise

    code = block_codes.code_for(bits, signed)
    # Each block: one 1.0 (its scale) and values between two levels.
    blocks = 64
    values = torch.full((blocks * code.block,), 0.3)
    values[:: code.block] = 1.0
    noise = torch_noise.TorchNoise(3)
    total = np.zeros(values.numel())
    rounds = 20
    for _ in range(rounds):
        total += quantized(values, code, noise.kernel_key())[2]
    mean = float((total / rounds).reshape(blocks, -1)[:, 1:].mean())
    # About 160,000 draws, each off by at most a level gap (< 0.3).
    assert abs(mean - 0.3) < 3e-3


def hashed_reference(monkeypatch, key):
    """Makes `random_bits.rounding_noise` (the `keras.ops` reference's
    bits) the hash the kernels compute from `key`: the reference then
    rounds with the kernels' bits."""
    from keras_dtype_policy.low_precision import random_bits

    first, second = key
    mixed = keras.ops.convert_to_tensor(first ^ (second * 32768), "int32")

    def hashed(shape, bits, seed):
        return random_bits.hashed_noise(shape, bits, mixed)

    monkeypatch.setattr(random_bits, "rounding_noise", hashed)


def kernel_key(key):
    import torch

    return torch.tensor(key, dtype=torch.int32)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("signed", [True, False])
def test_stochastic_codes_are_the_same_on_every_path(bits, signed, monkeypatch):
    import torch

    from keras_dtype_policy.low_precision import block_codes
    from keras_dtype_policy.low_precision import torch_kernels

    code = block_codes.code_for(bits, signed)
    rng = np.random.default_rng(1)
    values = coded_values(code, 40, rng)
    finite = torch.from_numpy(np.where(np.isfinite(values), values, 0.0))
    key = (40961, 65535)
    monkeypatch.setattr(torch_kernels, "_failed", [])
    switches = ("1", "0") if c_compiler() is not None else ("0",)
    results = []
    for switch in switches:
        monkeypatch.setenv(torch_kernels.SWITCH, switch)
        results.append(quantized(finite, code, kernel_key(key)))
    assert torch_kernels._failed == []
    with monkeypatch.context() as patch:
        hashed_reference(patch, key)
        expected = block_codes.quantize(finite, code, seed=0)
    for codes, scales, _ in results:
        np.testing.assert_array_equal(codes, expected[0].numpy())
        np.testing.assert_array_equal(scales, expected[1].numpy().view("int32"))
    # And the key matters: another one moves some codes.
    other = quantized(finite, code, kernel_key((7, 3)))
    assert np.mean(other[0] != results[0][0]) > 0.01


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
def test_a_step_on_compiled_kernels_is_the_eager_step(update, monkeypatch):
    # Both paths run the same functions on the same bits (the kernels
    # hash keys drawn from the step's stream): the same step bit for bit.
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
    np.testing.assert_array_equal(compiled, eager)
    for a, b in zip(compiled_codes, eager_codes, strict=True):
        np.testing.assert_array_equal(a, b)
    assert np.mean(np.abs(eager - start)) > 1e-3


def test_bfloat16_rounding_is_the_same_on_every_path(monkeypatch):
    import torch

    from keras_dtype_policy.low_precision import compensated_updates
    from keras_dtype_policy.low_precision import torch_kernels

    rng = np.random.default_rng(4)
    values = rng.normal(size=5000).astype("float32")
    values *= rng.lognormal(0.0, 8.0, size=5000).astype("float32")
    values[:4] = [np.inf, -np.inf, 3.3e38, -0.0]
    values[4] = np.nan
    working = torch.from_numpy(values)
    key = (3, 60000)
    monkeypatch.setattr(torch_kernels, "_failed", [])
    switches = ("1", "0") if c_compiler() is not None else ("0",)
    results = []
    for switch in switches:
        monkeypatch.setenv(torch_kernels.SWITCH, switch)
        stored = torch.zeros(6000, dtype=torch.bfloat16)
        # At an offset in its storage, as a piece of a weight is.
        torch_kernels.round_to_bfloat16(
            stored[700:5700], working, kernel_key(key)
        )
        assert not stored[:700].any() and not stored[5700:].any()
        results.append(stored[700:5700].view(torch.int16).numpy().copy())
    assert torch_kernels._failed == []
    with monkeypatch.context() as patch:
        hashed_reference(patch, key)
        reference = compensated_updates.stochastic_round(working, "bfloat16", 0)
    results.append(reference.view(torch.int16).numpy())
    # Bit for bit but for the NaN, a NaN either way (its sign and payload
    # are the conversion's).
    finite = np.arange(5000) != 4
    for got in results[1:]:
        np.testing.assert_array_equal(got[finite], results[0][finite])
    for got in results:
        as_float = torch.from_numpy(got).view(torch.bfloat16).float()
        assert torch.isnan(as_float[4])
    # The rounding is stochastic: some values went up, some down.
    rounded = as_float.numpy()
    assert 0.2 < np.mean(rounded[5:] > values[5:]) < 0.8


def test_compiled_kernels_write_only_their_piece(codes_path):
    # Pieces of slots of several sizes at several offsets, in one process:
    # each kernel writes exactly its piece of the codes and scales (a
    # kernel that sliced whole storages itself once wrote past its piece
    # after a recompilation for a larger slot).
    import torch

    from keras_dtype_policy.low_precision import block_codes
    from keras_dtype_policy.low_precision import torch_kernels

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
            torch_kernels.quantize(
                values, codes[first:stop], scales[first:stop], code
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


def test_adam_update_compiled_and_eager_agree_bit_for_bit():
    """The compiled kernel takes Adam's square root in float32 and the
    eager path in float64 (torch's eager float32 root is an ulp off on
    ~0.7% of values on a CPU): both must round to the same bits."""
    import torch

    from keras_dtype_policy.low_precision import torch_numerics

    if c_compiler() is None:
        pytest.skip("no C++ compiler here, so nothing compiles to compare")
    generator = torch.Generator().manual_seed(0)
    size = 1 << 16
    weights, grads, m = (
        torch.randn(size, generator=generator) for _ in range(3)
    )
    v = torch.rand(size, generator=generator) * 10.0 ** torch.randint(
        -12, 2, (size,), generator=generator
    )
    hyper = torch_numerics.AdamHyperparameters(
        0.9, 0.1, 0.999, 0.001, 1e-3, 1e-7, 0.0
    )

    def step(weights, grads, m, v):
        return torch_numerics.adam_update(weights, grads, m, v, hyper)

    eager = step(weights, grads, m, v)
    compiled = torch.compile(step)(weights, grads, m, v)
    for mine, theirs in zip(compiled, eager, strict=True):
        np.testing.assert_array_equal(
            mine.numpy().view("int32"), theirs.numpy().view("int32")
        )
