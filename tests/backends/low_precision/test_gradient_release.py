"""Gradient release: each variable updated in the backward pass.

`LowPrecisionOptimizer(..., release_gradients=True)` on PyTorch updates a
variable as soon as autograd has finished its gradient and frees the
gradient there. Expectations per backend:

- PyTorch: under `fit`, every gradient is freed before the backward pass
  reaches the first layer; the weights equal the usual step's bit for bit
  where the step draws no random bits, and land on the same bfloat16
  neighbours (at most one unit in the last place apart) where it does;
  resume from a `.keras` file is exact; the conflicts are refused.
- JAX: XLA's schedule of the compiled step frees each gradient once its
  update has read it (test_step_buffers.py measures it); the argument is
  accepted without a warning and the weights equal the usual step's.
- TensorFlow: Keras' train step takes every gradient at once; the
  argument warns at `build` that the step is the usual one, and the
  weights equal the usual step's.
"""

import warnings

import keras
import numpy as np
import pytest
from testing import BACKEND
from testing import to_numpy

import keras_dtype_policy as kdp
from keras_dtype_policy.low_precision import gradient_release

TORCH_ONLY = pytest.mark.skipif(
    BACKEND != "torch",
    reason="the backward pass runs the updates on PyTorch only; JAX and "
    "TensorFlow are checked by test_other_backends_train_as_usual",
)
# Settings that draw no random bits, and ones that do.
EXACT = {
    "kahan_float32_state": ("bfloat16", "kahan", "float32"),
    "nearest_float32_state": ("bfloat16", "nearest", "float32"),
    "float32_weights": ("float32", "nearest", None),
}
RANDOM = {
    "stochastic_bfloat16": ("bfloat16", "stochastic_rounding", None),
    "stochastic_bfloat16_8bit": ("bfloat16", "stochastic_rounding", "8bit"),
    "kahan_bfloat16_4bit": ("bfloat16", "kahan", "4bit"),
}


def data():
    x = np.random.RandomState(0).randn(64, 16).astype("float32")
    y = np.random.RandomState(1).randn(64, 8).astype("float32")
    return x, y


def trained(settings, release, epochs=1, model=None, **inner):
    """Returns a model (new, or `model`) after `epochs` of `fit`."""
    if model is None:
        dtype, update, state_dtype = settings
        keras.utils.set_random_seed(1)
        model = keras.Sequential(
            [
                keras.Input((16,)),
                keras.layers.Dense(300, activation="relu", dtype=dtype),
                keras.layers.Dense(8, dtype=dtype),
            ]
        )
        optimizer = kdp.LowPrecisionOptimizer(
            keras.optimizers.Adam(1e-2, **inner),
            update=update,
            state_dtype=state_dtype,
            seed=3,
            release_gradients=release,
        )
        model.compile(optimizer, "mse")
    x, y = data()
    model.fit(x, y, batch_size=16, epochs=epochs, verbose=0, shuffle=False)
    return model


def squared_error(model, x, y):
    error = keras.ops.subtract(model(x), keras.ops.convert_to_tensor(y))
    return keras.ops.mean(keras.ops.square(error))


def weights(model):
    return [to_numpy(keras.ops.cast(w, "float32")) for w in model.weights]


def state(model):
    return [to_numpy(v) for v in model.optimizer.variables]


@TORCH_ONLY
@pytest.mark.parametrize("settings", EXACT.values(), ids=EXACT)
def test_released_step_equals_the_usual_step_bit_for_bit(settings):
    usual = trained(settings, release=False)
    released = trained(settings, release=True, clipnorm=0.5)
    clipped = trained(settings, release=False, clipnorm=0.5)
    assert usual.optimizer.iterations.numpy() == 4
    assert released.optimizer.iterations.numpy() == 4
    for got, want in zip(weights(released), weights(clipped), strict=True):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(state(released), state(clipped), strict=True):
        np.testing.assert_array_equal(got, want)
    # Clipping changed the run: the comparison is not vacuous.
    assert any(
        not np.array_equal(a, b)
        for a, b in zip(weights(usual), weights(clipped), strict=True)
    )


