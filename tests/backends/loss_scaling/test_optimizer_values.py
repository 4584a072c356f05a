"""Optimizer values that make no sense are refused, with the field named.

The package's wrappers refuse an inner learning rate that is not finite or
is negative; saved state with a negative (or, for its dtype, too large)
count or a loss scale that is not finite is refused as it loads, whether
into the package's optimizers or a Keras optimizer whose state the package
reads. A saved learning rate out of range is refused by the package's
optimizers and warned about for Keras' own (which accept it).
"""

import pathlib
import tempfile
import warnings
import zipfile

import h5py
import keras
import numpy as np
import pytest

import keras_dtype_policy as kdp
from keras_dtype_policy.loss_scaling import state_arrival

WRAPPERS = [kdp.LossScaleOptimizer, kdp.LowPrecisionOptimizer]


def weights():
    return [keras.Variable(np.ones((3,), "float32"))]


def saved(optimizer):
    store = {}
    optimizer.save_own_variables(store)
    return store


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("rate", [np.nan, np.inf, -1.0])
def test_wrappers_refuse_an_inner_learning_rate_out_of_range(wrapper, rate):
    with pytest.raises(ValueError, match=r"learning_rate=(nan|inf|-1\.0)"):
        wrapper(keras.optimizers.Adam(learning_rate=rate))


def test_from_config_refuses_an_inner_learning_rate_out_of_range():
    config = kdp.LossScaleOptimizer(keras.optimizers.SGD()).get_config()
    config["inner_optimizer"]["config"]["learning_rate"] = float("nan")
    with pytest.raises(ValueError, match="learning_rate=nan"):
        kdp.LossScaleOptimizer.from_config(config)


def test_a_schedule_is_not_checked():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    kdp.LossScaleOptimizer(keras.optimizers.SGD(schedule))


# Keras' own layout of a built LossScaleOptimizer over Adam: 0 iteration,
# 1 learning_rate, 2 step_counter, 3 dynamic_scale, 4 inner iteration,
# 5 inner learning_rate, then the slots.
@pytest.mark.parametrize(
    "key, value, field",
    [
        ("0", np.array(-(2**62)), "iteration"),
        ("2", np.array(-1, "int32"), "step_counter"),
        ("3", np.array(np.nan, "float32"), "dynamic_scale"),
        ("3", np.array(-4.0, "float32"), "dynamic_scale"),
        ("4", np.array(-3, "int32"), "iteration"),
        ("5", np.array(np.inf, "float32"), "learning_rate"),
    ],
)
def test_loss_scale_optimizer_refuses_saved_values(key, value, field):
    source = kdp.LossScaleOptimizer(keras.optimizers.Adam())
    source.build(weights())
    store = saved(source)
    store[key] = value
    target = kdp.LossScaleOptimizer(keras.optimizers.Adam())
    target.build(weights())
    before = [np.array(v.numpy()) for v in target.variables]
    with pytest.raises(ValueError, match=f"Received: {field}="):
        target.load_own_variables(store)
    for variable, value in zip(target.variables, before, strict=True):
        np.testing.assert_array_equal(variable.numpy(), value)


def test_a_count_too_large_for_its_dtype_is_refused():
    source = kdp.LossScaleOptimizer(keras.optimizers.Adam())
    source.build(weights())
    store = saved(source)
    store["0"] = np.array(2**40, "int64")
    target = kdp.LossScaleOptimizer(keras.optimizers.Adam())
    target.build(weights())
    own_count = target.variables[0]
    if keras.backend.standardize_dtype(own_count.dtype) == "int64":
        target.load_own_variables(store)
        assert int(own_count.numpy()) == 2**40
    else:
        with pytest.raises(ValueError, match="Received: iteration="):
            target.load_own_variables(store)


def taught_adam(build=True):
    optimizer = keras.optimizers.Adam()
    if build:
        optimizer.build(weights())
    state_arrival.teach_tf_keras_layout(optimizer)
    return optimizer


def adam_store():
    optimizer = keras.optimizers.Adam()
    optimizer.build(weights())
    return saved(optimizer)


@pytest.mark.parametrize("build", [True, False])
def test_keras_optimizer_refuses_a_negative_saved_step_count(build):
    store = adam_store()
    store["0"] = np.array(-(2**62))
    optimizer = taught_adam(build)
    with pytest.raises(ValueError, match="Received: iteration=-"):
        optimizer.load_own_variables(store)
    assert int(optimizer.iterations.numpy()) == 0


def test_keras_optimizer_warns_about_a_saved_nan_learning_rate():
    store = adam_store()
    store["1"] = np.array(np.nan, "float32")
    optimizer = taught_adam()
    with pytest.warns(UserWarning, match="learning_rate=nan"):
        optimizer.load_own_variables(store)


def test_low_precision_optimizer_refuses_a_negative_step_count():
    source = kdp.LowPrecisionOptimizer(keras.optimizers.Adam())
    source.build(weights())
    store = saved(source)
    store["0"] = np.array(-1)
    target = kdp.LowPrecisionOptimizer(keras.optimizers.Adam())
    target.build(weights())
    with pytest.raises(ValueError, match="Received: iteration=-1"):
        target.load_own_variables(store)


def _tampered_model_file(directory, path, value):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.Adam(), "mse")
    x = np.ones((4, 3), "float32")
    model.fit(x, x[:, :1], epochs=1, verbose=0)
    source = directory / "source.keras"
    model.save(source)
    target = directory / "tampered.keras"
    with zipfile.ZipFile(source) as zin, zipfile.ZipFile(target, "w") as zout:
        for item in zin.infolist():
            data = zin.read(item.filename)
            if item.filename == "model.weights.h5":
                weights_path = directory / "model.weights.h5"
                weights_path.write_bytes(data)
                with h5py.File(weights_path, "r+") as file:
                    del file[path]
                    file[path] = value
                data = weights_path.read_bytes()
            zout.writestr(item, data)
    return target


def test_load_model_refuses_a_negative_step_count_in_a_file():
    with tempfile.TemporaryDirectory() as name:
        path = _tampered_model_file(
            pathlib.Path(name), "optimizer/vars/0", np.array(-(2**62))
        )
        with pytest.raises(ValueError, match="iteration=-4611686018427387904"):
            keras.saving.load_model(path)


def test_load_model_warns_about_a_nan_learning_rate_in_a_file():
    with tempfile.TemporaryDirectory() as name:
        path = _tampered_model_file(
            pathlib.Path(name),
            "optimizer/vars/1",
            np.array(np.nan, "float32"),
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            keras.saving.load_model(path)
        assert any("learning_rate=nan" in str(w.message) for w in caught)
