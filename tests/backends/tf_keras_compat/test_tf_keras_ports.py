"""tf.keras 2.4+ mixed-precision code, run with one import changed.

The code of the TensorFlow mixed-precision guide, of the tf_keras 2.21
docstrings of `LossScaleOptimizer` and `Policy`, and of tensorflow/models'
`official/modeling/performance.py` and the train step of
`official/core/base_task.py`, written as those sources write it, with
`from tensorflow.keras import mixed_precision` (or `tf_keras.mixed_precision`)
replaced by `from keras_dtype_policy import mixed_precision`; small models
and few steps. The parts that are backend-neutral run on every backend; the
gradient computation, which is TensorFlow's `tf.GradientTape`, runs as
written on TensorFlow, and with the change that docs/tf-keras-migration.md
shows on JAX and PyTorch. Other changes, each from Keras 3 itself (they are
the same with `tf.keras` of TensorFlow 2.16+), are marked "Keras 3:".
"""

import importlib
import types

import keras
import numpy as np
import pytest
from keras import layers
from testing import BACKEND
from testing import to_numpy

from keras_dtype_policy import mixed_precision

TENSORFLOW_ONLY = pytest.mark.skipif(
    BACKEND != "tensorflow",
    reason="the code as written uses TensorFlow (tf.GradientTape, tf.data, "
    "tf.function); its JAX and PyTorch variants are the tests beside it",
)


def synthetic_mnist(count, seed):
    """Stands in for `keras.datasets.mnist` (no download in tests)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, size=count)
    # Each class lights up its own block of pixels, so a model can learn.
    images = rng.uniform(0, 64, size=(count, 784))
    for label in range(10):
        images[labels == label, label * 78 : label * 78 + 78] += 191
    return images.astype("uint8"), labels.astype("uint8")


def guide_model():
    """The guide's model, up to `initial_weights`, under its policy."""
    policy = mixed_precision.Policy("mixed_float16")
    mixed_precision.set_global_policy(policy)
    assert (policy.compute_dtype, policy.variable_dtype) == (
        "float16",
        "float32",
    )

    inputs = keras.Input(shape=(784,), name="digits")
    num_units = 64  # the guide's size without a GPU
    dense1 = layers.Dense(num_units, activation="relu", name="dense_1")
    x = dense1(inputs)
    dense2 = layers.Dense(num_units, activation="relu", name="dense_2")
    x = dense2(x)
    # Keras 3: dtypes are strings (the guide prints `.dtype.name`).
    assert repr(dense1.dtype_policy) == '<Policy "mixed_float16">'
    assert x.dtype == "float16"
    assert dense1.kernel.dtype == "float32"

    # INCORRECT: softmax and model output will be float16, when it should
    # be float32
    outputs = layers.Dense(10, activation="softmax", name="predictions")(x)
    assert outputs.dtype == "float16"

    # CORRECT: softmax and model output are float32
    x = layers.Dense(10, name="dense_logits")(x)
    outputs = layers.Activation("softmax", dtype="float32", name="predictions")(
        x
    )
    assert outputs.dtype == "float32"

    # The linear activation is an identity function. So this simply casts
    # 'outputs' to float32. In this particular case, 'outputs' is already
    # float32 so this is a no-op.
    outputs = layers.Activation("linear", dtype="float32")(outputs)

    model = keras.Model(inputs=inputs, outputs=outputs)
    model.compile(
        loss="sparse_categorical_crossentropy",
        optimizer=keras.optimizers.RMSprop(),
        metrics=["accuracy"],
    )

    (x_train, y_train), (x_test, y_test) = (
        synthetic_mnist(512, 0),
        synthetic_mnist(256, 1),
    )
    x_train = x_train.reshape(512, 784).astype("float32") / 255
    x_test = x_test.reshape(256, 784).astype("float32") / 255
    return model, (x_train, y_train), (x_test, y_test)


