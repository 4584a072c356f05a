"""Programs that work in Keras alone work the same with the package.

Each case runs twice in one process, once with the package's patches
uninstalled (Keras alone) and once installed, from the same seed, and the
results must be equal. The backends agree on every expectation here.
"""

import keras
import numpy as np
import pytest
from testing import BACKEND
from testing import to_numpy

import keras_dtype_policy as kdp


def frozen_dense():
    return keras.Sequential(
        [keras.Input((2,)), keras.layers.Dense(1, trainable=False)]
    )


def activations_only():
    return keras.Sequential(
        [keras.Input((2,)), keras.layers.Activation("relu")]
    )


def frozen_embedding():
    return keras.Sequential(
        [
            keras.Input((3,), dtype="int32"),
            keras.layers.Embedding(10, 2, trainable=False),
            keras.layers.Flatten(),
        ]
    )


MODELS = {
    "frozen_dense": (frozen_dense, (8, 2), (8, 1)),
    "activations_only": (activations_only, (8, 2), (8, 2)),
    "frozen_embedding": (frozen_embedding, (8, 3), (8, 6)),
}


def fit_history(build, x, y, optimizer, policy):
    keras.utils.clear_session()
    keras.config.set_dtype_policy(policy)
    keras.utils.set_random_seed(3)
    model = build()
    model.compile(optimizer=optimizer, loss="mse")
    history = model.fit(x, y, batch_size=4, epochs=2, verbose=0)
    keras.config.set_dtype_policy("float32")
    return history.history["loss"], model


def iterations(model):
    return int(to_numpy(model.optimizer.iterations))


def data(x_shape, y_shape):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 10, size=x_shape).astype("int32")
    return x, rng.normal(size=y_shape).astype("float32")


@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_a_model_without_trainable_weights_fits_as_in_keras(
    model_name, optimizer, policy
):
    build, x_shape, y_shape = MODELS[model_name]
    x, y = data(x_shape, y_shape)
    kdp.uninstall()
    keras_losses, keras_model = fit_history(build, x, y, optimizer, policy)
    kdp.install()
    losses, model = fit_history(build, x, y, optimizer, policy)

    np.testing.assert_allclose(losses, keras_losses, rtol=1e-6)
    # TensorFlow's trainer never builds an optimizer with nothing to train;
    # jax and torch build it with the empty list.
    assert model.optimizer.built == keras_model.optimizer.built
    assert iterations(model) == iterations(keras_model)
    if policy == "mixed_float16":
        assert isinstance(model.optimizer, kdp.LossScaleOptimizer)


def save_load_and_fit(path, x, y):
    keras.utils.set_random_seed(3)
    model = frozen_dense()
    model.compile(optimizer="adam", loss=keras.losses.MeanSquaredError())
    model.fit(x, y, batch_size=4, verbose=0)
    model.save(path)
    loaded = keras.saving.load_model(path)
    loaded.fit(x, y, batch_size=4, verbose=0)
    return model, loaded


def test_a_model_without_trainable_weights_fits_after_an_h5_round_trip(
    tmp_path,
):
    x, y = data((8, 2), (8, 1))
    kdp.uninstall()
    _, keras_loaded = save_load_and_fit(tmp_path / "keras.h5", x, y)
    kdp.install()
    model, loaded = save_load_and_fit(tmp_path / "frozen.h5", x, y)

    # The package puts off the .h5 loader's empty placeholder build, so the
    # saved state can land in the real build. jax and torch build at the
    # first fit; TensorFlow's trainer never builds an optimizer with nothing
    # to train (Keras alone keeps the loader's empty build).
    assert loaded.optimizer.built == (BACKEND != "tensorflow")
    assert iterations(loaded) == iterations(keras_loaded)
    np.testing.assert_array_equal(
        to_numpy(loaded.predict(x, verbose=0)),
        to_numpy(model.predict(x, verbose=0)),
    )


def test_an_empty_build_outside_h5_loading_builds_for_real():
    optimizer = kdp.LossScaleOptimizer(keras.optimizers.SGD())
    optimizer.build([])
    assert optimizer.built
    assert optimizer.inner_optimizer.built
