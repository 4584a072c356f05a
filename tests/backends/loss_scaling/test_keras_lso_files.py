"""Moving between Keras' own LossScaleOptimizer and the package's.

Files written by Keras alone with its `keras.optimizers.LossScaleOptimizer`
(tests/fixtures/keras_lso, made by its make_fixtures.py without the
package) load exactly with the package: weights, every optimizer slot, the
scale, its counter and the step count. The other way, Keras alone (in a
process that never imports the package) reads the package's .keras and
.weights.h5 files exactly (all but the count of skipped steps, which
Keras' wrapper does not keep), and the weights of its .h5 files, loaded
uncompiled: an .h5 file names the package's optimizer class (see
README.md, "Saving and resuming").
"""

import logging
import os
import pathlib
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest
from testing import to_numpy

import keras_dtype_policy as kdp

# One xdist worker takes the whole module (`--dist loadgroup`), so its
# module fixture, which trains and saves for a while, runs once a run.
pytestmark = pytest.mark.xdist_group("keras_lso_files")

FIXTURES = pathlib.Path(__file__).resolve().parents[2] / "fixtures"
KERAS_LSO = FIXTURES / "keras_lso"
READER = pathlib.Path(__file__).with_name("keras_alone_reader.py")


def optimizer_values(optimizer):
    """The optimizer's values in the layout of Keras' own wrapper."""
    # The package's own state (skipped steps, the non-finite steps in a
    # row and the attribution of skipped steps) is saved apart.
    own = (
        "/skipped_steps",
        "/nonfinite_steps_in_a_row",
        "/nonfinite_gradient_counts",
        "/last_nonfinite_gradients",
    )
    return [
        to_numpy(v) for v in optimizer.variables if not v.path.endswith(own)
    ]


def load_quietly(path, caplog):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with caplog.at_level(logging.WARNING):
            model = keras.saving.load_model(path)
    messages = [str(w.message) for w in caught]
    messages += [r.getMessage() for r in caplog.records]
    for message in messages:
        assert "Skipping variable loading" not in message
        assert "freshly initialized optimizer" not in message
    return model


@pytest.mark.parametrize("file_format", ["keras", "h5"])
@pytest.mark.parametrize("name", ["auto_wrapped", "explicit"])
def test_keras_lso_files_load_exactly(name, file_format, caplog):
    expected = np.load(KERAS_LSO / f"{name}.expected.npz")
    model = load_quietly(KERAS_LSO / f"{name}.{file_format}", caplog)
    optimizer = model.optimizer
    if name == "auto_wrapped" or file_format == "h5":
        # The file names Adam only: the package wraps it, as Keras did. An
        # .h5 file names its wrapper "LossScaleOptimizer", as tf.keras 2
        # files do, which the package reads as its own.
        assert type(optimizer) is kdp.LossScaleOptimizer
    else:
        # Keras' own wrapper, passed explicitly, is the user's choice.
        assert type(optimizer) is keras.optimizers.LossScaleOptimizer
    # The inner step count is set at once, even before an .h5 file's state
    # waits for the first real build (not the wrapper's own count, 0).
    assert to_numpy(optimizer.iterations) == expected["iterations"]
    if not optimizer.built:
        optimizer.build(model.trainable_variables)

    for i, weight in enumerate(model.weights):
        np.testing.assert_array_equal(to_numpy(weight), expected[f"weight_{i}"])
    values = optimizer_values(optimizer)
    assert len(values) == len([k for k in expected if "optimizer_" in k])
    for i, value in enumerate(values):
        np.testing.assert_array_equal(value, expected[f"optimizer_{i}"])
    assert to_numpy(optimizer.dynamic_scale) == expected["loss_scale"]
    assert to_numpy(optimizer.step_counter) == expected["step_counter"]
    assert to_numpy(optimizer.iterations) == expected["iterations"]
    # The fixtures' runs counted steps, one skipped: not a fresh state.
    assert expected["iterations"] > 0
    assert expected["step_counter"] > 0
    if isinstance(optimizer, kdp.LossScaleOptimizer):
        assert optimizer.skipped_steps == 0  # Keras' wrapper keeps no count


def package_model():
    keras.utils.set_random_seed(0)
    with kdp.policy_scope("mixed_float16"):
        model = keras.Sequential(
            [
                keras.Input((3,)),
                keras.layers.Dense(4, activation="relu"),
                keras.layers.Dense(1, dtype="float32"),
            ]
        )
    model.compile(keras.optimizers.Adam(0.01), "mse")
    return model


@pytest.fixture(scope="module")
def read_by_keras_alone(tmp_path_factory):
    """The package's files, and what Keras alone read from them."""
    work_dir = tmp_path_factory.mktemp("keras_alone")
    model = package_model()
    assert type(model.optimizer) is kdp.LossScaleOptimizer
    rng = np.random.default_rng(0)
    x = rng.normal(size=(20, 3)).astype("float32")
    x[4] = np.inf
    model.fit(x, x[:, :1], batch_size=4, shuffle=False, verbose=0)
    assert model.optimizer.skipped_steps >= 1
    model.save(work_dir / "model.keras")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model.save(work_dir / "model.h5")
    model.save_weights(work_dir / "model.weights.h5")
    result = subprocess.run(
        [sys.executable, str(READER), str(work_dir)],
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return model, work_dir


@pytest.mark.parametrize("file_format", ["keras", "weights_h5"])
def test_keras_alone_reads_the_package_files_exactly(
    read_by_keras_alone, file_format
):
    model, work_dir = read_by_keras_alone
    alone = np.load(work_dir / f"alone_{file_format}.npz")
    optimizer = model.optimizer
    assert str(alone["class_name"]) == "LossScaleOptimizer"
    assert not any("Skipping" in str(w) for w in alone["warnings"])
    for i, weight in enumerate(model.weights):
        np.testing.assert_array_equal(alone[f"weight_{i}"], to_numpy(weight))
    values = optimizer_values(optimizer)
    assert len(values) == len([k for k in alone if "optimizer_" in k])
    for i, value in enumerate(values):
        np.testing.assert_array_equal(alone[f"optimizer_{i}"], value)
    assert float(alone["loss_scale"]) == optimizer.loss_scale
    assert int(alone["step_counter"]) == optimizer.dynamic_counter
    assert int(alone["iterations"]) == int(to_numpy(optimizer.iterations))


def test_keras_alone_reads_the_weights_of_package_h5_files(
    read_by_keras_alone,
):
    model, work_dir = read_by_keras_alone
    alone = np.load(work_dir / "alone_h5.npz")
    for i, weight in enumerate(model.weights):
        np.testing.assert_array_equal(alone[f"weight_{i}"], to_numpy(weight))
    # The file's optimizer config names the package's class: Keras alone
    # loads the model uncompiled, with no optimizer state.
    assert "iterations" not in alone
