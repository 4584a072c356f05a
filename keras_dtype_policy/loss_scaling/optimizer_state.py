"""Reading optimizer state in the layout tf.keras 2 saved it.

tf.keras 2 optimizers saved `[iteration, slots...]`, the slots in the order
their `build` made them (Adam: `m`, `v` for each variable in turn, then the
`vhat`s). Keras 3 optimizers hold `[iteration, learning_rate, slots...]`
with the same slots in the same order, so the state carries over once the
learning rate is left out (see `tf_keras_layout` for the exceptions).
tf.keras files hold no loss-scale state (neither the current scale nor its
counter), so a `LossScaleOptimizer` restored from one starts from its
initial scale.

Which optimizers read saved state this way, and when, is
`state_arrival`'s concern.
"""

import contextlib
import warnings
from typing import NamedTuple

import keras
import numpy as np

from keras_dtype_policy import backend_dispatch
from keras_dtype_policy.low_precision import optimizer_values


def assign_optimizer_values(optimizer, values, strict=False):
    """Assigns saved values to a built optimizer, Keras 3 or tf.keras layout.

    Values in the optimizer's own layout are assigned in order. Otherwise
    they are read in the layout tf.keras 2 saved for the same optimizer (see
    `tf_keras_layout`), or as the lone iteration count tf.keras saved for
    an optimizer that had not stepped yet: saved slots that Keras 3 has no
    place for are dropped, and state that tf.keras did not save is derived
    from the rest where it can be (see `_derive_unsaved_state`).

    A layout fits when it has as many places as there are values, each of
    the value's shape and kind of dtype (integer, floating point, boolean),
    and, where the values carry the names they were saved under (an .h5
    file's datasets), each name ends with the name of its place's role
    (`iteration`, `learning_rate`, a slot's name). Nothing is assigned
    unless a layout fits.

    Values that make no sense (a negative step count, a NaN learning
    rate) are refused or warned about before anything is assigned (see
    `optimizer_values.check_saved`).

    Args:
        optimizer: A built `keras.optimizers.Optimizer` (not a wrapper).
        values: The saved arrays, in saved order.
        strict: Whether a learning rate out of range is refused (for the
            package's own optimizers) rather than warned about.

    Returns:
        True if the values fitted one of the layouts and were assigned,
        False (and nothing assigned) otherwise.

    Raises:
        ValueError: for a value out of range, naming the variable.
    """
    names = saved_names(values)
    values = [np.asarray(v) for v in values]
    variables = list(optimizer.variables)
    if fits(variables, values, names, roles(optimizer)):
        targets = variables
    elif _saved_before_build(values):
        targets = [optimizer.iterations]
    else:
        layout = tf_keras_layout(optimizer)
        if layout is None or not fits(layout, values):
            return False
        targets = layout
    optimizer_values.check_saved(targets, values, strict)
    for target, value in zip(targets, values, strict=True):
        if isinstance(target, _Dropped):
            continue
        target.assign(value)
    if targets is not variables:
        _derive_unsaved_state(optimizer)
    return True


def saved_names(values):
    """Returns the name each value was saved under, or None if unknown.

    Only an .h5 file's datasets (and the arrays `keep_pending_values` kept
    of them) carry a name: the optimizer variable's path in a Keras 3 file,
    `<optimizer>/<variable>/<slot>:0` in a tf.keras 2 one. A `.keras` or
    `.weights.h5` store numbers its values instead.
    """
    names = []
    for value in values:
        name = getattr(value, "saved_name", None)
        if name is None and not isinstance(value, np.ndarray):
            name = getattr(value, "name", None)
        if not isinstance(name, str) or name.rsplit("/", 1)[-1].isdigit():
            return None
        names.append(name.removeprefix("/optimizer_weights/"))
    return names


