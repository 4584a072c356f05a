"""A custom loop that never scales its loss gets its gradients as given.

Each step, the optimizer asks whether the loss was scaled since the last
step (`scale_loss`, as Keras' trainers do, or tf.keras' `get_scaled_loss`).
If it was, `apply` unscales the gradients as Keras' own wrapper does; if
not, it applies them as given, as tf.keras 2 did, with tf.keras' warning.
Each backend's own loop is run both ways: TensorFlow's `tf.GradientTape`
inside `tf.function`, JAX's `jax.grad` with `stateless_apply` inside
`jax.jit`, PyTorch's autograd eagerly.
"""

import re
import warnings

import keras
import numpy as np
import pytest
from testing import BACKEND
from testing import to_numpy

import keras_dtype_policy as kdp

NEVER_SCALED = "get_scaled_loss() and LossScaleOptimizer.get_unscaled"


def number(x):
    return float(to_numpy(x))


def test_tf_keras_docstring_example():
    # 0.5, as tf.keras 2 printed; Keras' own wrapper would divide the
    # gradient by 2**15 (0.99998).
    optimizer = kdp.LossScaleOptimizer(keras.optimizers.SGD(0.25))
    var = keras.Variable(1.0)
    optimizer.minimize(lambda: var**2, var_list=var)
    assert number(var) == 0.5
    # A gradient of var**2 at 1 computed without scaling, applied by hand.
    optimizer = kdp.LossScaleOptimizer(keras.optimizers.SGD(0.25))
    var = keras.Variable(1.0)
    with pytest.warns(UserWarning, match="applied as given"):
        optimizer.apply_gradients([(keras.ops.convert_to_tensor(2.0), var)])
    assert number(var) == 0.5


def test_each_step_asks_anew():
    optimizer = kdp.LossScaleOptimizer(
        keras.optimizers.SGD(1.0), dynamic=False, initial_scale=4
    )
    var = keras.Variable(np.float32(1.0))
    optimizer.scale_loss(1.0)
    optimizer.apply([keras.ops.convert_to_tensor(4.0)], [var])
    assert number(var) == 0.0  # 4 / 4 applied
    with pytest.warns(UserWarning, match=re.escape(NEVER_SCALED)):
        optimizer.apply([keras.ops.convert_to_tensor(1.0)], [var])
    assert number(var) == -1.0  # as given
    optimizer.scale_loss(1.0)
    optimizer.apply([keras.ops.convert_to_tensor(8.0)], [var])
    assert number(var) == -3.0


def test_a_step_never_scaled_still_skips_non_finite_gradients():
    optimizer = kdp.LossScaleOptimizer(
        keras.optimizers.SGD(1.0), initial_scale=4
    )
    var = keras.Variable(np.float32(1.0))
    with pytest.warns(UserWarning, match=re.escape(NEVER_SCALED)):
        optimizer.apply([keras.ops.convert_to_tensor(np.nan)], [var])
    assert number(var) == 1.0
    assert optimizer.loss_scale == 2.0
    assert optimizer.skipped_steps == 1


def test_tf_keras_scaling_warnings():
    # tf-keras' testScalingWarning and testScalingNoWarning, with what each
    # case applies (var starts at 1, SGD(1), scale 4, gradient 4).
    def step(calls):
        optimizer = kdp.LossScaleOptimizer(
            keras.optimizers.SGD(1.0), initial_scale=4
        )
        var = keras.Variable(np.float32(1.0))
        grad = keras.ops.convert_to_tensor(4.0)
        if "scale" in calls:
            optimizer.get_scaled_loss(keras.ops.convert_to_tensor(1.0))
        if "unscale" in calls:
            (grad,) = optimizer.get_unscaled_gradients([grad])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            optimizer.apply_gradients([(grad, var)])
        messages = [str(w.message) for w in caught]
        assert len(messages) <= 1
        return number(var), messages[0] if messages else ""

    var, message = step(())
    assert var == -3.0  # as given, as in tf.keras 2
    assert NEVER_SCALED in message
    var, message = step(("scale",))
    assert var == 0.0  # unscaled here; tf.keras 2 applied 4
    assert (
        "You forgot to call LossScaleOptimizer.get_unscaled_gradients() "
        "before" in message
    )
    var, message = step(("unscale",))
    assert var == 0.0  # 4 / 4, unscaled by hand, as in tf.keras 2
    assert "You forgot to call LossScaleOptimizer.get_scaled_loss() before" in (
        message
    )
    var, message = step(("scale", "unscale"))
    assert (var, message) == (0.0, "")


