"""Optimizer state from real tf.keras 2 files, exact, on each backend.

tests/fixtures/tf_keras2/optimizers holds, for every tf.keras 2 optimizer,
a tiny model trained for three steps and saved as .h5 and .keras by
tf-keras 2.21 (optimizer_fixtures.py there): bare (mixed_bfloat16), and in
a dynamic or fixed LossScaleOptimizer (mixed_float16). states.npz holds what
each optimizer's variables held in memory when it was saved.

The expected Keras 3 variable of each saved slot is found here by name
(`m/dense/kernel:0` is the `momentum` of `dense/kernel`), independently of
the package, which matches the saved values by position.
"""

import json
import pathlib
import re
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
)
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())
FIXTURE_NAMES = sorted(MANIFEST["fixtures"])

# tf.keras 2 slot names, and the Keras 3 names of the same slots.
KERAS_3_SLOT = {
    "m": "momentum",
    "v": "velocity",
    "vhat": "velocity_hat",
    "u": "norm",
    "momentum": "momentum",
    "velocity": "velocity",
    "average_gradient": "average_gradient",
    "accumulator": "accumulator",
    "accumulated_grad": "accumulated_grad",
    "accumulated_delta_var": "accumulated_delta_var",
    "linear": "linear",
}


@pytest.fixture(scope="module")
def states():
    with np.load(FIXTURES / "states.npz") as npz:
        return dict(npz)


def load(name, suffix):
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*optimizer.*")
        warnings.filterwarnings("error", message="Skipping variable loading")
        return keras.saving.load_model(FIXTURES / f"{name}{suffix}")


def inner_of(optimizer):
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.inner_optimizer
    return optimizer


def saved_slot(tf_name, class_name):
    """("m", "dense/kernel") for "Adam/m/dense/kernel:0" or "m/dense/..."."""
    parts = re.sub(r":\d+$", "", tf_name).split("/")
    if parts[0] == class_name:
        parts = parts[1:]
    return parts[0], "/".join(parts[1:])


def keras_3_slot_variable(model, optimizer, slot, variable_path):
    (model_variable,) = [
        v
        for v in model.trainable_variables
        if v.path == variable_path or v.path.endswith("/" + variable_path)
    ]
    name = f"{model_variable.path.replace('/', '_')}_{KERAS_3_SLOT[slot]}"
    found = [v for v in optimizer.variables if v.name == name]
    return found[0] if found else None


def assert_state_exact(model, record, name, states):
    inner = inner_of(model.optimizer)
    assert type(inner).__name__ == record["optimizer"]
    assert int(to_numpy(inner.iterations)) == record["iterations"] == 3
    slots = 0
    for i, saved in enumerate(record["variables"]):
        value = states[f"{name}.var.{i}"]
        if saved["name"].startswith("iteration"):
            continue
        slot, path = saved_slot(saved["name"], record["optimizer"])
        target = keras_3_slot_variable(model, inner, slot, path)
        if target is None:
            # Only tf.keras' SGD(momentum=0) momentums have no place in
            # Keras 3: they hold the last update, which momentum 0 never
            # reads back.
            assert (record["optimizer"], slot) == ("SGD", "m")
            assert record["arguments"].get("momentum", 0.0) == 0.0
            continue
        slots += 1
        np.testing.assert_array_equal(to_numpy(target), value, err_msg=slot)
    keras_slots = [
        v
        for v in inner.variables
        if v is not inner.iterations
        and v is not getattr(inner, "_learning_rate", None)
        and v is not getattr(inner, "_u_product", None)
    ]
    assert slots == len(keras_slots)


def nadam_u_product(beta_1, steps):
    t = np.arange(1, steps + 1, dtype="float64")
    return float(np.prod(beta_1 * (1.0 - 0.5 * 0.96**t)))


def assert_loads_exactly(name, suffix, states):
    """Loads one file; checks the loss scale and every saved value."""
    record = MANIFEST["fixtures"][name]
    model = load(name, suffix)
    optimizer = model.optimizer
    if record["wrapping"] == "bare":
        assert not isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    else:
        assert type(optimizer) is LossScaleOptimizer
        scale = record["loss_scale_in_memory"]
        assert optimizer.dynamic is scale["dynamic"]
        assert optimizer.initial_scale == scale["initial_scale"]
        # tf.keras saves neither the scale nor its counter (see
        # saved_optimizer_values): both start afresh.
        assert optimizer.loss_scale == scale["initial_scale"]
        # A fixed scale has no counter, as in tf.keras.
        assert optimizer.dynamic_counter == (0 if scale["dynamic"] else None)
    if not optimizer.built:
        # Keras' .h5 loader builds with the model's own, empty, variable
        # list; the state waits for the real build (or the first step).
        assert suffix == ".h5"
        optimizer.build(model.trainable_variables)
    assert_state_exact(model, record, name, states)
    if record["optimizer"] == "Nadam":
        # tf.keras keeps its running product outside the saved variables;
        # it follows from the step count, as Keras 3 computes it.
        inner = inner_of(optimizer)
        expected = nadam_u_product(inner.beta_1, record["iterations"])
        np.testing.assert_allclose(
            float(to_numpy(inner._u_product)), expected, rtol=1e-6
        )


def assert_first_fit_works(name, suffix, states):
    """Loads one file, checks its predictions, then trains three steps."""
    record = MANIFEST["fixtures"][name]
    model = load(name, suffix)
    assert_fixture_predictions(model, states, name, record["policy"])
    assert train_on_fixture_data(model, states, name) == 6


# The first fit after loading runs on one format per wrapping: each optimizer
# trains from both formats, bare and loss-scaled, within the time budget.
FIT_FORMAT = {"bare": ".h5", "fixed": ".h5", "dynamic": ".keras"}


def fixture_cases():
    """Every fixture; the default runs take one wrapping an optimizer.

    The wrapping turns with the optimizer's place in the sorted list, so
    bare, dynamic and fixed each run for about a third of the optimizers
    and each format trains; the other two of each optimizer are marked
    slow (`tox -e full-<backend>` runs all 42).
    """
    wrappings = ("bare", "dynamic", "fixed")
    optimizers = sorted(
        {MANIFEST["fixtures"][n]["optimizer"] for n in FIXTURE_NAMES}
    )
    cases = []
    for name in FIXTURE_NAMES:
        fixture = MANIFEST["fixtures"][name]
        turn = optimizers.index(fixture["optimizer"]) % len(wrappings)
        slow = fixture["wrapping"] != wrappings[turn]
        marks = (pytest.mark.slow,) if slow else ()
        cases.append(pytest.param(name, marks=marks, id=name))
    return cases


@pytest.mark.parametrize("name", fixture_cases())
def test_state_comes_back_exactly_and_trains_on(name, states):
    for suffix in (".h5", ".keras"):
        assert_loads_exactly(name, suffix, states)
    assert_first_fit_works(
        name, FIT_FORMAT[MANIFEST["fixtures"][name]["wrapping"]], states
    )
