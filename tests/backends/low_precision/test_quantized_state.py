"""LowPrecisionOptimizer with 8-bit and 4-bit optimizer state.

Each test runs on the backend KERAS_BACKEND names; every expectation holds
on tensorflow, jax and torch alike unless a test says otherwise. Weights
of 64 x 64 = 4096 elements (`MIN_QUANTIZED_SIZE`) or more get quantized
state; smaller ones keep float32 state.
"""

import pathlib
import warnings

import h5py
import keras
import numpy as np
import pytest
from testing import BACKEND
from testing import inner_optimizers
from testing import run_json_worker
from testing import to_numpy

import keras_dtype_policy
from keras_dtype_policy import LossScaleOptimizer
from keras_dtype_policy import LowPrecisionOptimizer
from keras_dtype_policy.low_precision import quantized_slots

SHAPE = (64, 128)


def as_float32(x):
    return np.asarray(to_numpy(keras.ops.cast(x, "float32")))


def state_of(optimizer):
    """Every optimizer value, by its path."""
    return {v.path: np.array(to_numpy(v)) for v in optimizer.variables}


def codes_and_scales(optimizer):
    return {
        path: value
        for path, value in state_of(optimizer).items()
        if path.endswith(("_codes", "_scales"))
    }


# The numerical check: 8-bit state against float32 state, same gradients.

# Rows of the shared table, at the rates the bounds below were measured at.
OPTIMIZERS = inner_optimizers(
    "adam",
    "sgd_momentum",
    "rmsprop",
    "lion",
    "adagrad",
    learning_rates={
        "adam": 1e-3,
        "sgd_momentum": 0.1,
        "rmsprop": 1e-3,
        "lion": 1e-4,
        "adagrad": 0.01,
    },
)
STEPS = 60


def trajectory(make_inner, state_dtype, steps=STEPS):
    """A float32 weight after `steps` steps of fixed random gradients."""
    rng = np.random.RandomState(0)
    start = (rng.randn(*SHAPE) * 0.1).astype("float32")
    weight = keras.Variable(start)
    optimizer = LowPrecisionOptimizer(
        make_inner(), state_dtype=state_dtype, seed=1
    )
    for step in range(steps):
        grad = np.random.RandomState(100 + step).randn(*SHAPE) * 0.01
        optimizer.apply(
            [keras.ops.convert_to_tensor(grad, "float32")], [weight]
        )
    return start, as_float32(weight), optimizer


# Bound: the mean absolute parameter error of 8-bit state, over 60 steps,
# is below 5% of the mean distance the float32-state reference moved the
# parameters (measured on JAX: 0.6% RMSprop, 1.3% Adagrad, 1.9% SGD
# momentum, 2.0% Adam, 2.7% Lion), and its median relative error
# |p8 - p32| / |p32| is below 2% (bitsandbytes
# bounds the mean of it for its 8-bit Adam; the median ignores the weights
# that pass through zero; measured 0.03% to 1.1% on weights ~ N(0, 0.1)).
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_eight_bit_state_follows_float32_state(name):
    start, reference, _ = trajectory(OPTIMIZERS[name], "float32")
    _, quantized, optimizer = trajectory(OPTIMIZERS[name], "8bit")
    assert codes_and_scales(optimizer)
    moved = np.abs(reference - start).mean()
    error = np.abs(quantized - reference)
    assert moved > 1e-3
    assert error.mean() < 0.05 * moved
    assert np.median(error / np.abs(reference)) < 0.02


def test_four_bit_adam_state_follows_float32_state_more_loosely():
    # 4 bits: 7 levels each side for the first moment. Measured 36% of the
    # distance moved on JAX; bound 50%, still far from no state at all.
    start, reference, _ = trajectory(OPTIMIZERS["adam"], "float32")
    _, quantized, _ = trajectory(OPTIMIZERS["adam"], "4bit")
    moved = np.abs(reference - start).mean()
    assert np.abs(quantized - reference).mean() < 0.5 * moved


# Which weights get quantized state.