def test_guide_model_fit():
    model, (x_train, y_train), (x_test, y_test) = guide_model()
    initial_weights = model.get_weights()

    history = model.fit(
        x_train,
        y_train,
        batch_size=128,
        epochs=3,
        validation_split=0.2,
        verbose=0,
    )
    test_scores = model.evaluate(x_test, y_test, verbose=0)

    # fit scaled the loss: the compile hook wrapped RMSprop.
    assert isinstance(model.optimizer, mixed_precision.LossScaleOptimizer)
    assert model.optimizer.dynamic
    losses = history.history["loss"]
    assert losses[-1] < losses[0]
    assert test_scores[1] > 0.5
    assert all(np.isfinite(w).all() for w in model.get_weights())
    assert len(initial_weights) == len(model.get_weights())


def make_train_step(model, optimizer, loss_object):
    """The guide's `train_step`, for the backend of this run.

    TensorFlow's is the guide's own. On JAX and PyTorch only the gradient
    computation differs, as docs/tf-keras-migration.md shows.
    """
    if BACKEND == "tensorflow":
        tf = importlib.import_module("tensorflow")

        @tf.function
        def train_step(x, y):
            with tf.GradientTape() as tape:
                predictions = model(x)
                loss = loss_object(y, predictions)
                scaled_loss = optimizer.get_scaled_loss(loss)
            scaled_gradients = tape.gradient(
                scaled_loss, model.trainable_variables
            )
            gradients = optimizer.get_unscaled_gradients(scaled_gradients)
            optimizer.apply_gradients(
                zip(gradients, model.trainable_variables, strict=True)
            )
            return loss

        return train_step
    if BACKEND == "jax":
        jax = importlib.import_module("jax")

        def scaled_loss_fn(trainable, non_trainable, x, y):
            predictions, _ = model.stateless_call(trainable, non_trainable, x)
            loss = loss_object(y, predictions)
            return optimizer.get_scaled_loss(loss), loss

        grad_fn = jax.grad(scaled_loss_fn, has_aux=True)

        def train_step(x, y):
            scaled_gradients, loss = grad_fn(
                [v.value for v in model.trainable_variables],
                [v.value for v in model.non_trainable_variables],
                x,
                y,
            )
            gradients = optimizer.get_unscaled_gradients(scaled_gradients)
            optimizer.apply_gradients(
                zip(gradients, model.trainable_variables, strict=True)
            )
            return loss

        return train_step
    torch = importlib.import_module("torch")

    def train_step(x, y):
        predictions = model(x)
        loss = loss_object(y, predictions)
        scaled_loss = optimizer.get_scaled_loss(loss)
        model.zero_grad()
        scaled_loss.backward()
        scaled_gradients = [v.value.grad for v in model.trainable_variables]
        gradients = optimizer.get_unscaled_gradients(scaled_gradients)
        with torch.no_grad():
            optimizer.apply_gradients(
                zip(gradients, model.trainable_variables, strict=True)
            )
        return loss.detach()

    return train_step


def batches(x, y, batch_size, shuffle_seed=None):
    """Stands in for the guide's `tf.data` pipeline on every backend."""
    order = np.arange(len(x))
    if shuffle_seed is not None:
        np.random.default_rng(shuffle_seed).shuffle(order)
    for start in range(0, len(x), batch_size):
        index = order[start : start + batch_size]
        yield x[index], y[index]


