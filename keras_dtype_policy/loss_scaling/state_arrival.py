"""Where saved optimizer state arrives, and the optimizers taught to read it.

Saved optimizer state reaches a model's optimizer while Keras loads a model
file (`keras.saving.load_model`, for `.keras` and `.h5` files, and this
package's readers, which go through it) and in `model.load_weights` (and
`BackupAndRestore`, which calls it). There, and only there, the optimizer
is taught to read what tf.keras 2 saved, keep state loaded before its first
build, and skip state that does not fit (see `teach_tf_keras_layout`). An
optimizer compiled anywhere else keeps Keras' own methods.

Keras' .h5 loader builds a loaded model's optimizer with the model's own
variable list, which is empty for Sequential and Functional models, and then
sets its saved weights. While an .h5 model file loads, an empty build is
therefore put off until the optimizer is built for real, and the saved
values with it. Everywhere else an empty build is a real one: a model with
no trainable weights trains as it does in Keras alone.

Every taught optimizer is kept in a weak registry: `forget_taught` (called
by `keras_dtype_policy.uninstall()`) gives them all Keras' methods back.
"""

import contextlib
import contextvars
import functools
import types
import weakref

import keras

from keras_dtype_policy.loss_scaling import optimizer_state

# The methods `teach_tf_keras_layout` sets on an optimizer instance.
TAUGHT_METHODS = ("build", "load_own_variables", "set_weights")
# What `optimizer_state.keep_pending_values` keeps on it for the build.
_PENDING = ("_pending_saved_values", "_put_back_before_pending")

_loading_h5_model = contextvars.ContextVar(
    "keras_dtype_policy_loading_h5_model", default=False
)
_loading_saved_state = contextvars.ContextVar(
    "keras_dtype_policy_loading_saved_state", default=False
)
_taught: weakref.WeakSet = weakref.WeakSet()


@contextlib.contextmanager
def loading_saved_state():
    """Marks a block in which a model file, its optimizer state included,
    loads: optimizers compiled in it are taught (see `state_may_arrive`)."""
    with _marked(_loading_saved_state):
        yield


def state_may_arrive():
    """Returns True while a model file loads (see `loading_saved_state`)."""
    return _loading_saved_state.get()


def make_h5_model_loader(original_loader):
    """Returns Keras' .h5 model loader, marking the time it runs.

    Args:
        original_loader: Keras' own `load_model_from_hdf5`.

    Returns:
        A function with the same signature.
    """

    @functools.wraps(original_loader)
    def load_model_from_hdf5(*args, **kwargs):
        with _marked(_loading_h5_model), loading_saved_state():
            return original_loader(*args, **kwargs)

    return load_model_from_hdf5


def make_weights_loader(original_loader):
    """Returns Keras' `load_weights_only`, teaching the model's optimizer.

    `model.load_weights` (and `BackupAndRestore`) load `.weights.h5` and
    `.keras` files through it, into a model compiled outside any file.
    A `LossScaleOptimizer` reads its own layouts (and this package's
    teaches its inner optimizer): it is left as it is.

    Args:
        original_loader: Keras' own `saving_lib.load_weights_only`.

    Returns:
        A function with the same signature.
    """

    @functools.wraps(original_loader)
    def load_weights_only(model, *args, **kwargs):
        optimizer = getattr(model, "optimizer", None)
        if isinstance(optimizer, keras.optimizers.Optimizer) and not isinstance(
            optimizer, keras.optimizers.LossScaleOptimizer
        ):
            teach_tf_keras_layout(optimizer)
        return original_loader(model, *args, **kwargs)

    return load_weights_only


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


def teach_tf_keras_layout(optimizer):
    """Makes one optimizer also read state in the tf.keras 2 layout.

    Its `load_own_variables` (used by `keras.saving.load_model` for .keras
    files and by `load_weights`) and `set_weights` (used for .h5 files)
    accept the tf.keras 2 layout besides their own. The .h5 loader's
    placeholder build is put off until the optimizer is built for real
    (see `defers_build`), and the saved weights with it (the iteration
    count is set at once). State loaded into an optimizer not built yet
    (`load_weights` or BackupAndRestore before the first step, or a
    keras-hub task's fresh optimizer, where Keras alone drops it with a
    warning) also waits for the build.

    Saved values are checked against the optimizer before anything is
    assigned (see `optimizer_state.assign_optimizer_values`). Values that
    fit none of its layouts, saved by another optimizer or for another
    model, are skipped as Keras skips them: `load_own_variables` and the
    build warn (naming both layouts) and the optimizer keeps its fresh
    state, while `set_weights`, called directly, raises
    `OptimizerStateMismatch` (a `ValueError`, as Keras' own), having
    assigned nothing.

    Args:
        optimizer: A `keras.optimizers.Optimizer`.
    """
    if optimizer in _taught:
        return
    optimizer_class = type(optimizer)

    def build(self, var_list):
        if defers_build(var_list):
            return
        optimizer_class.build(self, var_list)
        optimizer_state.apply_pending_values(self, self)

    def load_own_variables(self, store):
        values = optimizer_state.store_values(store)
        if not values:
            optimizer_class.load_own_variables(self, store)
        elif not self.built:
            # `load_weights` before the first step: kept for the build.
            optimizer_state.keep_pending_values(self, values)
        elif not optimizer_state.assign_optimizer_values(self, values):
            optimizer_state.warn_mismatch(self, values)

    def set_weights(self, weights):
        weights = list(weights)
        if not self.built:
            optimizer_state.keep_pending_values(self, weights)
        elif not optimizer_state.assign_optimizer_values(self, weights):
            # tf.keras' float step count, as its `set_weights` cast it.
            whole = optimizer_state.with_whole_step_count(weights)
            if whole is None or not optimizer_state.assign_optimizer_values(
                self, whole
            ):
                raise optimizer_state.mismatch(self, weights)

    for method in (build, load_own_variables, set_weights):
        setattr(optimizer, method.__name__, types.MethodType(method, optimizer))
    _taught.add(optimizer)


def is_taught(optimizer):
    """Returns True if `optimizer` holds the methods of
    `teach_tf_keras_layout`."""
    return optimizer in _taught


def forget_taught():
    """Gives every taught optimizer Keras' own methods back.

    State an unbuilt optimizer kept for its build is dropped with them,
    as Keras alone drops it.
    """
    for optimizer in list(_taught):
        for name in (*TAUGHT_METHODS, *_PENDING):
            vars(optimizer).pop(name, None)
    _taught.clear()