@TORCH_ONLY
@pytest.mark.parametrize("settings", RANDOM.values(), ids=RANDOM)
def test_random_rounding_lands_on_the_same_neighbours(settings):
    x, y = data()
    steps, states = {}, {}
    for release in (False, True):
        model = trained(settings, release=release, epochs=0)
        model.train_on_batch(x[:16], y[:16])
        steps[release] = weights(model)
        states[release] = state(model)
    # One step from the same weights: the float32 results are the same,
    # and only which bfloat16 neighbour the random bits picked differs.
    for got, want in zip(steps[True], steps[False], strict=True):
        larger = np.maximum(np.abs(got), np.abs(want))
        ulp = 2.0 ** (np.floor(np.log2(np.maximum(larger, 2.0**-126))) - 7)
        assert np.all(np.abs(got - want) <= ulp)
    for got, want in zip(states[True], states[False], strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype
    if settings[1] == "stochastic_rounding":
        # Several variables' roundings draw bits: some land elsewhere
        # (Kahan's weights draw none; here one variable's 4-bit state
        # does, from the same key in both steps).
        assert any(
            not np.array_equal(a, b)
            for a, b in zip(steps[True], steps[False], strict=True)
        ), "no rounding differed: the bits were not drawn a variable at a time"
    start = trained(settings, release=False, epochs=0).evaluate(x, y, verbose=0)
    for release in (False, True):
        model = trained(settings, release=release, epochs=3)
        assert model.evaluate(x, y, verbose=0) < 0.9 * start


@TORCH_ONLY
@pytest.mark.parametrize("bucket", [1, 2000])
def test_updates_run_inside_the_backward_pass(monkeypatch, bucket):
    # Buckets of one variable, or of several (the model has ~7.5k
    # elements; the default bucket would hold them all).
    monkeypatch.setattr(gradient_release, "BUCKET_ELEMENTS", bucket)
    model = trained(RANDOM["stochastic_bfloat16_8bit"], release=True)
    first_kernel = model.layers[0].kernel
    last_kernel = model.layers[1].kernel
    others = [v for v in model.trainable_variables if v is not first_kernel]
    seen = []

    def look(_):
        # Runs after the package's hook on the same tensor, while the
        # backward pass is still running (the first layer's gradient is
        # the last one finished).
        seen.append(
            (
                [v.value.grad is None for v in others],
                not np.array_equal(to_numpy(last_kernel), last_before[-1]),
            )
        )

    handle = first_kernel.value.register_post_accumulate_grad_hook(look)
    last_before = []
    try:
        for _ in range(2):
            last_before.append(to_numpy(last_kernel))
            x, y = data()
            model.train_on_batch(x[:16], y[:16])
    finally:
        handle.remove()
    assert len(seen) == 2
    for freed, last_moved in seen:
        assert all(freed)
        # The last layer's update already ran in the backward pass.
        assert last_moved
    assert all(v.value.grad is None for v in model.trainable_variables)


@TORCH_ONLY
def test_a_backward_pass_nobody_armed_updates_nothing():
    import torch

    model = trained(EXACT["kahan_float32_state"], release=True, epochs=0)
    usual = trained(EXACT["kahan_float32_state"], release=False, epochs=0)
    x, y = data()
    for network in (model, usual):
        network.optimizer.build(network.trainable_variables)
        before = weights(network)
        loss = squared_error(network, x[:16], y[:16])
        loss.backward()
        # A custom loop that calls no `scale_loss`: nothing moved yet.
        for got, want in zip(weights(network), before, strict=True):
            np.testing.assert_array_equal(got, want)
        variables = network.trainable_variables
        grads = [v.value.grad for v in variables]
        assert all(g is not None for g in grads)
        with torch.no_grad():
            network.optimizer.apply(grads, variables)
    for got, want in zip(weights(model), weights(usual), strict=True):
        np.testing.assert_array_equal(got, want)


@TORCH_ONLY
def test_a_second_backward_pass_before_apply_is_refused():
    model = trained(EXACT["kahan_float32_state"], release=True, epochs=0)
    model.optimizer.build(model.trainable_variables)
    x, y = data()
    model.optimizer.scale_loss(keras.ops.convert_to_tensor(1.0))
    squared_error(model, x, y).backward()
    with pytest.raises(RuntimeError, match="second gradient"):
        squared_error(model, x, y).backward()


@TORCH_ONLY
def test_an_interrupted_step_is_ended_by_the_next_one():
    model = trained(EXACT["kahan_float32_state"], release=True, epochs=0)
    model.optimizer.build(model.trainable_variables)
    x, y = data()
    model.optimizer.scale_loss(keras.ops.convert_to_tensor(1.0))
    squared_error(model, x, y).backward()
    # No `apply`: the next step's `scale_loss` abandons this one (its
    # waiting gradients dropped: the forward pass already read the
    # weights) and trains on.
    with pytest.warns(RuntimeWarning, match="waiting gradient"):
        model.train_on_batch(x[:16], y[:16])
    assert model.optimizer.iterations.numpy() == 2
    model.train_on_batch(x[:16], y[:16])
    assert model.optimizer.iterations.numpy() == 3


@TORCH_ONLY
def test_resume_from_a_file_is_exact(tmp_path):
    settings = RANDOM["stochastic_bfloat16_8bit"]
    straight = trained(settings, release=True, epochs=2)
    model = trained(settings, release=True)
    path = tmp_path / "released.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.optimizer.release_gradients is True
    trained(None, release=True, model=loaded)
    for got, want in zip(weights(loaded), weights(straight), strict=True):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(state(loaded), state(straight), strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.skipif(
    BACKEND == "torch", reason="PyTorch releases: the tests above"
)
def test_other_backends_train_as_usual():
    settings = EXACT["kahan_float32_state"]
    usual = trained(settings, release=False)
    if BACKEND == "tensorflow":
        with pytest.warns(UserWarning, match="tape.gradient"):
            released = trained(settings, release=True)
    else:
        # JAX: XLA's compiled step releases; nothing to warn about.
        with warnings.catch_warnings():
            warnings.filterwarnings("error", "release_gradients", UserWarning)
            released = trained(settings, release=True)
    for got, want in zip(weights(released), weights(usual), strict=True):
        np.testing.assert_array_equal(got, want)


def test_config_round_trips_and_defaults_to_off():
    adam = keras.optimizers.Adam()
    optimizer = kdp.LowPrecisionOptimizer(adam, release_gradients=True)
    config = optimizer.get_config()
    assert config["release_gradients"] is True
    again = kdp.LowPrecisionOptimizer.from_config(config)
    assert again.release_gradients is True
    plain = kdp.LowPrecisionOptimizer(keras.optimizers.Adam())
    assert plain.release_gradients is False
    assert "release_gradients" not in plain.get_config()


def test_conflicts_are_refused():
    with pytest.raises(TypeError, match="release_gradients='yes'"):
        kdp.LowPrecisionOptimizer(
            keras.optimizers.Adam(), release_gradients="yes"
        )
    with pytest.raises(ValueError, match="global_clipnorm=1.0"):
        kdp.LowPrecisionOptimizer(
            keras.optimizers.Adam(global_clipnorm=1.0),
            release_gradients=True,
        )
    releasing = kdp.LowPrecisionOptimizer(
        keras.optimizers.Adam(), release_gradients=True
    )
    with pytest.raises(ValueError, match="must see every gradient"):
        kdp.LossScaleOptimizer(releasing)
    with pytest.raises(ValueError, match="must see every gradient"):
        kdp.LossScaleOptimizer(releasing, dynamic=False, initial_scale=8.0)


@TORCH_ONLY
@pytest.mark.slow  # torch.compile of two train steps: about a minute.
def test_jit_compile_runs_the_step_between_compiled_parts():
    # Keras compiles the torch train step with torch.compile; the
    # wrapper's step runs eagerly between compiled parts (inside the
    # compiled graph it failed). Compiled and eager gradients differ in
    # their last bits: the released run is compared with the usual one
    # under jit_compile.
    settings = EXACT["kahan_float32_state"]
    runs, calls = {}, []
    for release in (False, True):
        model = trained(settings, release=release, epochs=0)
        if release:
            updates = model.optimizer._release_updates

            def counted(grads, variables, step, updates=updates):
                calls.append(len(variables))
                return updates(grads, variables, step)

            model.optimizer._release_updates = counted
        model.compile(model.optimizer, "mse", jit_compile=True)
        runs[release] = trained(None, release=release, model=model)
        assert model.optimizer.iterations.numpy() == 4
    for got, want in zip(
        weights(runs[True]), weights(runs[False]), strict=True
    ):
        np.testing.assert_array_equal(got, want)
    # Every variable of every step, released in the backward pass.
    assert sum(calls) == 4 * len(runs[True].trainable_variables)
