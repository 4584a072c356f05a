"""Gradients of a loss with respect to a model's weights, on any backend.

Each backend's own autodiff is used (`jax.grad` on `stateless_call`, a
TensorFlow `GradientTape`, torch's `backward`), imported when called.
"""

import keras
import numpy as np

from keras_dtype_policy import backend_dispatch


def gradients(model, loss_of_outputs, x, caller):
    """Returns the gradients of a loss of the model's outputs on `x`.

    Args:
        model: A built `keras.Model`, run with `training=False`.
        loss_of_outputs: A function of the model's outputs returning a
            scalar loss.
        x: The inputs, as tensors.
        caller: Who asks, for the error on another backend
            (`"The audit computes"`).

    Returns:
        A list with the gradient of each of `model.trainable_variables`,
        a backend tensor, or None where the loss does not depend on it.
    """
    variables = model.trainable_variables
    backend = backend_dispatch.name()
    if backend == "jax":
        import jax

        trainable = [v.value for v in variables]
        non_trainable = [v.value for v in model.non_trainable_variables]

        def compute_loss(values):
            y_pred, _ = model.stateless_call(values, non_trainable, x)
            return loss_of_outputs(y_pred)

        return jax.grad(compute_loss)(trainable)
    if backend == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            value = loss_of_outputs(model(x, training=False))
        return tape.gradient(value, variables)
    if backend == "torch":
        for variable in variables:
            variable.value.grad = None
        loss_of_outputs(model(x, training=False)).backward()
        grads = [variable.value.grad for variable in variables]
        for variable in variables:
            variable.value.grad = None
        return grads
    raise ValueError(
        f"{caller} gradients on jax, tensorflow or torch, not on the "
        f"{backend!r} backend"
    )


def weight_gradients(model, x, y, loss):
    """Returns `{id(variable): gradient}` for the trainable variables.

    Args:
        model: A built `keras.Model`.
        x: Inputs for it.
        y: Their labels.
        loss: A loss name, or a function of `(y_true, y_pred)`; its mean
            is differentiated.

    Returns:
        float64 NumPy gradients, zeros where the loss does not depend on
        a variable.
    """
    function = keras.losses.get(loss) if isinstance(loss, str) else loss
    x = keras.tree.map_structure(keras.ops.convert_to_tensor, x)
    y = keras.tree.map_structure(keras.ops.convert_to_tensor, y)

    def mean_loss(y_pred):
        return keras.ops.mean(function(y, y_pred))

    variables = model.trainable_variables
    grads = gradients(model, mean_loss, x, "The audit computes")
    return {
        id(variable): (
            np.zeros(tuple(variable.shape))
            if grad is None
            else np.asarray(keras.ops.convert_to_numpy(grad), "float64")
        )
        for variable, grad in zip(variables, grads, strict=True)
    }


def first_samples(data, count):
    """Returns the first `count` samples of `data` (any structure)."""
    return keras.tree.map_structure(lambda a: np.asarray(a)[:count], data)
