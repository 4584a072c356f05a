"""Reading optimizer state in the layout tf.keras 2 saved it.

tf.keras 2 optimizers saved `[iteration, slots...]`, the slots grouped per
variable (Adam: `m`, `v` for each variable in turn). Keras 3 optimizers hold
`[iteration, learning_rate, slots...]` in the same slot order, so the state
carries over once the learning rate is left out. tf.keras files hold no
loss-scale state (neither the current scale nor its counter), so a
`LossScaleOptimizer` restored from one starts from its initial scale.

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

import numpy as np


def assign_optimizer_values(optimizer, values):
    """Assigns saved values to a built optimizer, Keras 3 or tf.keras layout.

    Args:
        optimizer: A built `keras.optimizers.Optimizer` (not a wrapper).
        values: The saved arrays, in saved order.

    Returns:
        True if the values fitted one of the two layouts and were assigned,
        False (and nothing assigned) otherwise.
    """
    variables = list(optimizer.variables)
    values = [np.asarray(v) for v in values]
    if len(values) == len(variables):
        targets = variables
    elif _is_tf_keras_layout(optimizer, variables, values):
        targets = [variables[0]] + variables[2:]
    else:
        return False
    if any(
        tuple(t.shape) != v.shape for t, v in zip(targets, values, strict=True)
    ):
        return False
    for target, value in zip(targets, values, strict=True):
        target.assign(value)
    return True


def _is_tf_keras_layout(optimizer, variables, values):
    return (
        len(values) == len(variables) - 1
        and len(variables) >= 2
        and variables[1] is getattr(optimizer, "_learning_rate", None)
        and values[0].shape == ()
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
    saved weights with it (the iteration count is set at once). Every other
    input goes to the class' own methods, unchanged.

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
        if not (self.built and assign_optimizer_values(self, values)):
            optimizer_class.load_own_variables(self, store)

    def set_weights(self, weights):
        weights = list(weights)
        if not self.built:
            keep_pending_values(self, weights)
        elif not assign_optimizer_values(self, weights):
            optimizer_class.set_weights(self, weights)

    for method in (build, load_own_variables, set_weights):
        setattr(optimizer, method.__name__, types.MethodType(method, optimizer))


def keep_pending_values(optimizer, values, iterations=None):
    """Keeps values for when the optimizer is built; sets iterations now.

    Args:
        optimizer: The optimizer that will receive the values.
        values: The saved arrays.
        iterations: The variable holding the step count; defaults to
            `optimizer.iterations`.
    """
    optimizer._pending_saved_values = [np.array(v) for v in values]
    first = np.asarray(values[0]) if values else None
    if first is not None and first.shape == () and first.dtype.kind in "iu":
        if iterations is None:
            iterations = optimizer.iterations
        iterations.assign(first)


def apply_pending_values(holder, optimizer):
    """Assigns the values `holder` kept, if any, to the built `optimizer`."""
    pending = getattr(holder, "_pending_saved_values", None)
    if pending is not None:
        holder._pending_saved_values = None
        optimizer.set_weights(pending)
