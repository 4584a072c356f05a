"""tf.keras 2 files saved compiled but before the first training step.

tests/fixtures/tf_keras2/optimizers/untrained holds tiny models that
tf-keras 2.21 compiled (SGD, Adam, Ftrl; bare, and in a dynamic or fixed
LossScaleOptimizer) and saved without training: its optimizer had no slots
yet, so the files hold its iteration count alone. They load with the
optimizer as compiled, its slots freshly built, and train on.
"""

import json
import pathlib
import warnings

import keras
import numpy as np
import pytest
from testing import assert_fixture_predictions
from testing import to_numpy
from testing import train_on_fixture_data

from keras_dtype_policy import LossScaleOptimizer

FIXTURES = (
    pathlib.Path(__file__).resolve().parents[2]
    / "fixtures"
    / "tf_keras2"
    / "optimizers"
    / "untrained"
)
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())


@pytest.fixture(scope="module")
def states():
    with np.load(FIXTURES / "states.npz") as npz:
        return dict(npz)


def test_the_files_hold_the_iteration_count_alone():
    for record in MANIFEST["fixtures"].values():
        assert record["saved_optimizer_values"]["h5"] == ["iteration:0"]


def load(path):
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Skipping variable loading")
        return keras.saving.load_model(path)


@pytest.mark.parametrize("suffix", [".h5", ".keras"])
@pytest.mark.parametrize("name", sorted(MANIFEST["fixtures"]))
def test_loads_as_compiled_and_trains(name, suffix, states):
    record = MANIFEST["fixtures"][name]
    model = load(FIXTURES / f"{name}{suffix}")
    optimizer = model.optimizer
    if record["wrapping"] == "bare":
        assert not isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        inner = optimizer
    else:
        assert type(optimizer) is LossScaleOptimizer
        scale = record["loss_scale_in_memory"]
        assert optimizer.dynamic is scale["dynamic"]
        assert optimizer.loss_scale == scale["initial_scale"]
        inner = optimizer.inner_optimizer
    assert type(inner).__name__ == record["optimizer"]
    for argument, value in record["arguments"].items():
        np.testing.assert_allclose(float(getattr(inner, argument)), value)

    assert_fixture_predictions(model, states, name, record["policy"])

    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    assert int(to_numpy(inner.iterations)) == 0
    fresh = type(inner).from_config(inner.get_config())
    fresh.build(model.trainable_variables)
    assert len(fresh.variables) == len(inner.variables)
    for loaded, built in zip(inner.variables, fresh.variables, strict=True):
        np.testing.assert_array_equal(
            to_numpy(loaded), to_numpy(built), err_msg=loaded.name
        )

    assert train_on_fixture_data(model, states, name) == 3
