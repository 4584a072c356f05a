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

XLA keeps every temporary of one computation (the float32 values of 8-bit
state while it is requantized, the new values of the variables) until the
computation ends, so a model larger than `GROUP_ELEMENTS` elements is
updated group by group, one compiled computation each, after the parts of
the step that need every gradient (clipping by the global norm, the
learning rate, Nadam's product) ran once: the step's peak memory is then
bounded by a group's temporaries, not the whole model's.

TensorFlow is imported inside functions, only once Keras runs on it.
"""

import keras

# The most elements of variables one compiled computation updates.
GROUP_ELEMENTS = 2**23


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


def in_groups(variables):
    """True where the step over `variables` runs group by group: not
    inside a computation being traced (the package's `LossScaleOptimizer`
    compiles its whole step), where groups would be one computation."""
    import tensorflow as tf

    return _elements(variables) > GROUP_ELEMENTS and not tf.inside_function()


def grouped_apply(optimizer, grads, trainable_variables):
    """Runs a `LowPrecisionOptimizer`'s step group by group.

    The gradients are prepared once (summed, unscaled, clipped), then each
    group of variables of at most `GROUP_ELEMENTS` elements (a larger
    variable alone) is updated by its own compiled computation, traced
    once per group; the iteration count advances at the end.

    Args:
        optimizer: The `LowPrecisionOptimizer`.
        grads: The gradients, one per variable (None for none).
        trainable_variables: The variables.
    """
    import tensorflow as tf

    inner = optimizer.inner_optimizer
    # Dense, as the one computation of `compiled_apply` makes them (an
    # embedding's gradient is a `tf.IndexedSlices`).
    grads = [None if g is None else tf.convert_to_tensor(g) for g in grads]
    with keras.name_scope(inner.name, caller=inner):
        grads, variables, learning_rate = optimizer._prepare_step(
            grads, list(trainable_variables)
        )
        learning_rate = tf.cast(learning_rate, "float32")
        cache = optimizer.__dict__.setdefault("_compiled_groups", {})
        settings = _settings(optimizer)
        groups = list(_groups(variables))
        if len(cache) > len(groups):
            cache.clear()
        start = 0
        for index, group in enumerate(groups):
            group_grads = grads[start : start + len(group)]
            start += len(group)
            key = (tuple(id(v) for v in group), settings)
            held = cache.get(index)
            if held is None or held[0] != key:
                held = (key, _group_step(optimizer, group))
                cache[index] = held
            held[1](
                [tf.convert_to_tensor(g) for g in group_grads], learning_rate
            )
        inner._iterations.assign_add(1)


def _group_step(optimizer, group):
    """The compiled update of one group of variables."""
    import tensorflow as tf

    def run(grads, learning_rate):
        optimizer._run_updates(grads, group, learning_rate)
        return tf.constant(0)

    return tf.function(run, jit_compile=True, autograph=False)


def _groups(variables):
    """`variables` in order, in groups of at most `GROUP_ELEMENTS`
    elements (a larger variable in a group of its own)."""
    group, filled = [], 0
    for variable in variables:
        size = _elements([variable])
        if group and filled + size > GROUP_ELEMENTS:
            yield group
            group, filled = [], 0
        group.append(variable)
        filled += size
    if group:
        yield group


def _elements(variables):
    total = 0
    for variable in variables:
        count = 1
        for dimension in variable.shape:
            count *= int(dimension)
        total += count
    return total


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
