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


def compiled_apply(optimizer, grads, trainable_variables, step=None):
    """Runs `step(grads, trainable_variables)` as one XLA computation.

    The function is traced once per list of variables (by identity), per
    set of gradients that are None and per value of the optimizers' plain
    Python settings (`clipnorm` set between two steps takes effect, as it
    does eagerly); the variables are captured, the gradients passed.

    Args:
        optimizer: The optimizer (`LowPrecisionOptimizer`, or the
            package's `LossScaleOptimizer`); its compiled steps are cached
            on it.
        grads: The gradients, one per variable (None for none).
        trainable_variables: The variables.
        step: The function to compile; defaults to `optimizer._apply`.
    """
    import tensorflow as tf

    step_function = step or optimizer._apply
    present = tuple(g is not None for g in grads)
    key = (
        tuple(id(v) for v in trainable_variables),
        present,
        _settings(optimizer),
    )
    cache = optimizer.__dict__.setdefault("_compiled_steps", {})
    compiled = cache.get(key)
    if compiled is None:
        variables = list(trainable_variables)

        def run(given):
            full = iter(given)
            grads = [next(full) if p else None for p in present]
            step_function(grads, variables)
            return tf.constant(0)

        compiled = tf.function(run, jit_compile=True, autograph=False)
        cache.clear()
        cache[key] = compiled
    compiled([tf.convert_to_tensor(g) for g in grads if g is not None])


def _settings(optimizer):
    """The plain Python settings of `optimizer` and the optimizers it
    wraps, which a trace freezes."""
    settings = []
    while optimizer is not None:
        settings.append(
            tuple(
                (name, value)
                for name, value in vars(optimizer).items()
                if isinstance(value, (bool, int, float, str, type(None)))
            )
        )
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return tuple(settings)


def has_sparse(grads):
    """True if a gradient is a `tf.IndexedSlices`."""
    return any(
        hasattr(g, "indices") and hasattr(g, "dense_shape") for g in grads
    )