def test_keras_scale_loss_never_warns():
    optimizer = kdp.LossScaleOptimizer(
        keras.optimizers.SGD(1.0), initial_scale=4
    )
    var = keras.Variable(np.float32(1.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer.scale_loss(keras.ops.convert_to_tensor(1.0))
        optimizer.apply_gradients([(keras.ops.convert_to_tensor(4.0), var)])
    assert number(var) == 0.0


# Each backend's own loop: y = x @ w, mean squared error, three steps.

X = np.random.default_rng(0).normal(size=(16, 3)).astype("float32")
Y = np.random.default_rng(1).normal(size=(16, 1)).astype("float32")
W0 = np.full((3, 1), 0.5, "float32")
STEPS = 3


def tensorflow_loop(optimizer, spelling):
    import tensorflow as tf

    w = keras.Variable(W0)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((tf.matmul(X, w.value) - Y) ** 2)
            if spelling == "scale_loss":
                loss = optimizer.scale_loss(loss)
            elif spelling == "tf_keras":
                loss = optimizer.get_scaled_loss(loss)
        grads = tape.gradient(loss, [w.value])
        if spelling == "tf_keras":
            grads = optimizer.get_unscaled_gradients(grads)
        optimizer.apply_gradients(zip(grads, [w], strict=True))

    for _ in range(STEPS):
        step()
    return to_numpy(w)


def jax_loop(optimizer, spelling):
    import jax
    import jax.numpy as jnp

    w = keras.Variable(W0)
    optimizer.build([w])
    optimizer_values = [v.value for v in optimizer.variables]

    def loss_fn(w_value):
        return jnp.mean((jnp.matmul(X, w_value) - Y) ** 2)

    @jax.jit
    def step(w_value, optimizer_values):
        mapping = list(zip(optimizer.variables, optimizer_values, strict=True))
        with keras.StatelessScope(state_mapping=mapping):
            if spelling == "scale_loss":
                grad = jax.grad(lambda v: optimizer.scale_loss(loss_fn(v)))(
                    w_value
                )
            elif spelling == "tf_keras":
                grad = jax.grad(
                    lambda v: optimizer.get_scaled_loss(loss_fn(v))
                )(w_value)
                (grad,) = optimizer.get_unscaled_gradients([grad])
            else:
                grad = jax.grad(loss_fn)(w_value)
        (w_value,), optimizer_values = optimizer.stateless_apply(
            optimizer_values, [grad], [w_value]
        )
        return w_value, optimizer_values

    w_value = w.value
    for _ in range(STEPS):
        w_value, optimizer_values = step(w_value, optimizer_values)
    return np.asarray(w_value)


def torch_loop(optimizer, spelling):
    import torch

    w = keras.Variable(W0)
    x, y = torch.from_numpy(X), torch.from_numpy(Y)
    for _ in range(STEPS):
        loss = torch.mean((x @ w.value - y) ** 2)
        if spelling == "scale_loss":
            loss = optimizer.scale_loss(loss)
        elif spelling == "tf_keras":
            loss = optimizer.get_scaled_loss(loss)
        grads = list(torch.autograd.grad(loss, [w.value]))
        if spelling == "tf_keras":
            grads = optimizer.get_unscaled_gradients(grads)
        with torch.no_grad():
            optimizer.apply(grads, [w])
    return to_numpy(w)


LOOPS = {
    "tensorflow": tensorflow_loop,
    "jax": jax_loop,
    "torch": torch_loop,
}


@pytest.mark.parametrize("spelling", ["never", "scale_loss", "tf_keras"])
def test_backend_loop_steps_like_the_plain_optimizer(spelling):
    # The same weights as the inner optimizer alone on the unscaled loss,
    # whether the loop scales (either spelling) or never does. Dividing
    # never-scaled gradients by 2**15 would leave w almost at W0.
    loop = LOOPS[BACKEND]
    plain = loop(keras.optimizers.SGD(0.1), "never")
    assert not np.allclose(plain, W0, atol=1e-3)
    wrapped = kdp.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = loop(wrapped, spelling)
    np.testing.assert_allclose(got, plain, rtol=1e-5)
    warned = any(NEVER_SCALED in str(w.message) for w in caught)
    assert warned == (spelling == "never")
    if BACKEND != "jax":  # the JAX loop keeps the state outside
        assert int(to_numpy(wrapped.iterations)) == STEPS


def test_fit_steps_like_keras_own_wrapper():
    # Keras' trainers always call scale_loss: fit unscales as Keras' own
    # LossScaleOptimizer does.
    def kernel(optimizer):
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer, "mse")
        model.fit(X, Y, batch_size=4, epochs=2, verbose=0)
        return to_numpy(model.layers[0].kernel)

    ours = kernel(kdp.LossScaleOptimizer(keras.optimizers.SGD(0.1)))
    keras_own = kernel(
        keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    )
    np.testing.assert_allclose(ours, keras_own, rtol=1e-6)
