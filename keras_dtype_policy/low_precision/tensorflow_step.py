"""The low-precision step as one XLA computation on TensorFlow.

Keras compiles `fit`'s TensorFlow step with XLA only where there is an
accelerator; on a CPU each operation of the step is a kernel of its own,
so the rounding's reads, casts and random bits would each be a pass over
every weight. The wrapper's own part of the step (the inner optimizer's
update of every variable, the rounded writes) is compiled here with
`tf.function(jit_compile=True)`, which fuses it into one computation
whatever `fit` does. Not under a `tf.distribute` strategy with several
replicas (their gradients are summed across replicas first, which XLA
cannot do inside a replica's function): there the step runs op by op.

TensorFlow is imported inside functions, only once Keras runs on it.
"""

import keras


def can_compile(optimizer):
    """True where `optimizer`'s step runs as one XLA computation."""
    if keras.backend.backend() != "tensorflow":
        return False
    if not getattr(optimizer, "jit_compile_step", True):
        return False
    import tensorflow as tf

    if tf.distribute.has_strategy():
        strategy = tf.distribute.get_strategy()
        if strategy.num_replicas_in_sync > 1:
            return False
    return True


def compiled_apply(optimizer, grads, trainable_variables):
    """Runs `optimizer._apply` as one XLA computation.

    The function is traced once per list of variables (by identity) and
    per set of gradients that are None; the variables are captured, the
    gradients passed.

    Args:
        optimizer: The `LowPrecisionOptimizer`.
        grads: The gradients, one per variable (None for none).
        trainable_variables: The variables.
    """
    import tensorflow as tf

    present = tuple(g is not None for g in grads)
    key = (tuple(id(v) for v in trainable_variables), present)
    cache = optimizer.__dict__.setdefault("_compiled_steps", {})
    step = cache.get(key)
    if step is None:
        variables = list(trainable_variables)

        def run(given):
            full = iter(given)
            grads = [next(full) if p else None for p in present]
            optimizer._apply(grads, variables)
            return tf.constant(0)

        step = tf.function(run, jit_compile=True, autograph=False)
        cache.clear()
        cache[key] = step
    step([tf.convert_to_tensor(g) for g in grads if g is not None])