def roles(optimizer):
    """Returns, for each variable of `optimizer`, the name of its role.

    A slot's role is its slot name (`momentum`, `velocity`: its name less
    the path of the variable it belongs to); any other variable's is its
    own name (`iteration`, `learning_rate`, `dynamic_scale`). A loss-scale
    optimizer's variables are its own, then its inner optimizer's.
    """
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None:
        own = list(getattr(optimizer, "_variables", ()))
        return [v.name for v in own] + roles(inner)
    prefixes = [p.prefix for p in _slot_prefixes(_trainables(optimizer))]
    result = []
    for variable in optimizer.variables:
        name = variable.name
        prefix = next((p for p in prefixes if name.startswith(p)), "")
        result.append(name[len(prefix) :] or name)
    return result


def _saved_before_build(values):
    """True for what a tf.keras 2 optimizer saved before its first step.

    A compiled tf.keras model that was never trained saves its optimizer's
    iteration count alone: there are no slots yet, so the optimizer keeps
    its freshly built ones.
    """
    return (
        len(values) == 1
        and values[0].shape == ()
        and values[0].dtype.kind in "iu"
    )


class _Dropped:
    """A saved value with no place in Keras 3: only its shape is checked."""

    def __init__(self, shape):
        self.shape = tuple(shape)


# Slots that tf.keras 2 optimizers build for every variable whatever their
# settings, while Keras 3 builds them only when they are used: with
# `momentum=0`, tf.keras' SGD keeps its last update in its momentums and
# never reads it back (it multiplies it by 0). A backend's class (torch's
# SGD) subclasses Keras' own.
_ALWAYS_BUILT_BY_TF_KERAS = {keras.optimizers.SGD: ("momentum",)}


def tf_keras_layout(optimizer):
    """Returns where each value saved by tf.keras 2 goes, or None.

    tf.keras 2 (2.11 and later) optimizers save their iteration count, then
    the slots their `build` made, in the order Keras 3 makes the same slots.
    The Keras 3 slots are read from the optimizer's own variables: each is
    named after the variable it belongs to and the slot's name. Keras 3 keeps
    the learning rate among its variables, tf.keras did not; slots tf.keras
    always built and Keras 3 did not (see `_ALWAYS_BUILT_BY_TF_KERAS`) come
    last, as placeholders to drop.

    Args:
        optimizer: A built `keras.optimizers.Optimizer`.

    Returns:
        A list with, for each saved value, the variable it goes to or a
        placeholder with the shape it must have; None if the optimizer's
        variables cannot be told apart (the layout is then unknown).
    """
    trainables = _trainables(optimizer)
    slots = _slots_by_name(optimizer, trainables)
    if slots is None:
        return None
    layout = [optimizer.iterations]
    layout.extend(slot.variable for slot in slots)
    built_slots = {slot.name for slot in slots}
    for optimizer_class, always_built in _ALWAYS_BUILT_BY_TF_KERAS.items():
        if not isinstance(optimizer, optimizer_class):
            continue
        for slot in always_built:
            if slot not in built_slots:
                layout.extend(_Dropped(t.shape) for t in trainables)
    return layout


def _slots_by_name(optimizer, trainables):
    """Returns a `_Slot` for each slot, in variable order.

    Keras 3 names a slot `<variable path, "/" as "_">_<slot name>`. A
    variable that is neither the iteration count, the learning rate nor a
    slot of a trainable variable of the same shape is state tf.keras did not
    save; it is left out. Returns None if two slots claim one name.
    """
    prefixes = _slot_prefixes(trainables)
    skipped = (optimizer.iterations, getattr(optimizer, "_learning_rate", None))
    slots = []
    seen = set()
    for variable in optimizer.variables:
        if any(variable is s for s in skipped):
            continue
        for prefix, trainable in prefixes:
            name = variable.name
            if name.startswith(prefix) and tuple(variable.shape) == tuple(
                trainable.shape
            ):
                if name in seen:
                    return None
                seen.add(name)
                slots.append(_Slot(variable, name[len(prefix) :]))
                break
    return slots


def _trainables(optimizer):
    """The variables `optimizer` was built for (none before its build)."""
    return list(getattr(optimizer, "_trainable_variables", None) or ())


def _slot_prefixes(trainables):
    """Returns a `_SlotPrefix` per trainable, the longest prefix first.

    Keras 3 names a slot `<variable path, "/" as "_">_<slot name>`; the
    longest prefix that fits is the slot's variable (`dense_kernel_` before
    `dense_`).
    """
    prefixes = (
        _SlotPrefix(f"{t.path.replace('/', '_')}_", t) for t in trainables
    )
    return sorted(prefixes, key=lambda p: len(p.prefix), reverse=True)


