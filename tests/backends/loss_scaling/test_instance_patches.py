"""The methods set on optimizer instances: where, and their undoing.

An optimizer is taught to read saved state (tf.keras 2 layouts, state
loaded before its first build, state that does not fit) only where saved
state can arrive: `load_model`, `load_weights`, and the inner optimizer of
this package's `LossScaleOptimizer`. Anywhere else it keeps Keras' own
methods. `uninstall()` takes the methods off every optimizer that holds
them. The expectations are the same on every backend.
"""

import pathlib

import keras
import numpy as np
import pytest
from keras.src.legacy.saving import legacy_h5_format

import keras_dtype_policy as kdp
from keras_dtype_policy import patches
from keras_dtype_policy.loss_scaling import state_arrival

METHODS = ("build", "load_own_variables", "set_weights")


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4)).astype("float32")
    y = rng.normal(size=(16, 1)).astype("float32")
    return x, y


def trained(policy="float32", optimizer="adam"):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(3, activation="relu", dtype=policy),
            keras.layers.Dense(1, dtype=policy),
        ]
    )
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(*data(), batch_size=8, epochs=2, verbose=0)
    return model


def holds_taught_methods(optimizer):
    return any(name in vars(optimizer) for name in METHODS)


def values(optimizer):
    return [np.array(v.numpy()) for v in optimizer.variables]


def save(model, path):
    if path.suffix == ".h5":
        legacy_h5_format.save_model_to_hdf5(model, str(path))
    else:
        model.save(path)


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_a_compiled_optimizer_keeps_keras_methods(policy):
    model = trained(policy)
    optimizer = model.optimizer
    assert isinstance(optimizer, keras.optimizers.Adam)
    assert not holds_taught_methods(optimizer)
    assert not state_arrival.is_taught(optimizer)
    # Called directly, set_weights is Keras' own (its backend's class).
    assert optimizer.set_weights.__func__ is type(optimizer).set_weights


def test_the_package_loss_scale_optimizer_teaches_its_inner_optimizer():
    model = trained("mixed_float16")
    assert isinstance(model.optimizer, kdp.LossScaleOptimizer)
    assert not holds_taught_methods(model.optimizer)
    inner = model.optimizer.inner_optimizer
    assert all(name in vars(inner) for name in METHODS)
    assert state_arrival.is_taught(inner)


@pytest.mark.parametrize("suffix", [".keras", ".h5"])
def test_load_model_teaches_and_restores(tmp_path, suffix):
    model = trained()
    path = tmp_path / f"model{suffix}"
    save(model, path)
    reloaded = keras.saving.load_model(path)
    assert state_arrival.is_taught(reloaded.optimizer)
    if not reloaded.optimizer.built:  # .h5: the saved state waits for it
        reloaded.optimizer.build(reloaded.trainable_variables)
    for ours, theirs in zip(
        values(reloaded.optimizer), values(model.optimizer), strict=True
    ):
        np.testing.assert_array_equal(ours, theirs)


def test_load_weights_before_the_first_step_restores_at_the_build(tmp_path):
    model = trained()
    path = tmp_path / "model.weights.h5"
    model.save_weights(path)
    fresh = keras.models.clone_model(model)
    fresh.compile(optimizer="adam", loss="mse")
    assert not state_arrival.is_taught(fresh.optimizer)
    fresh.load_weights(path)
    assert state_arrival.is_taught(fresh.optimizer)
    fresh.optimizer.build(fresh.trainable_variables)
    for ours, theirs in zip(
        values(fresh.optimizer), values(model.optimizer), strict=True
    ):
        np.testing.assert_array_equal(ours, theirs)


def test_uninstall_takes_the_methods_off_every_optimizer(tmp_path):
    path = tmp_path / "model.keras"
    trained().save(path)
    loaded = keras.saving.load_model(path).optimizer
    inner = trained("mixed_float16").optimizer.inner_optimizer
    assert state_arrival.is_taught(loaded) and state_arrival.is_taught(inner)
    kdp.uninstall()
    try:
        for optimizer in (loaded, inner):
            assert not holds_taught_methods(optimizer)
            assert not state_arrival.is_taught(optimizer)
    finally:
        kdp.install()
    # install() does not set them again, and Keras' methods train.
    assert not holds_taught_methods(loaded)
    model = keras.saving.load_model(path)
    model.fit(*data(), batch_size=8, verbose=0)
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())


def test_the_table_and_the_docs_list_the_instance_patch():
    (patch,) = [p for p in patches.INSTANCE_PATCHES if p.attributes == METHODS]
    assert patch.why
    page = (
        pathlib.Path(__file__).resolve().parents[3]
        / "docs"
        / "how-it-touches-keras.md"
    ).read_text()
    assert (
        "| optimizer instances: `build`, `load_own_variables`, "
        "`set_weights` |" in page
    )


def test_uninstall_unroutes_and_the_wrapper_routes_again():
    from keras_dtype_policy.low_precision import float32_views

    weight = keras.Variable(np.ones((64, 80)), dtype="bfloat16")
    optimizer = kdp.LowPrecisionOptimizer(
        keras.optimizers.Adam(1e-2), state_dtype="8bit", seed=1
    )
    grad = keras.ops.ones((64, 80), "bfloat16")
    optimizer.apply([grad], [weight])
    inner = optimizer.inner_optimizer
    assert set(float32_views.ROUTED_METHODS) <= set(vars(inner))
    kdp.uninstall()
    try:
        assert not set(float32_views.ROUTED_METHODS) & set(vars(inner))
        codes = [v for v in optimizer.variables if v.path.endswith("_codes")]
        before = [np.array(v) for v in codes]
        optimizer.apply([-grad], [weight])
        # The wrapper routed its inner optimizer again, so the step went
        # through its quantized state: the first moment's codes changed.
        assert set(float32_views.ROUTED_METHODS) <= set(vars(inner))
        assert any(
            not np.array_equal(b, np.array(v))
            for b, v in zip(before, codes, strict=True)
        )
        assert np.all(np.isfinite(np.array(weight, "float32")))
    finally:
        kdp.install()
