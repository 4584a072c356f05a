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
computation ends, and compiling a computation takes some 15-20 MiB a
variable it updates for a moment (1.8 GiB for a 64-layer Dense stack of
266k parameters as one computation). So a model of more than
`XLA_GROUP_ELEMENTS` elements or `XLA_GROUP_VARIABLES` variables is
updated group by group, one compiled computation each, after the parts of
the step that need every gradient (clipping by the global norm, the
learning rate, Nadam's product) ran once: the step's peak memory is then
bounded by a group's temporaries and compilation, not the whole model's.
Groups whose variables and state have the same shapes and dtypes share
one compiled computation, the variables passed in (`SharedGroupStep`): a
model of N equal layers compiles its update once, not N times (each
computation keeps ~13 MiB of traced graph and compiled code resident).

This module imports TensorFlow at its top: the package reaches it through
`backend_dispatch.module_for("low_precision_step")`, only on TensorFlow.
"""

import contextlib
import dataclasses
import threading
import typing

import keras
import tensorflow as tf

from keras_dtype_policy.low_precision import block_codes
from keras_dtype_policy.low_precision import slot_lists

# The most elements of variables one XLA computation updates (the torch
# step's groups are `torch_step`'s own).
XLA_GROUP_ELEMENTS = 2**23
# The most variables one XLA computation updates.
XLA_GROUP_VARIABLES = 4
# The most variables whose whole loss-scaled step (the check, the inner
# optimizer's update, the scale's) the package's `LossScaleOptimizer`
# compiles as one computation; above, it runs op by op as Keras' own
# wrapper does. Compiling Adam's step takes ~2.4 MiB a variable (a Dense
# stack of 128 variables: 1191 MiB at its peak against Keras' 878).
XLA_WHOLE_STEP_VARIABLES = 16

# The inner optimizers whose update of a variable depends, beyond the
# shapes and dtypes of its state, only on what `_group_signature` keys:
# groups of these share compiled steps. A subclass may decide more from
# a variable's name or path, so exactly these classes.
SHAREABLE_OPTIMIZERS = (
    keras.optimizers.Adadelta,
    keras.optimizers.Adagrad,
    keras.optimizers.Adam,
    keras.optimizers.Adamax,
    keras.optimizers.AdamW,
    keras.optimizers.Lion,
    keras.optimizers.Nadam,
    keras.optimizers.RMSprop,
    keras.optimizers.SGD,
)

# Set while `compiled_apply` traces its one XLA computation, in which
# groups would be that same computation.
_TRACING = threading.local()


@dataclasses.dataclass(frozen=True)
class PlainSettings:
    """An optimizer's plain Python settings, which a trace freezes.

    Attributes:
        pairs: `(attribute, value)` of each attribute holding a bool, a
            number, a string or None, in the optimizer's order.
    """

    pairs: tuple


@dataclasses.dataclass(frozen=True)
class TraceKey:
    """What a compiled step was traced for; any change traces it again.

    Attributes:
        variables: The `id` of each variable updated, in order.
        present: For each gradient, whether it is not None.
        settings: The `PlainSettings` of the optimizer and of each
            optimizer it wraps, outermost first.
    """

    variables: tuple
    present: tuple
    settings: tuple


class CompiledGroup(typing.NamedTuple):
    """The compiled update of one group, with what it was traced for."""

    key: TraceKey
    step: typing.Callable


class SharedGroupStep:
    """One compiled update for every group of one `_group_signature`.

    Traced on the first group (the template) with the tensors of every
    variable storing the group's state passed in as arguments, so that a
    later group's call binds its own variables in their place. Before a
    second group uses it, that group is traced alone and the two traces'
    captured tensors compared: any difference means the update reached
    state that is not passed in, and every group then gets its own
    computation (`usable` False).

    Args:
        optimizer: The `LowPrecisionOptimizer`.
        template: The first group's variables.
    """

    def __init__(self, optimizer, template):
        self.optimizer = optimizer
        self.template = template
        self.function = _state_step(optimizer, template)
        self.checked = False
        self.usable = True

    def check(self, group, state, grads, learning_rate):
        """Sets `usable` from a trace of `group` alone (once)."""
        if self.checked:
            return
        self.checked = True
        template_state = _state_tensors(self.optimizer, self.template)
        traced = self.function.get_concrete_function(
            template_state, grads, learning_rate
        )
        alone = _state_step(self.optimizer, group).get_concrete_function(
            state, grads, learning_rate
        )
        self.usable = _same_captures(traced, alone)


class BoundGroupStep(typing.NamedTuple):
    """A `SharedGroupStep` bound to one group's state tensors; called as
    the group's own compiled step is, `step(grads, learning_rate)`."""

    shared: SharedGroupStep
    state: list

    def __call__(self, grads, learning_rate):
        return self.shared.function(self.state, grads, learning_rate)


def apply(wrapper, grads, trainable_variables):
    """Runs a `LowPrecisionOptimizer`'s step on TensorFlow.

    As one XLA computation, group by group above `XLA_GROUP_ELEMENTS`
    elements or `XLA_GROUP_VARIABLES` variables, or op by op where it
    cannot compile (`can_compile`).

    Args:
        wrapper: The `LowPrecisionOptimizer`.
        grads: The gradients, one per variable (None for none).
        trainable_variables: The variables.
    """
    if not can_compile(wrapper):
        return wrapper._apply(grads, trainable_variables)
    if in_groups(trainable_variables):
        return grouped_apply(wrapper, grads, trainable_variables)
    return compiled_apply(wrapper, grads, trainable_variables)


def can_compile(optimizer):
    """True where `optimizer`'s step runs as one XLA computation."""
    if not getattr(optimizer, "jit_compile_step", True):
        return False
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
            in its `step_cache`.
        grads: The gradients, one per variable (None for none).
        trainable_variables: The variables.
        step: The function to compile; defaults to `optimizer._apply`.
    """
    step_function = step or optimizer._apply
    present = tuple(g is not None for g in grads)
    key = TraceKey(
        variables=tuple(id(v) for v in trainable_variables),
        present=present,
        settings=_settings(optimizer),
    )
    cache = step_cache(optimizer).steps
    compiled = cache.get(key)
    if compiled is None:
        variables = list(trainable_variables)

        def run(given):
            full = iter(given)
            grads = [next(full) if p else None for p in present]
            with _tracing_one_computation():
                step_function(grads, variables)
            return tf.constant(0)

        compiled = tf.function(run, jit_compile=True, autograph=False)
        cache.clear()
        cache[key] = compiled
    compiled([tf.convert_to_tensor(g) for g in grads if g is not None])


def compiles_whole_step(variables):
    """True where a loss-scaled step over `variables` is compiled as one
    XLA computation (at most `XLA_WHOLE_STEP_VARIABLES` variables)."""
    return len(variables) <= XLA_WHOLE_STEP_VARIABLES


def step_cache(optimizer):
    """The `StepCache` that `optimizer` (a `LowPrecisionOptimizer` or the
    package's `LossScaleOptimizer`) declares in `__init__`."""
    return optimizer._step_cache


def in_groups(variables):
    """True where the step over `variables` runs group by group.

    Above `XLA_GROUP_ELEMENTS` elements or `XLA_GROUP_VARIABLES`
    variables, eagerly and inside `fit`'s `tf.function` alike (each group
    is an XLA computation of its own there too), but not while
    `compiled_apply` traces one computation for the whole step, where the
    groups would be that one computation.
    """
    large = (
        _elements(variables) > XLA_GROUP_ELEMENTS
        or len(variables) > XLA_GROUP_VARIABLES
    )
    return large and not getattr(_TRACING, "active", False)


@contextlib.contextmanager
def _tracing_one_computation():
    previous = getattr(_TRACING, "active", False)
    _TRACING.active = True
    try:
        yield
    finally:
        _TRACING.active = previous


def grouped_apply(optimizer, grads, trainable_variables):
    """Runs a `LowPrecisionOptimizer`'s step group by group.

    The gradients are prepared once (summed, unscaled, clipped), then each
    group of at most `XLA_GROUP_VARIABLES` variables of at most
    `XLA_GROUP_ELEMENTS` elements (a larger variable alone) is updated
    by its own compiled computation (`SharedGroupStep`s shared by groups
    of the same shapes), traced once per group; the iteration count
    advances at the end.

    Args:
        optimizer: The `LowPrecisionOptimizer`.
        grads: The gradients, one per variable (None for none).
        trainable_variables: The variables.
    """
    inner = optimizer.inner_optimizer
    # Dense, as the one computation of `compiled_apply` makes them (an
    # embedding's gradient is a `tf.IndexedSlices`).
    grads = [None if g is None else tf.convert_to_tensor(g) for g in grads]
    with keras.name_scope(inner.name, caller=inner):
        prepared = optimizer._prepare_step(grads, list(trainable_variables))
        grads = prepared.grads
        learning_rate = tf.cast(prepared.learning_rate, "float32")
        cache = step_cache(optimizer).groups
        settings = _settings(optimizer)
        groups = list(_groups(prepared.variables))
        if len(cache) > len(groups):
            cache.clear()
            step_cache(optimizer).shared.clear()
        start = 0
        for index, group in enumerate(groups):
            group_grads = grads[start : start + len(group)]
            start += len(group)
            key = TraceKey(tuple(id(v) for v in group), (), settings)
            held = cache.get(index)
            group_grads = [tf.convert_to_tensor(g) for g in group_grads]
            if held is None or held.key != key:
                step = _shared_step(
                    optimizer, group, group_grads, learning_rate
                )
                held = CompiledGroup(key, step or _group_step(optimizer, group))
                cache[index] = held
            held.step(group_grads, learning_rate)
        inner._iterations.assign_add(1)


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
    if not tf.distribute.has_strategy() or (
        tf.distribute.in_cross_replica_context()
    ):
        return grads
    context = tf.distribute.get_replica_context()
    if context.num_replicas_in_sync == 1:
        return grads
    return context.all_reduce(tf.distribute.ReduceOp.SUM, list(grads))


def has_sparse(grads):
    """True if a gradient is a `tf.IndexedSlices` (or `tf.SparseTensor`)."""
    return any(
        isinstance(g, (tf.IndexedSlices, tf.SparseTensor)) for g in grads
    )


def _group_step(optimizer, group):
    """The compiled update of one group of variables."""

    def run(grads, learning_rate):
        optimizer._run_updates(grads, group, learning_rate)
        return tf.constant(0)

    return tf.function(run, jit_compile=True, autograph=False)


def _shared_step(optimizer, group, grads, learning_rate):
    """The step of `group` through its signature's `SharedGroupStep`, or
    None where the group cannot share one."""
    signature = _group_signature(optimizer, group)
    if signature is None:
        return None
    shared = step_cache(optimizer).shared
    entry = shared.get(signature)
    state = _state_tensors(optimizer, group)
    if entry is None:
        entry = SharedGroupStep(optimizer, group)
        shared[signature] = entry
    elif [id(v) for v in entry.template] != [id(v) for v in group]:
        entry.check(group, state, grads, learning_rate)
    return BoundGroupStep(entry, state) if entry.usable else None


def _group_signature(optimizer, group):
    """What a group's compiled update depends on besides the values of
    its state: the optimizers' settings and, a variable, the shapes and
    dtypes of its stored state and what the update decides from the
    variable itself. None where the update may depend on more
    (`SHAREABLE_OPTIMIZERS`, a constraint) or the state cannot be told."""
    inner = optimizer.inner_optimizer
    if type(inner) not in SHAREABLE_OPTIMIZERS:
        return None
    if inner.gradient_accumulation_steps or inner.use_ema:
        return None
    entries = []
    for variable in group:
        stored = slot_lists.stored_state(optimizer, variable)
        if stored is None or variable.constraint is not None:
            return None
        decays = inner.weight_decay is not None and inner._use_weight_decay(
            variable
        )
        entries.append(
            (
                bool(getattr(variable, "overwrite_with_gradient", False)),
                decays,
                tuple(
                    (tuple(v.shape), keras.backend.standardize_dtype(v.dtype))
                    for v in stored
                ),
            )
        )
    return (_settings(optimizer), tuple(entries))


def _state_tensors(optimizer, group):
    """The `tf.Variable`s storing `group`'s state, flat, in a fixed order."""
    return [
        variable.value
        for weight in group
        for variable in slot_lists.stored_state(optimizer, weight)
    ]


def _state_step(optimizer, group):
    """The compiled update of `group`, its state passed in."""

    def run(state, grads, learning_rate):
        del state  # Bound in place of the group's variables by tracing.
        optimizer._run_updates(grads, group, learning_rate)
        return tf.constant(0)

    return tf.function(run, jit_compile=True, autograph=False)


def _same_captures(first, second):
    """True if two concrete functions capture the very same tensors."""
    first_inputs = first.captured_inputs
    second_inputs = second.captured_inputs
    return len(first_inputs) == len(second_inputs) and all(
        a is b for a, b in zip(first_inputs, second_inputs, strict=True)
    )


def _groups(variables):
    """`variables` in order, in groups of at most `XLA_GROUP_VARIABLES`
    variables and `XLA_GROUP_ELEMENTS` elements (a larger variable in a
    group of its own)."""
    group, filled = [], 0
    for variable in variables:
        size = block_codes.element_count(variable.shape)
        full = len(group) >= XLA_GROUP_VARIABLES
        if group and (full or filled + size > XLA_GROUP_ELEMENTS):
            yield group
            group, filled = [], 0
        group.append(variable)
        filled += size
    if group:
        yield group


def _elements(variables):
    return sum(block_codes.element_count(v.shape) for v in variables)


def _settings(optimizer):
    """The `PlainSettings` of `optimizer` and of the optimizers it wraps,
    outermost first."""
    settings = []
    while optimizer is not None:
        settings.append(
            PlainSettings(
                tuple(
                    (name, value)
                    for name, value in vars(optimizer).items()
                    if isinstance(value, (bool, int, float, str, type(None)))
                )
            )
        )
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return tuple(settings)
