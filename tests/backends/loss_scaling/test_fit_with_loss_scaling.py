"""Loss scaling inside fit, evaluate and predict, compiled or eager."""

import keras
import numpy as np
import pytest
from testing import BACKEND
from testing import to_numpy

import keras_dtype_policy as kdp

# (run_eagerly, jit_compile) per backend. jax compiles with XLA by default;
# TensorFlow runs a tf.function, and with jit_compile=True under XLA; torch
# runs eagerly either way (its jit_compile=True means torch.compile, which is
# not part of what this package supports).
MODES = {
    "jax": [(False, "auto"), (True, "auto")],
    "tensorflow": [(False, "auto"), (False, True), (True, "auto")],
    "torch": [(False, "auto"), (True, "auto")],
}[BACKEND]


def overflowing_batches(num_batches=6, overflow_at=(2,), batch_size=8):
    """Batches whose `overflow_at` members overflow float16 (inf inputs)."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(num_batches * batch_size, 5)).astype("float32")
    y = (x[:, :1] * 0.5).astype("float32")
    for index in overflow_at:
        x[index * batch_size : (index + 1) * batch_size] *= 1e6
    return x, y


def make_model():
    with kdp.policy_scope("mixed_float16"):
        return keras.Sequential(
            [
                keras.Input((5,)),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(1, dtype="float32"),
            ]
        )


@pytest.mark.parametrize("run_eagerly, jit_compile", MODES)
@pytest.mark.parametrize("dynamic", [True, False])
def test_fit_skips_overflowing_steps(run_eagerly, jit_compile, dynamic):
    keras.utils.set_random_seed(0)
    model = make_model()
    optimizer = kdp.LossScaleOptimizer(
        keras.optimizers.Adam(1e-2), dynamic=dynamic, initial_scale=1024
    )
    model.compile(
        optimizer, "mse", run_eagerly=run_eagerly, jit_compile=jit_compile
    )
    x, y = overflowing_batches()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert model.optimizer is optimizer
    assert optimizer.skipped_steps == 1
    assert int(to_numpy(optimizer.iterations)) == 5
    assert optimizer.loss_scale == (512.0 if dynamic else 1024.0)
    for weight in model.weights:
        assert np.all(np.isfinite(to_numpy(weight)))
    clean = np.abs(x) < 1e5
    x_clean = x[clean.all(axis=1)]
    y_clean = y[clean.all(axis=1)]
    before = model.evaluate(x_clean, y_clean, verbose=0)
    model.fit(x_clean, y_clean, batch_size=8, epochs=5, verbose=0)
    assert model.evaluate(x_clean, y_clean, verbose=0) < before
    predictions = model.predict(x_clean, verbose=0)
    assert predictions.dtype == np.float32
    assert np.all(np.isfinite(predictions))


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's XLA step")
@pytest.mark.parametrize("depth", [3, 12])
def test_tensorflow_compiles_the_whole_step_of_few_variables(depth):
    # Compiling the whole loss-scaled step takes ~2.4 MiB a variable for
    # Adam: above XLA_WHOLE_STEP_VARIABLES (16) the step runs op by op, as
    # Keras' own wrapper does (issue #43), skipping overflowing steps the
    # same way.
    from keras_dtype_policy import backend_dispatch

    step = backend_dispatch.module_for("low_precision_step")
    with kdp.policy_scope("mixed_float16"):
        model = keras.Sequential(
            [keras.Input((5,))]
            + [keras.layers.Dense(8, activation="relu") for _ in range(depth)]
            + [keras.layers.Dense(1, dtype="float32")]
        )
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    x, y = overflowing_batches()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    optimizer = model.optimizer
    variables = 2 * (depth + 1)
    assert step.compiles_whole_step(range(variables)) == (depth == 3)
    assert bool(optimizer._step_cache.steps) == (depth == 3)
    # Six batches: each applied or skipped (the third overflows, and the
    # first scale of 2**15 too).
    applied = int(to_numpy(optimizer.iterations))
    skipped = int(to_numpy(optimizer._skipped_step_counter))
    assert applied + skipped == 6 and skipped >= 1 and applied >= 1
    for weight in model.trainable_weights:
        assert np.all(np.isfinite(to_numpy(weight)))
