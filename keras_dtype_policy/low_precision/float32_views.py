"""The float32 views the inner optimizer is built on, and its routed writes.

For each low-precision weight the wrapper builds the inner optimizer on a
`Float32View`: a `keras.Variable` whose reads return the float32 value the
weight stands for (its Kahan compensation added) and whose writes go back
to the wrapper, which rounds them into the weight. `route_writes` sends
the inner optimizer's own `assign`, `assign_add` and `assign_sub` the same
way, on that one instance only: nothing in Keras is patched.
"""

import contextlib
import weakref

from keras import ops

from keras_dtype_policy.low_precision import compensated_updates
from keras_dtype_policy.low_precision import quantized_slots
from keras_dtype_policy.low_precision.stand_ins import StandIn
from keras_dtype_policy.low_precision.stand_ins import as_float32

# The methods `route_writes` sets on an inner optimizer.
ROUTED_METHODS = (
    "assign",
    "assign_add",
    "assign_sub",
    "_var_key",
    "add_variable_from_reference",
    "load_own_variables",
)
_routed: weakref.WeakSet = weakref.WeakSet()


class Float32View(StandIn):
    """A float32 stand-in for a weight, for the inner optimizer.

    While the inner optimizer builds (`building`), the view reports the
    state dtype, so the slots made from it get that dtype. Its shape, name
    and path are the weight's.

    Args:
        owner: The `LowPrecisionOptimizer`, whose `_write` rounds writes.
        weight: The weight the view stands for.
        compensation: The weight's Kahan compensation buffer, or None.
        slot_dtype: The dtype of the optimizer state made from the view.
    """

    def __init__(self, owner, weight, compensation, slot_dtype):
        self.owner = owner
        self.weight = weight
        self.compensation = compensation
        self.slot_dtype = slot_dtype
        # True while the inner optimizer builds on the view.
        self.building = False
        super().__init__(
            shape=weight.shape,
            name=weight.name,
            path=weight.path,
            storage_name=f"{weight.name}_float32_view",
        )
        self._layout = getattr(weight, "_layout", None)

    def storage(self):
        stored = {"weight": self.weight}
        if self.compensation is not None:
            stored["compensation"] = self.compensation
        return stored

    def stored_value(self):
        if self.building:
            return self.weight.value
        weight = self.read("weight")
        if self.compensation is not None:
            return compensated_updates.kahan_read(
                weight, self.read("compensation")
            )
        return ops.cast(weight, "float32")

    @property
    def dtype(self):
        if not self.building or quantized_slots.quantized_bits(self.slot_dtype):
            # Quantized slots come from `add_variable_from_reference`;
            # anything else the inner optimizer makes is float32.
            return "float32"
        return self.slot_dtype

    @property
    def trainable(self):
        return self.weight.trainable

    @trainable.setter
    def trainable(self, value):
        pass

    def assign(self, value):
        self.owner._write(self, ops.convert_to_tensor(value))
        return value

    def __repr__(self):
        return f"<float32 view of {self.weight.path}>"


@contextlib.contextmanager
def building(views):
    """Within it, `views` report the state dtype (see `Float32View`)."""
    for view in views:
        view.building = True
    try:
        yield
    finally:
        for view in views:
            view.building = False


def route_writes(inner, wrapper):
    """Routes the inner optimizer's writes to views and rounded slots.

    Only this instance's `assign`, `assign_add`, `assign_sub`, `_var_key`
    (for TensorFlow, which would read a view's value),
    `add_variable_from_reference` (which makes quantized slots, see
    `quantized_slots`) and `load_own_variables` (the wrapper loads the
    inner's saved values with its own) are replaced, by the methods of a
    `_RoutedWrites`.

    Args:
        inner: The inner `keras.optimizers.Optimizer`.
        wrapper: The `LowPrecisionOptimizer` around it.
    """
    if inner in _routed:
        return
    _routed.add(inner)
    routed = _RoutedWrites(inner, wrapper)
    for name in ROUTED_METHODS:
        # Bound methods of `routed`: saving, which walks the optimizer's
        # attributes, does not follow them to the wrapper.
        setattr(inner, name, getattr(routed, name))


class _RoutedWrites:
    """The methods `route_writes` sets on one inner optimizer.

    Args:
        inner: The inner optimizer.
        wrapper: The `LowPrecisionOptimizer` around it.
    """

    def __init__(self, inner, wrapper):
        self.inner = inner
        # The class whose methods take what is not routed.
        self.keras_methods = type(inner)
        self.wrapper = wrapper

    def _written(self, variable, value, combine):
        """Writes `combine(current, value)` where the variable is one of
        the wrapper's; returns False for any other variable."""
        if isinstance(variable, StandIn):
            variable.assign(combine(variable.value, as_float32(value)))
            return True
        slot = self.wrapper._targets.rounded_slots.get(id(variable))
        if slot is None:
            return False
        current = ops.cast(slot.value, "float32")
        self.wrapper._write_slot(slot, combine(current, as_float32(value)))
        return True

    def assign(self, variable, value):
        if not self._written(variable, value, _replaced):
            self.keras_methods.assign(self.inner, variable, value)

    def assign_add(self, variable, value):
        if not self._written(variable, value, ops.add):
            self.keras_methods.assign_add(self.inner, variable, value)

    def assign_sub(self, variable, value):
        if not self._written(variable, value, ops.subtract):
            self.keras_methods.assign_sub(self.inner, variable, value)

    def _var_key(self, variable):
        if isinstance(variable, StandIn):
            return id(variable)
        return self.keras_methods._var_key(self.inner, variable)

    def add_variable_from_reference(
        self, reference_variable, name=None, initializer="zeros"
    ):
        slot = quantized_slots.new_slot(
            self.wrapper, self.inner, reference_variable, name, initializer
        )
        if slot is not None:
            return slot
        return self.keras_methods.add_variable_from_reference(
            self.inner, reference_variable, name=name, initializer=initializer
        )

    def load_own_variables(self, store):
        # The wrapper's saved values hold the inner optimizer's: they load
        # (or are skipped) all together, never the inner's alone.
        pass


def _replaced(current, new):
    return new


def unroute_all():
    """Gives every routed inner optimizer its class' methods back.

    Called by `keras_dtype_policy.uninstall()`; a `LowPrecisionOptimizer`
    routes its inner optimizer again at its next build or step, which
    cannot run without it.
    """
    for inner in list(_routed):
        for name in ROUTED_METHODS:
            vars(inner).pop(name, None)
    _routed.clear()
