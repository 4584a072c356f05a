"""One loss-scaling step under `tf.distribute`, decided for all replicas.

Keras' trainer hands the optimizer each replica's local gradients; they are
summed across replicas only inside the inner optimizer. Keras' own
`LossScaleOptimizer` decides whether to skip a step from the first local
replica's gradients alone, so a NaN on another replica reaches the weights.
Here every replica reports whether its local gradients are finite, the
reports are reduced across all replicas (and workers), and the one verdict
steers the step everywhere: all replicas apply it or all skip it.

TensorFlow is imported inside the functions, only once Keras runs on it.
"""

import warnings

from keras_dtype_policy import backend_dispatch


def apply(optimizer, grads, trainable_variables=None):
    """Applies or skips one step of `optimizer` on all replicas together.

    Args:
        optimizer: A built `keras_dtype_policy.LossScaleOptimizer`.
        grads: This replica's gradients, still scaled.
        trainable_variables: The variables the gradients belong to.
    """
    import tensorflow as tf

    if tf.distribute.in_cross_replica_context():
        raise ValueError(
            "`apply()` must be called in a replica context (inside "
            "`strategy.run`), not in the cross-replica context."
        )
    if not tf.distribute.has_strategy():
        optimizer._common_apply(grads, trainable_variables)
        return
    if tf.__internal__.distribute.strategy_supports_no_merge_call():
        # Collectives run in the replica context (XLA on GPUs).
        replica_context = tf.distribute.get_replica_context()
        local = _count_non_finite(optimizer, grads)
        non_finite = replica_context.all_reduce(
            tf.distribute.ReduceOp.SUM, local
        )
        optimizer._common_apply(
            grads, trainable_variables, finite=tf.equal(non_finite, 0.0)
        )
        return

    def step_for_all_replicas(strategy, grads, trainable_variables):
        local = strategy.extended.call_for_each_replica(
            _count_non_finite, args=(optimizer, grads)
        )
        non_finite = strategy.reduce(
            tf.distribute.ReduceOp.SUM, local, axis=None
        )
        finite = tf.equal(non_finite, 0.0)

        def apply_step():
            strategy.extended.call_for_each_replica(
                optimizer._stateful_handle_finite_grads,
                args=(grads, trainable_variables),
            )

        # The cond runs in the cross-replica context: TensorFlow refuses a
        # cond in a replica context whose branch calls `merge_call`, as the
        # inner optimizer's apply does.
        tf.cond(finite, apply_step, optimizer._stateful_handle_non_finite_grads)

    tf.distribute.get_replica_context().merge_call(
        step_for_all_replicas, args=(grads, trainable_variables)
    )


def outside_strategies():
    """True outside every `tf.distribute` strategy (the default one)."""
    import tensorflow as tf

    return not tf.distribute.has_strategy()


def _count_non_finite(optimizer, grads):
    """Returns 1.0 if this replica's gradients hold a NaN or Inf, else 0.0.

    (`tf.distribute` reduces by sum or mean only; a sum of these counts the
    replicas that overflowed.)
    """
    import tensorflow as tf

    return tf.cast(tf.logical_not(optimizer.check_finite(grads)), "float32")


def spans_replicas(model):
    """Returns True if `model` trains on several `tf.distribute` replicas."""
    if not backend_dispatch.is_tensorflow():
        return False
    strategy = getattr(model, "distribute_strategy", None)
    return getattr(strategy, "num_replicas_in_sync", 1) > 1


def warn_xla_unsupported(model):
    """Warns that `model` compiles without XLA under its strategy."""
    strategy = type(model.distribute_strategy).__name__
    warnings.warn(
        "`jit_compile=True` does not work with loss scaling under "
        f"{strategy} over {model.distribute_strategy.num_replicas_in_sync} "
        "replicas: Keras XLA-compiles the whole `strategy.run`, which "
        "reaches variables on other devices and calls `merge_call` inside "
        "XLA (keras-team/keras#21366). Compiling with `jit_compile=False`.",
        stacklevel=3,
    )
