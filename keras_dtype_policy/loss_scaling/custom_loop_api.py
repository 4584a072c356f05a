"""The custom-loop API of tf.keras 2 and of Keras, for `LossScaleOptimizer`.

Each step, `apply` (and `stateless_apply`) reads what the loop did since
the last one: a loss scaled by `scale_loss` or `get_scaled_loss` gets its
gradients unscaled, as in Keras' own wrapper; gradients unscaled by hand
(`get_unscaled_gradients`) are multiplied back by the same scale (exact for
a power of two); gradients of a loss never scaled are applied as given,
with tf.keras 2's warning (Keras' own wrapper divides them by the scale).
This is read in Python where the step runs: eagerly on torch, while tracing
on TensorFlow and JAX, where the loop's calls keep their order.
"""

import warnings

from keras import ops

from keras_dtype_policy.loss_scaling import loss_gradients
from keras_dtype_policy.loss_scaling.backend_utils import is_indexed_slices
from keras_dtype_policy.loss_scaling.backend_utils import with_values


class CustomLoopApi:
    """`get_scaled_loss`, `get_unscaled_gradients`, `minimize` (a mixin)."""

    # What the loop did since the last step (see `_begin_step`).
    _loss_scaled_by = None
    _grads_come_unscaled = False
    _unscales_this_step = True

    def get_scaled_loss(self, loss):
        """Returns the loss multiplied by the current scale.

        Args:
            loss: A loss tensor, or a callable with no arguments that
                returns one; a callable gets a callable back.

        Returns:
            The scaled loss, in the loss' dtype, or a callable returning it.
        """
        self._loss_scaled_by = "get_scaled_loss"
        if callable(loss):
            return lambda: multiply(loss(), self._current_scale())
        return multiply(loss, self._current_scale())

    def get_unscaled_gradients(self, grads):
        """Returns the gradients divided by the current scale, as the next
        `apply_gradients` (or `apply`, `stateless_apply`) expects them.

        Args:
            grads: A list of gradients; None entries stay None, and
                TensorFlow's `IndexedSlices` stay sparse.

        Returns:
            The list of unscaled gradients.
        """
        self._grads_come_unscaled = True
        reciprocal = ops.divide(1.0, self._current_scale())
        return [multiply(g, reciprocal) for g in grads]

    def scale_loss(self, loss):
        """Returns the loss multiplied by the current scale; the next
        `apply` unscales the gradients (Keras' trainers call it)."""
        self._loss_scaled_by = "scale_loss"
        return super().scale_loss(loss)

    def apply(self, grads, trainable_variables=None):
        """Applies one step of gradients, unscaled first if the loss was
        scaled (see the module docstring); a step with a NaN or Inf gradient
        is skipped."""
        grads = self._begin_step(grads)
        try:
            return super().apply(grads, trainable_variables)
        finally:
            self._unscales_this_step = True

    def minimize(self, loss, var_list, tape=None):
        """Scales the loss, takes its gradients and applies one step, as
        tf.keras 2's `minimize` did, on every backend.

        Args:
            loss: A callable with no arguments that returns the loss. On
                TensorFlow, also a loss tensor recorded on `tape`.
            var_list: The variables to minimize over: a variable, a list of
                them, or a callable returning one of those.
            tape: TensorFlow only: the `tf.GradientTape` that recorded a
                loss tensor.

        Example:

        >>> optimizer = keras_dtype_policy.LossScaleOptimizer(
        ...     keras.optimizers.SGD(0.25)
        ... )
        >>> var = keras.Variable(1.0)
        >>> optimizer.minimize(lambda: var**2, var_list=var)
        >>> float(var.numpy())
        0.5
        """
        variables = loss_gradients.variable_list(var_list)
        if not self.built:
            self.build(variables)
        grads = loss_gradients.scaled_gradients(self, loss, variables, tape)
        with loss_gradients.no_gradient_recorded():
            self.apply(grads, variables)

    def _begin_step(self, grads):
        """Reads and resets what the loop did since the last step; returns
        the gradients for the step, and sets whether it unscales them."""
        scaled_by, unscaled = self._loss_scaled_by, self._grads_come_unscaled
        self._loss_scaled_by, self._grads_come_unscaled = None, False
        _warn_about_scaling(scaled_by, unscaled)
        self._unscales_this_step = scaled_by is not None or unscaled
        if not unscaled:
            return grads
        scale = self._current_scale()
        return [multiply(g, scale) for g in grads]

    def _current_scale(self):
        return self.dynamic_scale if self.built else self.initial_scale


def multiply(value, factor):
    """`value * factor` in the value's dtype; sparse values stay sparse."""
    if value is None:
        return None
    if is_indexed_slices(value):
        return with_values(value, multiply(value.values, factor))
    value = ops.convert_to_tensor(value)
    return ops.multiply(value, ops.cast(factor, value.dtype))


def _warn_about_scaling(scaled_by, unscaled):
    """tf.keras' warnings for a custom loop that forgot a step, unless the
    loss was scaled by `scale_loss` (Keras' way: `apply` unscales)."""
    if scaled_by == "scale_loss" or (scaled_by and unscaled):
        return
    example = (
        "\n    with tf.GradientTape() as tape:\n      loss = loss_fn()\n"
        "      scaled_loss = opt.get_scaled_loss(loss)\n"
        "    scaled_grads = tape.gradient(scaled_loss, vars)\n"
        "    grads = opt.get_unscaled_gradients(scaled_grads)\n"
        "    opt.apply_gradients([(grads, var)])"
    )
    if scaled_by:
        start = (
            "You forgot to call LossScaleOptimizer.get_unscaled_gradients() "
            "before calling LossScaleOptimizer.apply_gradients() (you did "
            "call get_scaled_loss() however). The gradients are unscaled "
            "for you here, as for Keras' `scale_loss`; tf.keras 2 applied "
            "them scaled."
        )
    elif unscaled:
        start = (
            "You forgot to call LossScaleOptimizer.get_scaled_loss() before "
            "calling LossScaleOptimizer.apply_gradients() (you did call "
            "get_unscaled_gradients() however). This will likely result in "
            "worse model quality, so please call get_scaled_loss() in the "
            "correct place!"
        )
    else:
        start = (
            "You forgot to call LossScaleOptimizer.get_scaled_loss() and "
            "LossScaleOptimizer.get_unscaled_gradients() before calling "
            "LossScaleOptimizer.apply_gradients(). The loss was not "
            "scaled, so the gradients are applied as given (as tf.keras 2 "
            "did), with no protection from float16 underflow."
        )
    warnings.warn(f"{start} For example:{example}", UserWarning, stacklevel=4)