def test_guide_custom_training_loop():
    model, (x_train, y_train), (x_test, y_test) = guide_model()
    initial_weights = model.get_weights()

    optimizer = keras.optimizers.RMSprop()
    optimizer = mixed_precision.LossScaleOptimizer(optimizer)

    loss_object = keras.losses.SparseCategoricalCrossentropy()
    train_step = make_train_step(model, optimizer, loss_object)

    def test_step(x):
        return model(x, training=False)

    model.set_weights(initial_weights)
    accuracies, epoch_losses = [], []
    for epoch in range(3):
        epoch_loss_avg = keras.metrics.Mean()
        test_accuracy = keras.metrics.SparseCategoricalAccuracy(
            name="test_accuracy"
        )
        for x, y in batches(x_train, y_train, 128, shuffle_seed=epoch):
            loss = train_step(x, y)
            epoch_loss_avg(loss)
        for x, y in batches(x_test, y_test, 128):
            predictions = test_step(x)
            test_accuracy.update_state(y, predictions)
        epoch_losses.append(float(epoch_loss_avg.result()))
        accuracies.append(float(test_accuracy.result()))

    assert epoch_losses[-1] < epoch_losses[0]
    assert accuracies[-1] > 0.5
    assert int(optimizer.iterations) + optimizer.skipped_steps == 3 * 4
    assert np.isfinite(float(optimizer.loss_scale))
    assert all(np.isfinite(w).all() for w in model.get_weights())


@TENSORFLOW_ONLY
def test_guide_custom_training_loop_with_tf_data_as_written():
    tf = importlib.import_module("tensorflow")
    model, (x_train, y_train), (x_test, y_test) = guide_model()
    optimizer = mixed_precision.LossScaleOptimizer(keras.optimizers.RMSprop())
    loss_object = keras.losses.SparseCategoricalCrossentropy()
    train_dataset = (
        tf.data.Dataset.from_tensor_slices((x_train, y_train))
        .shuffle(10000)
        .batch(128)
    )
    train_step = make_train_step(model, optimizer, loss_object)
    losses = [float(train_step(x, y)) for x, y in train_dataset]
    assert losses[-1] < losses[0]
    assert int(optimizer.iterations) + optimizer.skipped_steps == 4


def test_docstring_loss_scale_optimizer_custom_loop():
    opt = keras.optimizers.SGD(0.25)
    opt = mixed_precision.LossScaleOptimizer(opt)
    var = keras.Variable(1.0)  # the docstring's tf.Variable: TensorFlow only

    def loss_fn():
        return var**2

    opt.minimize(loss_fn, var_list=[var])  # the docstring's first step
    assert float(to_numpy(var)) == 0.5
    (grad,) = docstring_unscaled_gradients(opt, var, loss_fn)
    opt.apply_gradients([(grad, var)])  # Loss scale is updated here
    assert float(to_numpy(var)) == 0.25
    assert opt.loss_scale == 32768.0 and opt.dynamic_counter == 2


def docstring_unscaled_gradients(opt, var, loss_fn):
    """The docstring's gradient computation, for this run's backend."""
    if BACKEND == "tensorflow":
        tf = importlib.import_module("tensorflow")
        with tf.GradientTape() as tape:
            loss = loss_fn()
            scaled_loss = opt.get_scaled_loss(loss)
        scaled_grad = tape.gradient(scaled_loss, var.value)
        return opt.get_unscaled_gradients([scaled_grad])
    if BACKEND == "jax":
        jax = importlib.import_module("jax")
        scaled_grad = jax.grad(lambda v: opt.get_scaled_loss(v**2))(var.value)
        return opt.get_unscaled_gradients([scaled_grad])
    var.value.grad = None
    scaled_loss = opt.get_scaled_loss(loss_fn())
    scaled_loss.backward()
    return opt.get_unscaled_gradients([var.value.grad])


@TENSORFLOW_ONLY
def test_docstring_loss_scale_optimizer_with_a_tf_variable():
    tf = importlib.import_module("tensorflow")
    opt = mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(0.25))
    var = tf.Variable(1.0)
    loss_fn = lambda: var**2  # noqa: E731 (the docstring's own)
    with tf.GradientTape() as tape:
        loss = loss_fn()
        scaled_loss = opt.get_scaled_loss(loss)
    scaled_grad = tape.gradient(scaled_loss, var)
    (grad,) = opt.get_unscaled_gradients([scaled_grad])
    opt.apply_gradients([(grad, var)])  # Loss scale is updated here
    assert var.numpy() == 0.5


