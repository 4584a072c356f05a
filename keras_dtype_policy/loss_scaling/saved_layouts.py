"""The layouts a `LossScaleOptimizer`'s state is saved and loaded in.

The optimizer's own store keeps the layout of Keras' own
`LossScaleOptimizer`, so that Keras alone can read the file; the state
Keras' wrapper lacks is saved in stores of its own below it (see
`RECORD_STORES`). Loading also accepts the layouts of earlier releases and
of tf.keras 2 files.
"""

import keras
import numpy as np
from keras.src.saving.keras_saveable import KerasSaveable

from keras_dtype_policy.loss_scaling import optimizer_state
from keras_dtype_policy.low_precision import optimizer_values
from keras_dtype_policy.low_precision import state_sharding

# The store of each saved record, below the optimizer's own store, and the
# variable it holds. These names are part of the file format.
RECORD_STORES = {
    "skipped_steps_record": "_skipped_step_counter",
    "nonfinite_streak_record": "_nonfinite_streak",
    "nonfinite_counts_record": "_nonfinite_counts",
    "last_nonfinite_record": "_last_nonfinite_mask",
}


class _Records:
    """The saved records, out of Keras' sight (Keras would walk a list or a
    dict): `__dir__` shows them under their store names only."""

    def __init__(self, records):
        self.by_store = records