def test_small_and_non_float_weights_keep_float32_state():
    big = keras.Variable(np.zeros((64, 64), "float32"), name="big")
    small = keras.Variable(np.zeros((63, 64), "float32"), name="small")
    low = keras.Variable(np.zeros((64, 64), "float32"), dtype="bfloat16")
    count = keras.Variable(np.zeros((64, 64), "int32"), trainable=False)
    optimizer = LowPrecisionOptimizer(
        keras.optimizers.Adam(1e-3), state_dtype="8bit"
    )
    assert optimizer.quantized_slots == []
    optimizer.build([big, small, low, count])
    assert quantized_slots.MIN_QUANTIZED_SIZE == 64 * 64
    # Adam's momentum (signed) and velocity (unsigned) of `big` and `low`.
    slots = optimizer.quantized_slots
    assert [s.shape for s in slots] == [(64, 64)] * 4
    assert sorted(s.code.signed for s in slots) == [False, False, True, True]
    codes = [v for v in optimizer.variables if v.path.endswith("_codes")]
    # Adam's two moments of `big` and of `low`: 16 blocks of 256 each.
    assert len(codes) == 4
    for v in codes:
        assert tuple(v.shape) == (16, 256)
        assert keras.backend.standardize_dtype(v.dtype) == "int8"
    inner = optimizer.inner_optimizer.variables
    float_slots = [v for v in inner if tuple(v.shape) == (63, 64)]
    assert len(float_slots) == 2
    for v in float_slots:
        assert keras.backend.standardize_dtype(v.dtype) == "float32"
    # No slot of the wrapper's inner optimizer has 4096 float32 elements:
    # the quantized ones are codes and scales only.
    assert not [
        v
        for v in inner
        if tuple(v.shape) == (64, 64) and keras.backend.is_float_dtype(v.dtype)
    ]
    # The float32 weights of float32 state need no float32 view: the inner
    # optimizer updates them itself.
    plain = LowPrecisionOptimizer(
        keras.optimizers.Adam(1e-3), state_dtype="float32"
    )
    plain.build([big, small])
    assert not [v for v in plain.variables if "codes" in v.path]
    assert plain.quantized_slots == []
    assert plain.compensation_of(big) is None


def test_bfloat16_weights_train_with_eight_bit_state():
    weight = keras.Variable(np.ones((64, 64), "float32"), dtype="bfloat16")
    optimizer = LowPrecisionOptimizer(
        keras.optimizers.Adam(1e-3), state_dtype="8bit", seed=0
    )
    for _ in range(10):
        optimizer.apply([keras.ops.ones((64, 64), "bfloat16")], [weight])
    values = as_float32(weight) + as_float32(optimizer.compensation_of(weight))
    # Adam's steps on a constant gradient are lr each.
    np.testing.assert_allclose(values, 1.0 - 10 * 1e-3, atol=2e-4)


@pytest.mark.parametrize(
    "state_dtype, error, fragment",
    [
        ("banana", ValueError, "Received: state_dtype='banana'"),
        ("int8", ValueError, "Received: state_dtype='int8'"),
        (8, TypeError, "Received: state_dtype=8 (of type int)"),
    ],
)
def test_bad_state_dtypes(state_dtype, error, fragment):
    pattern = fragment.replace("(", r"\(").replace(")", r"\)")
    with pytest.raises(error, match=pattern):
        LowPrecisionOptimizer(keras.optimizers.Adam(), state_dtype=state_dtype)


# Models: fit, saving and resuming.


def data(seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(64, 64).astype("float32")
    return x, (x[:, :1] * 0.5 + rng.randn(64, 1) * 0.1).astype("float32")


def model_with(make_optimizer, dtype="float32"):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(64, activation="tanh", dtype=dtype),
            keras.layers.Dense(1, dtype=dtype),
        ]
    )
    model.compile(make_optimizer(), "mse")
    return model


def eight_bit_adam():
    return LowPrecisionOptimizer(
        keras.optimizers.Adam(1e-3), state_dtype="8bit", seed=3
    )


def fit(model, seed=0, epochs=1):
    x, y = data(seed)
    return model.fit(
        x, y, batch_size=16, epochs=epochs, verbose=0, shuffle=False
    ).history["loss"]