def test_docstring_loss_scale_optimizer_properties():
    opt = mixed_precision.LossScaleOptimizer(keras.optimizers.SGD())
    assert opt.dynamic is True
    assert float(opt.loss_scale) == 32768.0
    assert opt.dynamic_counter == 0
    assert opt.initial_scale == 32768.0
    assert opt.dynamic_growth_steps == 2000
    opt = mixed_precision.LossScaleOptimizer(
        keras.optimizers.SGD(), dynamic=False, initial_scale=1024
    )
    assert opt.loss_scale.numpy() == 1024.0
    assert opt.dynamic is False
    with pytest.raises(ValueError):
        mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(), False)


def test_docstring_policy():
    mixed_precision.set_global_policy("mixed_float16")
    layer = keras.layers.Dense(10)
    assert repr(layer.dtype_policy) == '<Policy "mixed_float16">'
    # Can optionally override layer to use float32 instead of float16.
    layer = keras.layers.Dense(10, dtype="float32")
    # Keras 3: a name passed as `dtype=` gives Keras' own class (README,
    # "Differences from tf.keras 2"); it equals the `Policy`.
    assert layer.dtype_policy == mixed_precision.Policy("float32")
    # Set policy back to initial float32 for future examples.
    mixed_precision.set_global_policy("float32")

    policy = mixed_precision.Policy("mixed_float16")
    layer1 = keras.layers.Dense(10)
    assert layer1.dtype_policy == mixed_precision.Policy("float32")
    layer2 = keras.layers.Dense(10, dtype=policy)
    assert repr(layer2.dtype_policy) == '<Policy "mixed_float16">'
    out = layer2(np.ones((2, 4), dtype="float32"))
    assert keras.backend.standardize_dtype(out.dtype) == "float16"
    assert layer2.kernel.dtype == "float32"


# tensorflow/models, official/modeling/performance.py, with the module it
# names `tf_keras.mixed_precision` imported from this package. Its dtypes
# are TensorFlow's; on JAX and PyTorch they are Keras' dtype names.
def models_dtypes():
    if BACKEND == "tensorflow":
        return importlib.import_module("tensorflow")
    return types.SimpleNamespace(
        float16="float16", bfloat16="bfloat16", float32="float32"
    )


def configure_optimizer(
    optimizer, use_float16=False, loss_scale=None, use_graph_rewrite=None
):
    """Configures optimizer object with performance options."""
    if use_float16:
        if loss_scale in (None, "dynamic"):
            optimizer = mixed_precision.LossScaleOptimizer(optimizer)
        else:
            # loss_scale is a number. We interpret that as a fixed loss scale.
            optimizer = mixed_precision.LossScaleOptimizer(
                optimizer, dynamic=False, initial_scale=loss_scale
            )
    return optimizer


def set_mixed_precision_policy(dtype, loss_scale=None):
    """Sets the global `mixed_precision.Policy`."""
    tf = models_dtypes()
    assert loss_scale is None
    if dtype == tf.float16:
        mixed_precision.set_global_policy("mixed_float16")
    elif dtype == tf.bfloat16:
        mixed_precision.set_global_policy("mixed_bfloat16")
    elif dtype == tf.float32:
        mixed_precision.set_global_policy("float32")
    else:
        raise ValueError(f"Unexpected dtype: {dtype}")


