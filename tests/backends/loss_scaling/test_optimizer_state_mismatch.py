"""Saved optimizer state that belongs to another optimizer is skipped.

A model whose saved optimizer state does not fit the optimizer it is loaded
into (another class, another model) trains as with Keras alone: one
warning that names both layouts, fresh slots, nothing partly assigned.
State that fits is restored exactly. The expectations are the same on
every backend.

The package's rules apply to an optimizer that saved state is loaded into
(by `load_model` or `load_weights`); an optimizer compiled and never loaded
into keeps Keras' own `set_weights` (see test_instance_patches.py).
"""

import pathlib
import tempfile
import warnings

import h5py
import keras
import numpy as np
import pytest
from keras.src.legacy.saving import legacy_h5_format

import keras_dtype_policy as kdp
from keras_dtype_policy.loss_scaling.optimizer_state import (
    OptimizerStateMismatch,
)

SKIPPING = "Skipping variable loading for optimizer"


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4)).astype("float32")
    y = rng.normal(size=(16, 1)).astype("float32")
    return x, y


def new_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(3, activation="relu"),
            keras.layers.Dense(1),
        ]
    )


def trained_with(optimizer):
    model = new_model()
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(*data(), batch_size=8, epochs=2, verbose=0)
    return model


def fit_recording_warnings(model):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(*data(), batch_size=8, verbose=0)
    return [str(w.message) for w in caught if SKIPPING in str(w.message)]


def fresh_reference(weights, optimizer):
    """The model trained from `weights` with a fresh `optimizer`."""
    model = new_model()
    model.set_weights(weights)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(*data(), batch_size=8, verbose=0)
    return model


def assert_same_weights(model, reference):
    for ours, theirs in zip(
        model.get_weights(), reference.get_weights(), strict=True
    ):
        np.testing.assert_array_equal(ours, theirs)


def loaded_in_a_model(optimizer):
    """`optimizer`, built, as a model leaves it once saved state has been
    loaded into it (the package's loading rules apply where saved state
    arrives): here, the model's own weights through `load_weights`."""
    model = new_model()
    model.compile(optimizer=optimizer, loss="mse")
    model.optimizer.build(model.trainable_variables)
    with tempfile.TemporaryDirectory() as directory:
        path = pathlib.Path(directory) / "own.weights.h5"
        model.save_weights(path)
        model.load_weights(path)
    return model.optimizer


def optimizer_values(optimizer):
    return [np.array(v.numpy()) for v in optimizer.variables]


@pytest.mark.parametrize(
    "make_optimizer",
    [
        keras.optimizers.Adam,
        lambda: kdp.LossScaleOptimizer(keras.optimizers.Adam()),
    ],
    ids=["bare", "wrapped"],
)
def test_load_weights_from_another_optimizer_warns_and_trains(
    tmp_path, make_optimizer
):
    saved = trained_with(keras.optimizers.SGD(momentum=0.9))
    path = tmp_path / "sgd.weights.h5"
    saved.save_weights(path)
    model = new_model()
    model.compile(optimizer=make_optimizer(), loss="mse")
    model.load_weights(path)
    messages = fit_recording_warnings(model)
    # One warning, naming the optimizer's variables and the saved values.
    assert len(messages) == 1, messages
    assert "kernel_velocity (4, 3) float32" in messages[0]
    assert "The saved optimizer has: [#0 () int" in messages[0]
    # Fresh slots: the same run as from the weights with a new optimizer.
    reference = fresh_reference(saved.get_weights(), make_optimizer())
    assert_same_weights(model, reference)
    assert int(model.optimizer.iterations.numpy()) == 2