class SavedLayouts:
    """Saving and loading for `LossScaleOptimizer` (a mixin)."""

    def _make_records(self):
        """Makes the records saved beside the optimizer's own store."""
        self._pending_extras = {}
        self._records = _Records(
            {
                store: self._saved(attribute)
                for store, attribute in RECORD_STORES.items()
            }
        )

    def _apply_pending_records(self):
        """Assigns what was loaded before the build."""
        optimizer_state.apply_pending_values(self, self)
        pending, self._pending_extras = self._pending_extras, {}
        for name, value in pending.items():
            with optimizer_state.outside_tracing():
                self._write_extra(name, value)

    def save_own_variables(self, store):
        """Saves the state in the layout of Keras' own `LossScaleOptimizer`
        (the rest goes to the stores of `RECORD_STORES`)."""
        for i, variable in enumerate(self._layout()):
            store[str(i)] = state_sharding.saved_value(variable)

    def load_own_variables(self, store):
        """Loads this optimizer's state, from any layout it was saved in
        (see `_assign_saved`), or keeps it for the build.

        Values that fit no layout are skipped with Keras' warning; values
        that make no sense (a negative count, a scale or learning rate that
        is not finite) raise a `ValueError` naming the variable.
        """
        values = optimizer_state.store_values(store)
        if not values:
            super().load_own_variables(store)
        elif not self.built:
            self._keep_pending_values(values)
        elif not self._assign_saved(values):
            optimizer_state.warn_mismatch(self, values)

    def set_weights(self, weights):
        """Sets the optimizer's values, in any layout `load_own_variables`
        accepts (the inner optimizer's tf.keras 2 layout among them, as
        tf.keras' wrapper set its inner optimizer's weights). A step count
        given as a whole float is taken, as tf.keras' cast took it.

        Raises:
            ValueError: (an `OptimizerStateMismatch`, naming both counts)
                if `weights` fit none of them; nothing is assigned then.
        """
        weights = list(weights)
        if not self.built:
            self._keep_pending_values(weights)
        elif not self._assign_saved(weights):
            whole = optimizer_state.with_whole_step_count(weights)
            if whole is None or not self._assign_saved(whole):
                raise optimizer_state.mismatch(self, weights)

    def _keep_pending_values(self, values):
        """Keeps values for the build; sets the inner step count now."""
        step = _saved_inner_step(values)
        iterations = self.inner_optimizer.iterations
        at_once = []
        if step is not None:
            at_once.append(optimizer_state.Assignment(iterations, step))
        optimizer_state.keep_pending_values(self, values, set_at_once=at_once)

    def _layout(self, records_kept=0):
        """This optimizer's variables but its records (`RECORD_STORES`)
        from the `records_kept`-th on: 0 gives Keras' layout, 1 that of
        earlier releases (Keras' and the skipped-step count)."""
        found = (getattr(self, name, None) for name in RECORD_STORES.values())
        extra = [v for v in found if v is not None][records_kept:]
        return [v for v in self.variables if not any(v is e for e in extra)]

    def _assign_saved(self, values):
        """Assigns `values` if they fit a layout; returns whether they did.

        The layouts: all variables (as Keras' .h5 format saves them), those
        of earlier releases, Keras', then the inner optimizer's own, in the
        Keras 3 or tf.keras 2 layout (the scale then restarts). Shapes,
        kinds of dtype and any saved names are checked before assigning.
        """
        names = optimizer_state.saved_names(values)
        values = [np.asarray(v) for v in values]
        roles = optimizer_state.roles(self)
        role_of = {
            id(v): role for v, role in zip(self.variables, roles, strict=True)
        }
        for targets in (
            self.variables,
            self._layout(records_kept=1),
            self._layout(),
        ):
            target_roles = [role_of[id(v)] for v in targets]
            if optimizer_state.fits(targets, values, names, target_roles):
                optimizer_values.check_saved(targets, values)
                for variable, value in zip(targets, values, strict=True):
                    variable.assign(value)
                return True
        if names is not None:
            values = [
                optimizer_state.named(v, n)
                for v, n in zip(values, names, strict=True)
            ]
        return optimizer_state.assign_optimizer_values(
            self.inner_optimizer, values, strict=True
        )

    def _saved(self, name):
        """A `SavedCounter` for the variable at attribute `name`."""

        def read():
            if not self.built:
                return None
            return keras.ops.convert_to_numpy(getattr(self, name))

        def write(value):
            if self.built:
                self._write_extra(name, value)
            else:
                self._pending_extras[name] = value

        return SavedCounter(read, write)

    def _write_extra(self, name, value):
        # A count per variable saved for another model's variables does
        # not fit: it is left out, and the counts start from zero.
        variable = getattr(self, name)
        if tuple(np.shape(value)) == tuple(variable.shape):
            optimizer_values.check_saved([variable], [value])
            variable.assign(value)

    def __getattr__(self, name):
        # Keras' saving walks the optimizer's attributes (see `__dir__`)
        # and finds the records here.
        records = self.__dict__.get("_records")
        if name not in RECORD_STORES or records is None:
            return super().__getattr__(name)
        return records.by_store[name]

    def __dir__(self):
        names = set(super().__dir__())
        if self.__dict__.get("_records") is not None:
            names.update(RECORD_STORES)
        return sorted(names)


def _saved_inner_step(values):
    """Returns the inner optimizer's step count among saved values, or None.

    A loss-scale optimizer saves its step count, learning rate, counter
    and scale, then (but in Keras' layout) its skipped-step count, then
    (in the layout of all its variables) its streak and two int vectors,
    then the inner optimizer's step count and learning rate. A tf.keras 2
    file holds the inner state alone, its step count first.
    """
    values = [np.asarray(v) for v in values]

    def scalar(i, kinds):
        return (
            i < len(values)
            and values[i].shape == ()
            and values[i].dtype.kind in kinds
        )

    def int_vector(i):
        return (
            i < len(values)
            and values[i].ndim == 1
            and values[i].dtype.kind in "iu"
        )

    if not scalar(1, "f"):
        at = 0
    elif scalar(5, "f"):
        at = 4
    elif scalar(5, "iu") and int_vector(6) and int_vector(7):
        at = 8
    else:
        at = 5
    return values[at] if scalar(at, "iu") else None


class SavedCounter(KerasSaveable):
    """A record saved in a store of its own, beside its owner's.

    Args:
        read: A function returning the record's value, or None when the
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