class TinyTask:
    """A Model Garden task with its `train_step` (base_task.py)."""

    loss = "loss"

    def build_losses(self, labels, model_outputs, aux_losses=None):
        loss = keras.ops.mean(
            keras.losses.mean_squared_error(labels, model_outputs)
        )
        if aux_losses:
            loss += keras.ops.sum(keras.ops.stack(aux_losses))
        return loss

    def train_step(self, inputs, model, optimizer, metrics=None):
        if isinstance(inputs, tuple) and len(inputs) == 2:
            features, labels = inputs
        else:
            features, labels = inputs, inputs
        tvars = model.trainable_variables
        loss, grads = self.gradients(features, labels, model, optimizer)
        if isinstance(optimizer, mixed_precision.LossScaleOptimizer):
            grads = optimizer.get_unscaled_gradients(grads)
        optimizer.apply_gradients(list(zip(grads, tvars, strict=True)))
        return {self.loss: loss}

    def gradients(self, features, labels, model, optimizer):
        """The tape part of base_task.py's step, for this backend."""
        tvars = model.trainable_variables
        if BACKEND == "tensorflow":
            tf = importlib.import_module("tensorflow")
            with tf.GradientTape() as tape:
                outputs = model(features, training=True)
                loss = self.build_losses(
                    labels=labels,
                    model_outputs=outputs,
                    aux_losses=model.losses,
                )
                # Scales loss as the default gradients allreduce performs
                # sum inside the optimizer.
                scaled_loss = (
                    loss / tf.distribute.get_strategy().num_replicas_in_sync
                )
                if isinstance(optimizer, mixed_precision.LossScaleOptimizer):
                    scaled_loss = optimizer.get_scaled_loss(scaled_loss)
            return loss, tape.gradient(scaled_loss, tvars)
        if BACKEND == "jax":
            jax = importlib.import_module("jax")

            def scaled_loss_fn(trainable, non_trainable):
                outputs, _ = model.stateless_call(
                    trainable, non_trainable, features, training=True
                )
                loss = self.build_losses(labels=labels, model_outputs=outputs)
                scaled_loss = loss
                if isinstance(optimizer, mixed_precision.LossScaleOptimizer):
                    scaled_loss = optimizer.get_scaled_loss(scaled_loss)
                return scaled_loss, loss

            grads, loss = jax.grad(scaled_loss_fn, has_aux=True)(
                [v.value for v in tvars],
                [v.value for v in model.non_trainable_variables],
            )
            return loss, grads
        outputs = model(features, training=True)
        loss = self.build_losses(
            labels=labels, model_outputs=outputs, aux_losses=model.losses
        )
        scaled_loss = loss
        if isinstance(optimizer, mixed_precision.LossScaleOptimizer):
            scaled_loss = optimizer.get_scaled_loss(scaled_loss)
        model.zero_grad()
        scaled_loss.backward()
        return loss.detach(), [v.value.grad for v in tvars]


def models_regression_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    return x, (x @ np.array([[1.0], [-2.0], [0.5], [3.0]])).astype("float32")


@pytest.mark.parametrize(
    "dtype, loss_scale, expected_scale",
    [
        ("float16", None, 32768.0),
        ("float16", "dynamic", 32768.0),
        ("float16", 128.0, 128.0),
        ("bfloat16", None, None),
        ("float32", None, None),
    ],
)
def test_model_garden_performance_and_train_step(
    dtype, loss_scale, expected_scale
):
    set_mixed_precision_policy(getattr(models_dtypes(), dtype))
    expected_policy = "float32" if dtype == "float32" else f"mixed_{dtype}"
    assert mixed_precision.global_policy().name == expected_policy
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(1, dtype="float32"),
        ]
    )
    optimizer = configure_optimizer(
        keras.optimizers.SGD(0.05),
        use_float16=dtype == "float16",
        loss_scale=loss_scale,
    )
    if expected_scale is None:
        assert not isinstance(optimizer, mixed_precision.LossScaleOptimizer)
    else:
        assert float(optimizer.loss_scale) == expected_scale
        assert optimizer.dynamic is (loss_scale != 128.0)
    x, y = models_regression_data()
    task = TinyTask()
    logs = [task.train_step((x, y), model, optimizer) for _ in range(20)]
    losses = [float(to_numpy(log["loss"])) for log in logs]
    skipped = getattr(optimizer, "skipped_steps", 0)
    assert losses[-1] < losses[0] / 2
    assert int(optimizer.iterations) + skipped == 20


def test_set_mixed_precision_policy_refuses_other_dtypes():
    with pytest.raises(ValueError, match="Unexpected dtype"):
        set_mixed_precision_policy("int32")
