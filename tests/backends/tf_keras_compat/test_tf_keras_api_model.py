"""tf.keras 2's mixed-precision models, as tf-keras' model tests pin them.

Models compiled and trained under tf.keras policies on every backend, and
a tf.keras 2 custom loop (`tf.GradientTape`) run unchanged on TensorFlow.
"""

import keras
import numpy as np
import pytest
from testing import BACKEND
from testing import to_numpy

import keras_dtype_policy as kdp
from keras_dtype_policy.tf_keras_compat import config_translation

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def small_model(policy, **layer_arguments):
    with kdp.policy_scope(policy):
        return keras.Sequential(
            [
                keras.Input((3,)),
                keras.layers.Dense(4, **layer_arguments),
                keras.layers.Dense(1, dtype="float32"),
            ]
        )


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 3)).astype("float32")
    return x, x.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_activity_and_weight_regularizers_train(policy, data):
    model = small_model(
        kdp.Policy(policy),
        activity_regularizer="l2",
        kernel_regularizer="l2",
    )
    model.compile(keras.optimizers.SGD(0.01), "mse")
    history = model.fit(*data, epochs=2, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    # The float16/bfloat16 activity loss and the float32 weight loss are
    # both in the float32 total.
    x, y = data
    y_pred = model(x)
    assert len(model.losses) == 2
    total = model.compute_loss(x, y, y_pred)
    mse = keras.ops.mean(keras.losses.mean_squared_error(y, y_pred))
    assert keras.backend.standardize_dtype(total.dtype) == "float32"
    assert float(to_numpy(total)) > float(to_numpy(mse))


def test_initial_loss_scale_above_the_default_ceiling_compiles(data):
    policy = kdp.Policy(
        "mixed_float16",
        loss_scale=kdp.DynamicLossScale(initial_loss_scale=2**30),
    )
    model = small_model(policy)
    model.compile("sgd", "mse")
    assert model.optimizer.loss_scale == 2.0**30
    assert model.optimizer.max_scale >= 2.0**30
    with pytest.warns(UserWarning, match="only useful for float16"):
        float32_policy = kdp.Policy(
            "float32",
            loss_scale=kdp.DynamicLossScale(initial_loss_scale=2**30),
        )
    model = small_model(float32_policy)
    model.compile("sgd", "mse")
    model.fit(*data, verbose=0)
    assert np.all(np.isfinite(to_numpy(model.layers[0].kernel)))


@pytest.mark.parametrize(
    "loss_scale, dynamic, scale",
    [(None, None, None), ("dynamic", True, 2.0**15), (8.0, False, 8.0)],
)
def test_the_policy_loss_scale_decides_the_optimizer(
    loss_scale, dynamic, scale
):
    model = small_model(kdp.Policy("mixed_float16", loss_scale=loss_scale))
    model.compile("sgd", "mse")
    if dynamic is None:
        assert not isinstance(
            model.optimizer, keras.optimizers.LossScaleOptimizer
        )
    else:
        assert (model.optimizer.dynamic, model.optimizer.loss_scale) == (
            dynamic,
            scale,
        )


def test_one_optimizer_compiled_twice():
    # tf.keras refused to wrap one optimizer twice; compile wraps it anew.
    optimizer = keras.optimizers.SGD()
    for _ in range(2):
        model = small_model("mixed_float16")
        model.compile(optimizer, "mse")
        assert model.optimizer.inner_optimizer is optimizer


def test_tf_2_3_optimizer_configs_translate():
    config = {
        "class_name": "LossScaleOptimizerV1",
        "config": {
            "optimizer": {
                "class_name": "Adam",
                "config": {"learning_rate": 0.5, "is_legacy_optimizer": True},
            },
            "loss_scale": {
                "class_name": "FixedLossScale",
                "config": {"loss_scale_value": 16.0},
            },
        },
    }
    translated = config_translation.translate_optimizer_config(config)
    optimizer = keras.optimizers.deserialize(translated)
    assert isinstance(optimizer, kdp.LossScaleOptimizer)
    assert (optimizer.dynamic, optimizer.loss_scale) == (False, 16.0)
    assert isinstance(optimizer.inner_optimizer, keras.optimizers.Adam)


@pytest.mark.skipif(
    BACKEND != "tensorflow",
    reason="tf.GradientTape loops exist on TensorFlow; the docs' tf-keras-jax "
    "and tf-keras-torch loops cover the other backends",
)
def test_tf_keras_2_gradient_tape_loop_runs_unchanged(data):
    import tensorflow as tf

    x, y = (tf.constant(v) for v in data)

    def make(optimizer):
        model = small_model("float32")
        model.set_weights([np.full(w.shape, 0.1) for w in model.weights])
        return model, optimizer

    def tf_keras_step(model, opt, x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
            scaled_loss = opt.get_scaled_loss(loss)
        scaled_grads = tape.gradient(scaled_loss, model.trainable_variables)
        grads = opt.get_unscaled_gradients(scaled_grads)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))

    def plain_step(model, opt, x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))

    scaled_model, scaled_opt = make(
        kdp.LossScaleOptimizer(keras.optimizers.SGD(0.05), initial_scale=64)
    )
    plain_model, plain_opt = make(keras.optimizers.SGD(0.05))
    step = tf.function(tf_keras_step)
    for _ in range(3):
        step(scaled_model, scaled_opt, x)
        plain_step(plain_model, plain_opt, x)
    for a, b in zip(scaled_model.weights, plain_model.weights, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6)
    assert int(scaled_opt.iterations.numpy()) == 3
    # A non-finite step is skipped and halves the scale.
    before = [w.numpy() for w in scaled_model.weights]
    step(scaled_model, scaled_opt, x * np.nan)
    for old, new in zip(before, scaled_model.weights, strict=True):
        np.testing.assert_array_equal(old, new.numpy())
    assert scaled_opt.loss_scale == 32.0
    assert scaled_opt.skipped_steps == 1
