"""Reading optimizer state in the layout tf.keras 2 saved it.

tf.keras 2 optimizers saved `[iteration, slots...]`, the slots in the order
their `build` made them (Adam: `m`, `v` for each variable in turn, then the
`vhat`s). Keras 3 optimizers hold `[iteration, learning_rate, slots...]`
with the same slots in the same order, so the state carries over once the
learning rate is left out (see `tf_keras_layout` for the exceptions).
tf.keras files hold no loss-scale state (neither the current scale nor its
counter), so a `LossScaleOptimizer` restored from one starts from its
initial scale.

Keras' .h5 loader builds a loaded model's optimizer with the model's own
variable list, which is empty for Sequential and Functional models, and then
sets its saved weights. While an .h5 model file loads, an empty build is
therefore put off until the optimizer is built for real, and the saved
values with it. Everywhere else an empty build is a real one: a model with
no trainable weights trains as it does in Keras alone.
"""

import contextlib
import contextvars
import functools
import types

import keras
import numpy as np
from keras.src.saving.keras_saveable import KerasSaveable


def assign_optimizer_values(optimizer, values):
    """Assigns saved values to a built optimizer, Keras 3 or tf.keras layout.

    Values in the optimizer's own layout are assigned in order. Otherwise
    they are read in the layout tf.keras 2 saved for the same optimizer (see
    `tf_keras_layout`), or as the lone iteration count tf.keras saved for
    an optimizer that had not stepped yet: saved slots that Keras 3 has no
    place for are dropped, and state that tf.keras did not save is derived
    from the rest where it can be (see `_derive_unsaved_state`).

    Args:
        optimizer: A built `keras.optimizers.Optimizer` (not a wrapper).
        values: The saved arrays, in saved order.

    Returns:
        True if the values fitted one of the two layouts and were assigned,
        False (and nothing assigned) otherwise.
    """
    variables = list(optimizer.variables)
    values = [np.asarray(v) for v in values]
    if fits(variables, values):
        targets = variables
    elif _saved_before_build(values):
        targets = [optimizer.iterations]
    else:
        layout = tf_keras_layout(optimizer)
        if layout is None or not fits(layout, values):
            return False
        targets = layout
    for target, value in zip(targets, values, strict=True):
        if isinstance(target, _Dropped):
            continue
        target.assign(value)
    if targets is not variables:
        _derive_unsaved_state(optimizer)
    return True


def _saved_before_build(values):
    """True for what a tf.keras 2 optimizer saved before its first step.

    A compiled tf.keras model that was never trained saves its optimizer's
    iteration count alone: there are no slots yet, so the optimizer keeps
    its freshly built ones.
    """
    return len(values) == 1 and values[0].shape == ()


class _Dropped:
    """A saved value with no place in Keras 3: only its shape is checked."""

    def __init__(self, shape):
        self.shape = tuple(shape)


# Slots that tf.keras 2 optimizers build for every variable whatever their
# settings, while Keras 3 builds them only when they are used: with
# `momentum=0`, tf.keras' SGD keeps its last update in its momentums and
# never reads it back (it multiplies it by 0).
_ALWAYS_BUILT_BY_TF_KERAS = {"SGD": ("momentum",)}


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
    trainables = list(getattr(optimizer, "_trainable_variables", None) or ())
    slots = _slots_by_name(optimizer, trainables)
    if slots is None:
        return None
    layout = [optimizer.iterations]
    layout.extend(variable for variable, _ in slots)
    built_slots = {slot for _, slot in slots}
    # A backend's class (torch's SGD) may share its base class' name.
    class_names = dict.fromkeys(c.__name__ for c in type(optimizer).__mro__)
    for class_name in class_names:
        for slot in _ALWAYS_BUILT_BY_TF_KERAS.get(class_name, ()):
            if slot not in built_slots:
                layout.extend(_Dropped(t.shape) for t in trainables)
    return layout


def _slots_by_name(optimizer, trainables):
    """Returns the (variable, slot name) of each slot, in variable order.

    Keras 3 names a slot `<variable path, "/" as "_">_<slot name>`. A
    variable that is neither the iteration count, the learning rate nor a
    slot of a trainable variable of the same shape is state tf.keras did not
    save; it is left out. Returns None if two slots claim one name.
    """
    prefixes = sorted(
        ((f"{t.path.replace('/', '_')}_", t) for t in trainables),
        key=lambda item: len(item[0]),
        reverse=True,
    )
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
                slots.append((variable, name[len(prefix) :]))
                break
    return slots


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


def fits(targets, values):
    """Returns True if `values` match `targets` in number and shapes."""
    return len(targets) == len(values) and all(
        tuple(t.shape) == v.shape for t, v in zip(targets, values, strict=True)
    )


_loading_h5_model = contextvars.ContextVar(
    "keras_dtype_policy_loading_h5_model", default=False
)