def test_load_weights_from_the_same_optimizer_restores_exactly(tmp_path):
    saved = trained_with(keras.optimizers.SGD(momentum=0.9))
    path = tmp_path / "sgd.weights.h5"
    saved.save_weights(path)
    model = new_model()
    model.compile(optimizer=keras.optimizers.SGD(momentum=0.9), loss="mse")
    model.load_weights(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model.optimizer.build(model.trainable_variables)
    for ours, theirs in zip(
        optimizer_values(model.optimizer),
        optimizer_values(saved.optimizer),
        strict=True,
    ):
        np.testing.assert_array_equal(ours, theirs)


@keras.saving.register_keras_serializable(package="test_optimizer_state")
class SelfCompilingModel(keras.Model):
    """Compiles itself with Adam, as keras-hub tasks do: a reloaded model
    gets a fresh Adam, whatever optimizer the saved one had."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(3, activation="relu")
        self.out = keras.layers.Dense(1)
        self.compile()

    def call(self, x):
        return self.out(self.hidden(x))

    def compile(self, optimizer="auto", **kwargs):
        if optimizer == "auto":
            optimizer = keras.optimizers.Adam()
        super().compile(optimizer=optimizer, loss="mse", **kwargs)


@pytest.mark.parametrize(
    "optimizer, restored",
    [
        (lambda: keras.optimizers.SGD(momentum=0.9), False),
        (keras.optimizers.RMSprop, False),
        (keras.optimizers.Adam, True),
    ],
    ids=["sgd_momentum", "rmsprop", "adam"],
)
def test_a_self_compiling_model_reloads_and_trains(
    tmp_path, optimizer, restored
):
    keras.utils.set_random_seed(0)
    model = SelfCompilingModel()
    model.compile(optimizer=optimizer())
    model.fit(*data(), batch_size=8, epochs=2, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)
    reloaded = keras.saving.load_model(path)
    assert isinstance(reloaded.optimizer, keras.optimizers.Adam)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reloaded.optimizer.build(reloaded.trainable_variables)
    messages = [str(w.message) for w in caught if SKIPPING in str(w.message)]
    if restored:
        # The same optimizer class: its state comes back exactly.
        assert messages == []
        for ours, theirs in zip(
            optimizer_values(reloaded.optimizer),
            optimizer_values(model.optimizer),
            strict=True,
        ):
            np.testing.assert_array_equal(ours, theirs)
    else:
        assert len(messages) == 1, messages
        assert int(reloaded.optimizer.iterations.numpy()) == 0
        for variable in reloaded.optimizer.variables[2:]:
            assert not np.any(variable.numpy())
    reloaded.fit(*data(), batch_size=8, verbose=0)
    assert all(np.all(np.isfinite(w)) for w in reloaded.get_weights())


@pytest.mark.parametrize("wrapped", [False, True], ids=["bare", "wrapped"])
def test_set_weights_that_do_not_fit_raise_and_assign_nothing(wrapped):
    model = trained_with(keras.optimizers.SGD(momentum=0.9))
    values = optimizer_values(model.optimizer)
    optimizer = keras.optimizers.RMSprop(momentum=0.5)
    if wrapped:
        optimizer = kdp.LossScaleOptimizer(optimizer)
    optimizer = loaded_in_a_model(optimizer)
    before = optimizer_values(optimizer)
    with pytest.raises(ValueError, match="The saved optimizer has") as error:
        optimizer.set_weights(values)
    assert isinstance(error.value, OptimizerStateMismatch)
    for ours, theirs in zip(optimizer_values(optimizer), before, strict=True):
        np.testing.assert_array_equal(ours, theirs)


def test_values_of_the_wrong_dtype_do_not_fit():
    model = trained_with(keras.optimizers.SGD(momentum=0.9))
    values = optimizer_values(model.optimizer)
    # The step count saved as a float that is no whole number: right
    # shapes, wrong kind of dtype (a whole float is taken, as tf.keras'
    # set_weights cast it).
    values[0] = values[0].astype("float32") + 0.5
    optimizer = loaded_in_a_model(keras.optimizers.SGD(momentum=0.9))
    with pytest.raises(OptimizerStateMismatch, match="float32"):
        optimizer.set_weights(values)


@pytest.mark.parametrize("wrapped", [False, True], ids=["bare", "wrapped"])
def test_a_built_optimizer_skips_a_store_that_does_not_fit(wrapped):
    model = trained_with(keras.optimizers.Adam())
    # As many values as the Adam below has variables, of other shapes.
    store = {
        str(i): np.zeros((7,) * min(v.ndim, 1), v.dtype)
        for i, v in enumerate(optimizer_values(model.optimizer))
    }
    optimizer = keras.optimizers.Adam()
    if wrapped:
        optimizer = kdp.LossScaleOptimizer(optimizer)
        store = {
            str(i): v
            for i, v in enumerate(
                [np.array(1, "int64"), np.array(0.001, "float32")]
                + [np.zeros(()), np.zeros((), "int64")]
                + list(store.values())
            )
        }
    optimizer = loaded_in_a_model(optimizer)
    before = optimizer_values(optimizer)
    with pytest.warns(UserWarning, match=SKIPPING):
        optimizer.load_own_variables(store)
    for ours, theirs in zip(optimizer_values(optimizer), before, strict=True):
        np.testing.assert_array_equal(ours, theirs)


def test_names_in_an_h5_file_tell_optimizers_of_one_layout_apart(tmp_path):
    # SGD with momentum and RMSprop hold the same number of values of the
    # same shapes; only the names an .h5 file keeps tell them apart.
    model = trained_with(keras.optimizers.SGD(momentum=0.9))
    path = tmp_path / "sgd.h5"
    legacy_h5_format.save_model_to_hdf5(model, str(path))
    rmsprop = loaded_in_a_model(keras.optimizers.RMSprop())
    sgd = loaded_in_a_model(keras.optimizers.SGD(momentum=0.9))
    with h5py.File(path, "r") as file:
        saved = legacy_h5_format.load_optimizer_weights_from_hdf5_group(file)
        with pytest.raises(OptimizerStateMismatch, match="momentum"):
            rmsprop.set_weights(saved)
        sgd.set_weights(saved)
    for ours, theirs in zip(
        optimizer_values(sgd), optimizer_values(model.optimizer), strict=True
    ):
        np.testing.assert_array_equal(ours, theirs)