def test_fit_trains_and_keeps_its_state_between_calls():
    # Two fits of one epoch are one fit of two: nothing of the 8-bit state
    # is lost or rewritten between the calls (on JAX, where fit hands the
    # optimizer's values back at its end).
    once = model_with(eight_bit_adam)
    losses = fit(once, epochs=2)
    twice = model_with(eight_bit_adam)
    fit(twice)
    fit(twice)
    assert losses[-1] < losses[0]
    assert int(to_numpy(twice.optimizer.iterations)) == 8
    for a, b in zip(once.weights, twice.weights, strict=True):
        np.testing.assert_array_equal(to_numpy(a), to_numpy(b))
    for path, value in codes_and_scales(once.optimizer).items():
        assert np.any(value != 0), path
    first = codes_and_scales(once.optimizer).values()
    second = codes_and_scales(twice.optimizer).values()
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("file_format", [".keras", ".weights.h5"])
def test_saved_and_resumed_exactly(file_format, tmp_path):
    # The seeded stochastic rounding draws the same bits after a load as
    # in the uninterrupted run (on torch other bits than on JAX and
    # TensorFlow, as reproducible).
    model = model_with(eight_bit_adam)
    fit(model)
    path = str(tmp_path / f"model{file_format}")
    if file_format == ".keras":
        model.save(path)
        restored = keras.saving.load_model(path)
    else:
        model.save_weights(path)
        restored = model_with(eight_bit_adam)
        restored.load_weights(path)
        restored.optimizer.build(restored.trainable_variables)
        with h5py.File(path) as saved:
            stored = []
            saved["optimizer"].visititems(
                lambda _, item: (
                    stored.append(np.asarray(item))
                    if isinstance(item, h5py.Dataset)
                    else None
                )
            )
        # The file holds codes and scales, no float32 copy of the state.
        assert any(item.dtype == np.int8 for item in stored)
        assert not [
            item
            for item in stored
            if item.dtype == np.float32 and item.size >= 4096
        ]
    assert isinstance(restored.optimizer, LowPrecisionOptimizer)
    assert restored.optimizer.state_dtype == "8bit"
    saved_state, loaded_state = (
        state_of(model.optimizer),
        state_of(restored.optimizer),
    )
    assert len(codes_and_scales(model.optimizer)) == 4
    assert len(saved_state) == len(loaded_state)
    for a, b in zip(saved_state.values(), loaded_state.values(), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    fit(model, seed=1)
    fit(restored, seed=1)
    for a, b in zip(model.weights, restored.weights, strict=True):
        np.testing.assert_array_equal(to_numpy(a), to_numpy(b))
    for a, b in zip(
        state_of(model.optimizer).values(),
        state_of(restored.optimizer).values(),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)


OTHERS = {
    "adam": lambda: keras.optimizers.Adam(1e-3),
    "float32_state": lambda: LowPrecisionOptimizer(
        keras.optimizers.Adam(1e-3), state_dtype="float32"
    ),
    "4bit": lambda: LowPrecisionOptimizer(
        keras.optimizers.Adam(1e-3), state_dtype="4bit"
    ),
}


@pytest.mark.parametrize("reverse", [False, True], ids=["from_8bit", "to_8bit"])
@pytest.mark.parametrize("other", sorted(OTHERS))
def test_state_of_another_optimizer_is_skipped_whole(other, reverse, tmp_path):
    # As Keras does it: a warning, and the optimizer starts from fresh
    # state: none of it loaded, the step count included.
    saving, loading = eight_bit_adam, OTHERS[other]
    if reverse:
        saving, loading = loading, saving
    model = model_with(saving)
    fit(model)
    path = str(tmp_path / "model.weights.h5")
    model.save_weights(path)
    restored = model_with(loading)
    restored.optimizer.build(restored.trainable_variables)
    fresh = state_of(restored.optimizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored.load_weights(path)
    assert any("Skipping variable loading" in str(w.message) for w in caught)
    for a, b in zip(model.weights, restored.weights, strict=True):
        np.testing.assert_array_equal(to_numpy(a), to_numpy(b))
    after = state_of(restored.optimizer)
    assert after.keys() == fresh.keys()
    for path_, value in fresh.items():
        np.testing.assert_array_equal(after[path_], value, err_msg=path_)
    fit(restored)
    assert int(to_numpy(restored.optimizer.iterations)) == 4


# Compiled steps and custom loops.


def apply_steps(optimizer, weight, steps=3, compiled=False):
    grads = [
        keras.ops.convert_to_tensor(
            np.random.RandomState(s).randn(*weight.shape), "float32"
        )
        for s in range(steps)
    ]
    if not compiled:
        for grad in grads:
            optimizer.apply([grad], [weight])
        return
    optimizer.build([weight])
    if BACKEND == "jax":
        import jax

        @jax.jit
        def step(optimizer_values, weight_value, grad):
            return optimizer.stateless_apply(
                optimizer_values, [grad], [weight_value]
            )

        values = [v.value for v in optimizer.variables]
        weight_value = weight.value
        for grad in grads:
            (weight_value,), values = step(values, weight_value, grad)
        weight.assign(weight_value)
        for variable, value in zip(optimizer.variables, values, strict=True):
            variable.assign(value)
    else:
        import tensorflow as tf

        step = tf.function(
            lambda grad: optimizer.apply([grad], [weight]), jit_compile=True
        )
        for grad in grads:
            step(grad)


@pytest.mark.skipif(
    BACKEND == "torch", reason="torch runs eagerly: Keras has no jit there"
)
def test_a_compiled_step_is_the_eager_step():
    # jax.jit of stateless_apply on JAX; tf.function(jit_compile=True) on
    # TensorFlow. XLA may fuse the arithmetic differently: weights agree
    # to float32 rounding, codes to one level.
    def run(compiled):
        weight = keras.Variable(np.ones(SHAPE, "float32"))
        optimizer = eight_bit_adam()
        apply_steps(optimizer, weight, compiled=compiled)
        return as_float32(weight), codes_and_scales(optimizer)

    eager_weight, eager_state = run(False)
    compiled_weight, compiled_state = run(True)
    np.testing.assert_allclose(compiled_weight, eager_weight, atol=1e-6)
    assert len(eager_state) == len(compiled_state) == 4
    for (path, value), other in zip(
        eager_state.items(), compiled_state.values(), strict=True
    ):
        if path.endswith("_codes"):
            difference = np.abs(value.astype(int) - other.astype(int))
            assert difference.max() <= 1 and difference.mean() < 0.01
        else:
            np.testing.assert_allclose(other, value, rtol=1e-5)


def test_custom_loop_with_a_gradient_tape_or_its_backend_twin():
    model = model_with(eight_bit_adam)
    optimizer = model.optimizer
    x, y = data()
    losses = []
    for _ in range(8):
        loss, grads = loss_and_gradients(model, x, y)
        losses.append(loss)
        optimizer.apply(grads, model.trainable_variables)
    assert losses[-1] < losses[0]
    assert int(to_numpy(optimizer.iterations)) == 8
    assert all(np.any(v != 0) for v in codes_and_scales(optimizer).values())


def loss_and_gradients(model, x, y):
    variables = model.trainable_variables
    x, y = keras.ops.convert_to_tensor(x), keras.ops.convert_to_tensor(y)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            loss = keras.ops.mean((model(x) - y) ** 2)
        return float(loss), tape.gradient(loss, variables)
    if BACKEND == "torch":
        model.zero_grad()
        loss = keras.ops.mean((model(x) - y) ** 2)
        loss.backward()
        return loss.item(), [v.value.grad for v in variables]
    import jax

    def compute(values):
        outputs, _ = model.stateless_call(
            values, model.non_trainable_variables, x
        )
        return keras.ops.mean((outputs - y) ** 2)

    loss, grads = jax.value_and_grad(compute)([v.value for v in variables])
    return float(loss), grads


# Loss scaling around 8-bit state for float16 weights.


def test_loss_scaling_skips_a_step_with_infinite_gradients():
    weight = keras.Variable(np.ones((64, 64), "float32"), dtype="float16")
    optimizer = LossScaleOptimizer(
        LowPrecisionOptimizer(
            keras.optimizers.Adam(1e-3), state_dtype="8bit", seed=0
        )
    )
    grad = np.random.RandomState(0).randn(64, 64).astype("float16")
    for _ in range(2):
        optimizer.apply([keras.ops.convert_to_tensor(grad)], [weight])
    before = state_of(optimizer.inner_optimizer)
    weight_before = as_float32(weight)
    spoiled = grad.copy()
    spoiled[0, 0] = np.inf
    optimizer.apply([keras.ops.convert_to_tensor(spoiled)], [weight])
    assert optimizer.skipped_steps == 1
    np.testing.assert_array_equal(as_float32(weight), weight_before)
    after = state_of(optimizer.inner_optimizer)
    assert len(codes_and_scales(optimizer.inner_optimizer)) == 4
    for path, value in before.items():
        np.testing.assert_array_equal(after[path], value, err_msg=path)
    optimizer.apply([keras.ops.convert_to_tensor(grad)], [weight])
    assert not np.array_equal(as_float32(weight), weight_before)
    for value in state_of(optimizer).values():
        if value.dtype.kind == "f":
            assert np.all(np.isfinite(value))
    assert np.all(np.isfinite(as_float32(weight)))


# Data parallelism: JAX DataParallel, tf.distribute.

WORKER = pathlib.Path(__file__).with_name("quantized_state_worker.py")
ROOT = pathlib.Path(__file__).resolve().parents[3]


@pytest.mark.skipif(
    BACKEND not in ("jax", "tensorflow"),
    reason="DataParallel on JAX and tf.distribute on TensorFlow; torch's "
    "multi-device training is not covered here",
)
def test_two_devices_train_as_one_and_save_the_state(tmp_path):
    runs = run_json_worker(WORKER, tmp_path)
    single, distributed = runs["single"], runs["distributed"]
    np.testing.assert_allclose(
        distributed["losses"], single["losses"], rtol=0.01
    )
    assert distributed["losses"][-1] < distributed["losses"][0]
    for a, b in zip(single["weights"], distributed["weights"], strict=True):
        # Two orders of summing the gradient, then stochastic rounding of
        # the state: measured differences ~1e-5 on weights ~0.1; a missed
        # or doubled update (lr 1e-2, 12 steps) would be ~1e-2.
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-3)
    assert distributed["codes"] == 2
    assert distributed["reloaded_exactly"]
    assert keras_dtype_policy.LowPrecisionOptimizer is LowPrecisionOptimizer