def make_h5_model_loader(original_loader):
    """Returns Keras' .h5 model loader, marking the time it runs.

    Args:
        original_loader: Keras' own `load_model_from_hdf5`.

    Returns:
        A function with the same signature.
    """

    @functools.wraps(original_loader)
    def load_model_from_hdf5(*args, **kwargs):
        with _marked(_loading_h5_model):
            return original_loader(*args, **kwargs)

    return load_model_from_hdf5


def defers_build(var_list):
    """Returns True if a build with `var_list` waits for the real one.

    Only while Keras' .h5 loader runs, and only for an empty list: that is
    the loader's placeholder build, before it sets the saved values.
    """
    return not var_list and _loading_h5_model.get()


@contextlib.contextmanager
def _marked(flag):
    token = flag.set(True)
    try:
        yield
    finally:
        flag.reset(token)


def store_values(store):
    """Returns the arrays of a Keras weights store in saved order."""
    return [store[str(i)] for i in range(len(store.keys()))]


def teach_tf_keras_layout(optimizer):
    """Makes one optimizer also read state in the tf.keras 2 layout.

    Its `load_own_variables` (used by `keras.saving.load_model` for .keras
    files) and `set_weights` (used for .h5 files) accept the tf.keras 2
    layout besides their own. The .h5 loader's placeholder build is put off
    until the optimizer is built for real (see `defers_build`), and the
    saved weights with it (the iteration count is set at once). State loaded
    into an optimizer not built yet (`load_weights` or BackupAndRestore
    before the first step, where Keras alone drops it with a warning) also
    waits for the build. Every other input goes to the class' own methods,
    unchanged.

    Args:
        optimizer: A `keras.optimizers.Optimizer`.
    """
    if getattr(optimizer, "_reads_tf_keras_layout", False):
        return
    optimizer._reads_tf_keras_layout = True
    optimizer_class = type(optimizer)

    def build(self, var_list):
        if defers_build(var_list):
            return
        optimizer_class.build(self, var_list)
        apply_pending_values(self, self)

    def load_own_variables(self, store):
        values = store_values(store)
        if not self.built and values:
            # `load_weights` before the first step: kept for the build.
            keep_pending_values(self, values)
        elif not (self.built and assign_optimizer_values(self, values)):
            optimizer_class.load_own_variables(self, store)

    def set_weights(self, weights):
        weights = list(weights)
        if not self.built:
            keep_pending_values(self, weights)
        elif not assign_optimizer_values(self, weights):
            optimizer_class.set_weights(self, weights)

    for method in (build, load_own_variables, set_weights):
        setattr(optimizer, method.__name__, types.MethodType(method, optimizer))


def keep_pending_values(optimizer, values, set_iterations=True):
    """Keeps values for when the optimizer is built.

    Args:
        optimizer: The optimizer that will receive the values.
        values: The saved arrays.
        set_iterations: Whether the first value, the saved step count of a
            plain optimizer, is assigned to `optimizer.iterations` at once.
            A loss-scale optimizer's first value is its own count, not its
            inner optimizer's, so it passes False.
    """
    optimizer._pending_saved_values = [np.array(v) for v in values]
    first = np.asarray(values[0]) if values else None
    if not set_iterations or first is None:
        return
    if first.shape == () and first.dtype.kind in "iu":
        optimizer.iterations.assign(first)


def apply_pending_values(holder, optimizer):
    """Assigns the values `holder` kept, if any, to the built `optimizer`.

    On TensorFlow the first training step builds the optimizer while its
    `tf.function` is traced; the values are assigned at once all the same,
    not as part of the step (which would assign them again at every step).
    """
    pending = getattr(holder, "_pending_saved_values", None)
    if pending is not None:
        holder._pending_saved_values = None
        with outside_tracing():
            optimizer.set_weights(pending)


@contextlib.contextmanager
def outside_tracing():
    """Runs assignments at once, even while TensorFlow traces a step."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        with tf.init_scope():
            yield
    else:
        yield


class SavedCounter(KerasSaveable):
    """A counter saved in a store of its own, beside its owner's.

    A loss-scale optimizer's count of skipped steps, which Keras' own
    `LossScaleOptimizer` does not have, is saved here (in the
    `skipped_steps_record` store below the optimizer's), so the optimizer's
    own store keeps exactly Keras' layout and Keras alone can read it.

    Args:
        read: A function returning the counter's value, or None when the
            owner is not built (nothing is saved then).
        write: A function taking the saved value.
    """

    def __init__(self, read, write):
        self._read = read
        self._write = write

    def _obj_type(self):
        return "Operation"

    def save_own_variables(self, store):
        value = self._read()
        if value is not None:
            store["0"] = np.asarray(value)

    def load_own_variables(self, store):
        # A file from Keras' own LossScaleOptimizer has no such store.
        if "0" in store.keys():
            self._write(np.asarray(store["0"]))