class _Slot(NamedTuple):
    """A slot variable and its slot name (`momentum`, `velocity`)."""

    variable: object
    name: str


class _SlotPrefix(NamedTuple):
    """The start of the names of a trainable variable's slots."""

    prefix: str
    trainable: object


def _derive_unsaved_state(optimizer):
    """Sets the state tf.keras kept outside its saved variables.

    Nadam's running product of momentum factors: tf.keras kept it outside
    `variables`, so files hold none; it follows from the step count.
    """
    u_product = getattr(optimizer, "_u_product", None)
    beta_1 = getattr(optimizer, "beta_1", None)
    if u_product is None or not isinstance(beta_1, (int, float)):
        return
    steps = int(np.asarray(optimizer.iterations.numpy()))
    t = np.arange(1, steps + 1, dtype="float64")
    value = np.prod(beta_1 * (1.0 - 0.5 * 0.96**t))
    u_product.assign(np.asarray(value, dtype=u_product.dtype))


def fits(targets, values, names=None, target_roles=None):
    """Returns True if `values` fit `targets`.

    They fit when they are as many, each value has its target's shape and
    kind of dtype, and (where `names` and `target_roles` are both given)
    each saved name ends with its target's role.

    Args:
        targets: Variables, or placeholders with a shape and no dtype.
        values: Arrays.
        names: Optional names the values were saved under.
        target_roles: Optional role names of the targets (see `roles`).
    """
    if len(targets) != len(values):
        return False
    for target, value in zip(targets, values, strict=True):
        if tuple(target.shape) != np.shape(value):
            return False
        dtype = getattr(target, "dtype", None)
        if dtype is not None and _dtype_kind(dtype) != _dtype_kind(
            np.asarray(value).dtype
        ):
            return False
    if names is None or target_roles is None:
        return True
    return all(
        _name_has_role(name, role)
        for name, role in zip(names, target_roles, strict=True)
    )


def _name_has_role(name, role):
    last = name.rsplit("/", 1)[-1]
    return last == role or last.endswith(f"_{role}")


def _dtype_kind(dtype):
    """ "f" for floating point (bfloat16 and float8 too), "i" for integers,
    "b" for booleans, the dtype's name otherwise."""
    name = keras.backend.standardize_dtype(dtype)
    if name.startswith(("float", "bfloat")):
        return "f"
    if name.startswith(("int", "uint")):
        return "i"
    return name


class OptimizerStateMismatch(ValueError):
    """Saved optimizer values that fit none of an optimizer's layouts."""


def mismatch(optimizer, values):
    """Returns the error for `values` that do not fit `optimizer`.

    Its message begins as Keras' own warning for saved optimizer state it
    skips, and names both layouts: the optimizer's variables (name, shape,
    dtype) and the saved values (name where saved, shape, dtype).
    """
    names = saved_names(values)
    arrays = [np.asarray(v) for v in values]
    variables = list(optimizer.variables)
    ours = _describe(
        [v.name for v in variables],
        [tuple(v.shape) for v in variables],
        [keras.backend.standardize_dtype(v.dtype) for v in variables],
    )
    saved = _describe(
        names or [f"#{i}" for i in range(len(arrays))],
        [a.shape for a in arrays],
        [str(a.dtype) for a in arrays],
    )
    return OptimizerStateMismatch(
        f"Skipping variable loading for optimizer '{optimizer.name}', "
        f"because its {len(variables)} variables do not match the "
        f"{len(arrays)} saved values (in number, shapes, dtypes or names): "
        "the saved state belongs to another optimizer or another model. "
        f"The optimizer has: {ours}. The saved optimizer has: {saved}."
    )


def _describe(names, shapes, dtypes, limit=12):
    items = [
        f"{name} {tuple(shape)} {dtype}"
        for name, shape, dtype in zip(names, shapes, dtypes, strict=True)
    ]
    if len(items) > limit:
        items = items[:limit] + [f"... ({len(items) - limit} more)"]
    return "[" + ", ".join(items) + "]"


