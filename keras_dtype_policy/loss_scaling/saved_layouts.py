"""The layouts a `LossScaleOptimizer`'s state is saved and loaded in.

The optimizer's own store keeps the layout of Keras' own
`LossScaleOptimizer`. The state Keras' wrapper lacks (the count of skipped
steps, the count of skipped steps in a row, and which gradients were not
finite) is saved in stores of its own below the optimizer's, under the
names of `RECORD_STORES`, so that Keras alone can read the file. Loading
also accepts the layouts of earlier releases and of tf.keras 2 files.
"""

import keras
import numpy as np
from keras.src.saving.keras_saveable import KerasSaveable

from keras_dtype_policy.loss_scaling import optimizer_state
from keras_dtype_policy.low_precision import optimizer_values

# The store of each saved record, below the optimizer's own store, and the
# variable it holds. These names are part of the file format.
RECORD_STORES = {
    "skipped_steps_record": "_skipped_step_counter",
    "nonfinite_streak_record": "_nonfinite_streak",
    "nonfinite_counts_record": "_nonfinite_counts",
    "last_nonfinite_record": "_last_nonfinite_mask",
}


class _Records:
    """The optimizer's saved records, out of Keras' sight (not a list or a
    dict, which Keras would walk): `__dir__` shows them under their store
    names only."""

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
        """Saves the state in the layout of Keras' own `LossScaleOptimizer`.

        That is every variable but those Keras' wrapper lacks, which go to
        the stores of their own (see `RECORD_STORES`).
        """
        for i, variable in enumerate(self._keras_layout()):
            store[str(i)] = variable.numpy()

    def load_own_variables(self, store):
        """Loads this optimizer's state, from any layout it was saved in.

        Accepted: the layout `save_own_variables` writes (the records, if
        saved, come from their own stores); all variables, as earlier
        releases saved them; the inner optimizer's state alone (Keras 3 or
        tf.keras 2 layout), after which the scale starts from
        `initial_scale`. An optimizer not built yet keeps the values until
        it is. Values that fit none of these layouts are skipped with
        Keras' warning, and nothing is assigned. Values that make no sense
        (a negative count, a scale or learning rate that is not finite)
        are refused with a `ValueError` naming the variable.
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
        accepts.

        Raises:
            ValueError: (an `OptimizerStateMismatch`) if `weights` fit none
                of them; nothing is assigned then.
        """
        weights = list(weights)
        if not self.built:
            self._keep_pending_values(weights)
        elif not self._assign_saved(weights):
            raise optimizer_state.mismatch(self, weights)

    def _keep_pending_values(self, values):
        """Keeps values for the build; sets the inner step count now."""
        step = _saved_inner_step(values)
        at_once = []
        if step is not None:
            at_once = [
                optimizer_state.Assignment(
                    self.inner_optimizer.iterations, step
                )
            ]
        optimizer_state.keep_pending_values(self, values, set_at_once=at_once)

    def _keras_layout(self):
        """This optimizer's variables but those Keras' own lacks."""
        extra = self._extra_variables()
        return [v for v in self.variables if not _is_among(v, extra)]

    def _earlier_layout(self):
        """The variables earlier releases saved: Keras' and the
        skipped-step count."""
        extra = self._extra_variables()[1:]
        return [v for v in self.variables if not _is_among(v, extra)]

    def _extra_variables(self):
        """The variables Keras' own `LossScaleOptimizer` lacks, the
        skipped-step count first."""
        found = (getattr(self, name, None) for name in RECORD_STORES.values())
        return [v for v in found if v is not None]

    def _assign_saved(self, values):
        """Assigns `values` if they fit a layout; returns whether they did.

        The layouts: all variables (as Keras' legacy .h5 format saves
        them), those of earlier releases (Keras' and the skipped-step
        count), Keras' (all but the state its own wrapper lacks), then the
        inner optimizer's own (see
        `optimizer_state.assign_optimizer_values`). Shapes, kinds of dtype
        and, where saved, names are checked before anything is assigned.
        """
        names = optimizer_state.saved_names(values)
        values = [np.asarray(v) for v in values]
        roles = dict(
            zip(
                map(id, self.variables),
                optimizer_state.roles(self),
                strict=True,
            )
        )
        layouts = [
            (targets, [roles[id(v)] for v in targets])
            for targets in (
                self.variables,
                self._earlier_layout(),
                self._keras_layout(),
            )
        ]
        for targets, target_roles in layouts:
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

    def _saved_record(self, name):
        """The record saved in store `name`, or None: Keras' saving walks
        the optimizer's attributes (see `__dir__`) and finds them here."""
        if name not in RECORD_STORES:
            return None
        records = self.__dict__.get("_records")
        return None if records is None else records.by_store[name]

    def __getattr__(self, name):
        record = self._saved_record(name)
        if record is None:
            return super().__getattr__(name)
        return record

    def __dir__(self):
        names = set(super().__dir__())
        if self.__dict__.get("_records") is not None:
            names.update(RECORD_STORES)
        return sorted(names)


def _saved_inner_step(values):
    """Returns the inner optimizer's step count among saved values, or None.

    Saved by a loss-scale optimizer, the values start with its own step
    count and learning rate, its counter and scale, then (all but in
    Keras' layout) its skipped-step count, then (in the layout of all its
    variables) its count of skipped steps in a row and two int vectors
    (the attribution of skipped steps), then the inner optimizer's step
    count and learning rate. A tf.keras 2 file holds the inner state
    alone: its step count comes first, followed by slots.
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


def _is_among(variable, variables):
    return any(variable is v for v in variables)


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
