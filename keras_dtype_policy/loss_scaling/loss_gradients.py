"""The gradients of a scaled loss, on each backend, for `minimize`.

tf.keras 2's `LossScaleOptimizer.minimize(loss, var_list)` scaled the loss,
took its gradients and applied them. Keras 3 optimizers have no `minimize`;
each backend differentiates its own way:

- TensorFlow records the loss on a `tf.GradientTape` (the caller's, if it
  passes one, as tf.keras allowed for a loss tensor);
- JAX differentiates the loss callable as a function of the variables'
  values (`jax.grad`, the variables mapped in a `keras.StatelessScope`);
- PyTorch runs the loss callable and calls `torch.autograd.grad`.

A non-scalar loss is summed first, as `tf.GradientTape.gradient` does. The
backend is asked of `backend_dispatch` and imported inside the functions,
only once Keras runs on it.
"""

import contextlib

import keras
from keras import ops

from keras_dtype_policy import backend_dispatch


def variable_list(var_list):
    """Returns `var_list` as a list of variables.

    Args:
        var_list: A variable, a list or tuple of variables, or a callable
            with no arguments that returns one of those (as in tf.keras).
    """
    if callable(var_list) and not isinstance(var_list, keras.Variable):
        var_list = var_list()
    if isinstance(var_list, (list, tuple)):
        variables = list(var_list)
    else:
        variables = [var_list]
    if not variables:
        raise ValueError(
            "`var_list` must hold at least one variable. "
            f"Received: var_list={var_list!r}"
        )
    return variables


def scaled_gradients(optimizer, loss, variables, tape=None):
    """Returns the gradients of `optimizer.scale_loss(loss)`.

    Args:
        optimizer: The loss-scale optimizer whose `scale_loss` scales.
        loss: A callable with no arguments returning the loss; on
            TensorFlow, also a loss tensor recorded on `tape`.
        variables: The variables to differentiate by.
        tape: TensorFlow only: the `tf.GradientTape` that recorded a loss
            tensor.

    Returns:
        A list of gradients, one per variable (None where unconnected).
    """
    backend = backend_dispatch.name()
    if backend_dispatch.is_tensorflow():
        return _tensorflow_gradients(optimizer, loss, variables, tape)
    if tape is not None:
        raise ValueError(
            "`tape` is a TensorFlow `GradientTape`, and exists on the "
            f"TensorFlow backend only; Keras runs on {backend}. Pass the "
            f"loss as a callable. Received: tape={tape!r}"
        )
    if not callable(loss):
        raise TypeError(
            f"On the {backend} backend, `loss` must be a callable with no "
            "arguments that returns the loss (a tensor cannot be "
            f"differentiated afterwards). Received: loss={loss!r} "
            f"(of type {type(loss).__name__})"
        )
    if backend_dispatch.is_jax():
        return _jax_gradients(optimizer, loss, variables)
    if backend_dispatch.is_torch():
        return _torch_gradients(optimizer, loss, variables)
    raise ValueError(
        f"`minimize` supports the tensorflow, jax and torch backends. "
        f"Received: backend={backend!r}"
    )


def _scaled_sum(optimizer, loss):
    return ops.sum(optimizer.scale_loss(loss))


def _tensorflow_gradients(optimizer, loss, variables, tape):
    import tensorflow as tf

    if tape is None:
        if not callable(loss):
            raise ValueError(
                "`tape` is required when a `Tensor` loss is passed. "
                f"Received: loss={loss!r}, tape=None"
            )
        tape = tf.GradientTape()
    with tape:
        tape.watch([v.value for v in variables])
        value = loss() if callable(loss) else loss
        scaled = _scaled_sum(optimizer, value)
    return tape.gradient(scaled, [v.value for v in variables])


def _jax_gradients(optimizer, loss, variables):
    import jax

    def scaled_loss(values):
        mapping = list(zip(variables, values, strict=True))
        with keras.StatelessScope(state_mapping=mapping):
            return _scaled_sum(optimizer, loss())

    return list(jax.grad(scaled_loss)([v.value for v in variables]))


def _torch_gradients(optimizer, loss, variables):
    import torch

    scaled = _scaled_sum(optimizer, loss())
    return list(
        torch.autograd.grad(
            scaled, [v.value for v in variables], allow_unused=True
        )
    )


def no_gradient_recorded():
    """Returns a context in which PyTorch records no gradient (a step's
    writes to the weights are no part of the loss); elsewhere, nothing."""
    if backend_dispatch.is_torch():
        import torch

        return torch.no_grad()
    return contextlib.nullcontext()
