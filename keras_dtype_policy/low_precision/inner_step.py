"""What the wrapper runs of the inner optimizer's step besides its updates.

`LowPrecisionOptimizer` runs the inner optimizer's per-variable
`update_step` itself, so what the inner optimizer's `apply` would do
around those updates is done here: summing the replicas' gradients under
`tf.distribute`, and advancing state kept once a step (Nadam's).

TensorFlow is imported inside a function, only once Keras runs on it.
"""

import keras
from keras import ops


def summed_across_replicas(grads):
    """Sums each replica's gradients under a `tf.distribute` strategy.

    Keras' trainer hands the optimizer each replica's local gradients, and
    its TensorFlow optimizer sums them before the update. Every replica then
    writes the same values into its copy of each variable.

    Args:
        grads: This replica's gradients.

    Returns:
        The gradients summed over the replicas, or `grads` unchanged
        outside a strategy's replica context with several replicas.
    """
    if keras.backend.backend() != "tensorflow":
        return grads
    import tensorflow as tf

    if not tf.distribute.has_strategy() or (
        tf.distribute.in_cross_replica_context()
    ):
        return grads
    context = tf.distribute.get_replica_context()
    if context.num_replicas_in_sync == 1:
        return grads
    return context.all_reduce(tf.distribute.ReduceOp.SUM, list(grads))


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