def warn_mismatch(optimizer, values):
    """Warns, as Keras does, that saved optimizer state is skipped."""
    warnings.warn(
        f"{mismatch(optimizer, values)} The optimizer starts from fresh state.",
        stacklevel=3,
    )


def with_whole_step_count(values):
    """Returns `values` with a float step count made an int, or None.

    tf.keras' `set_weights` cast each value to its variable's dtype, so
    tf.keras code sets the step count (the first value, in every layout)
    as a float such as `np.array(2.0)`. A float scalar there that holds a
    whole number becomes an int64; any other `values` give None.
    """
    if not values:
        return None
    first = np.asarray(values[0])
    if first.shape != () or first.dtype.kind != "f":
        return None
    if not np.isfinite(first) or first != np.round(first) or first < 0:
        return None
    return [np.asarray(first, dtype="int64"), *values[1:]]


def store_values(store):
    """Returns the arrays of a Keras weights store in saved order."""
    return [store[str(i)] for i in range(len(store.keys()))]


class _NamedArray(np.ndarray):
    """A saved array that keeps the name it was saved under."""

    saved_name = None


class Assignment(NamedTuple):
    """A value to assign to a variable."""

    variable: object
    value: object


def keep_pending_values(optimizer, values, set_at_once=None):
    """Keeps values for when the optimizer is built.

    Args:
        optimizer: The optimizer that will receive the values.
        values: The saved arrays (names they were saved under are kept).
        set_at_once: `Assignment`s to make now, such as the
            saved step count, which a learning-rate schedule reads before
            the first step. They are put back as they were if the values
            turn out not to fit the built optimizer. Defaults to the first
            value into `optimizer.iterations`, if it is an integer scalar
            (the step count of a plain optimizer).
    """
    names = saved_names(values)
    kept = [np.array(v) for v in values]
    if names is not None:
        kept = [named(v, n) for v, n in zip(kept, names, strict=True)]
    optimizer._pending_saved_values = kept
    if set_at_once is None:
        first = kept[0] if kept else None
        set_at_once = []
        if first is not None and first.shape == () and first.dtype.kind in "iu":
            set_at_once = [Assignment(optimizer.iterations, first)]
    optimizer_values.check_saved(
        [a.variable for a in set_at_once], [a.value for a in set_at_once]
    )
    before = [
        Assignment(a.variable, np.array(a.variable.numpy()))
        for a in set_at_once
    ]

    def put_back():
        for assignment in before:
            assignment.variable.assign(assignment.value)

    # A function, not a list: Keras tracks the variables in a list set as
    # an optimizer's attribute as its own.
    optimizer._put_back_before_pending = put_back
    for assignment in set_at_once:
        assignment.variable.assign(np.array(assignment.value))


def named(array, name):
    """Returns `array` carrying the name it was saved under."""
    result = array.view(_NamedArray)
    result.saved_name = name
    return result


def apply_pending_values(holder, optimizer):
    """Assigns the values `holder` kept, if any, to the built `optimizer`.

    Values that do not fit it are skipped with Keras' warning (naming both
    layouts), and what `keep_pending_values` set at once is put back: the
    optimizer starts from fresh state, as with Keras alone.

    On TensorFlow the first training step builds the optimizer while its
    `tf.function` is traced; the values are assigned at once all the same,
    not as part of the step (which would assign them again at every step).
    """
    pending = getattr(holder, "_pending_saved_values", None)
    if pending is None:
        return
    holder._pending_saved_values = None
    put_back = getattr(holder, "_put_back_before_pending", None)
    holder._put_back_before_pending = None
    with outside_tracing():
        try:
            optimizer.set_weights(pending)
        except OptimizerStateMismatch as error:
            if put_back is not None:
                put_back()
            warnings.warn(
                f"{error} The optimizer starts from fresh state.",
                stacklevel=3,
            )


@contextlib.contextmanager
def outside_tracing():
    """Runs assignments at once, even while TensorFlow traces a step."""
    if backend_dispatch.is_tensorflow():
        import tensorflow as tf

        with tf.init_scope():
            yield
    else:
        yield
