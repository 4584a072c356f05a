"""What the wrapper runs of the inner optimizer's step besides its updates.

`LowPrecisionOptimizer` runs the inner optimizer's per-variable
`update_step` itself, so what the inner optimizer's `apply` would do
around those updates is done here: summing the replicas' gradients under
`tf.distribute`, and advancing state kept once a step (Nadam's).

The TensorFlow part is `tensorflow_step.summed_across_replicas`, reached
through `backend_dispatch`.
"""

import keras
from keras import ops

from keras_dtype_policy import backend_dispatch


def summed_across_replicas(grads):
    """Sums each replica's gradients under a `tf.distribute` strategy.

    Only TensorFlow hands the optimizer each replica's own gradients;
    elsewhere they come summed (see `tensorflow_step.summed_across_replicas`).

    Args:
        grads: This replica's gradients.

    Returns:
        The gradients summed over the replicas, or `grads` unchanged.
    """
    if not backend_dispatch.is_tensorflow():
        return grads
    step = backend_dispatch.module_for("low_precision_step")
    return step.summed_across_replicas(grads)


def advance_step_state(inner):
    """Advances what `inner` updates once a step, before the per-variable
    updates.

    Of Keras' optimizers only Nadam has such state: the product of its
    momentum schedule, `u_product *= beta_1 * (1 - 0.5 * 0.96**(t + 1))`.

    Args:
        inner: The inner `keras.optimizers.Optimizer`.
    """
    if not isinstance(inner, keras.optimizers.Nadam):
        return
    step = ops.cast(inner.iterations + 1, "float32")
    factor = inner.beta_1 * (1.0 - 0.5 * ops.power(0.96, step))
    product = ops.cast(inner._u_product, "float32")
    inner.assign(inner._u_product, ops.multiply(product, factor))
