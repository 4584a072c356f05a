"""The float32 views the inner optimizer is built on, and its routed writes.

For each low-precision weight the wrapper builds the inner optimizer on a
`Float32View`: a `keras.Variable` whose reads return the float32 value the
weight stands for (its Kahan compensation added) and whose writes go back
to the wrapper, which rounds them into the weight. `route_writes` sends
the inner optimizer's own `assign`, `assign_add` and `assign_sub` the same
way, on that one instance only: nothing in Keras is patched.
"""

import types
import weakref

import keras
from keras import ops

from keras_dtype_policy.low_precision import compensated_updates
from keras_dtype_policy.low_precision import quantized_slots
from keras_dtype_policy.low_precision.quantized_slots import QuantizedSlot

# The methods `route_writes` sets on an inner optimizer.
ROUTED_METHODS = (
    "assign",
    "assign_add",
    "assign_sub",
    "_var_key",
    "add_variable_from_reference",
    "load_own_variables",
)
_routed = weakref.WeakSet()


class Float32View(keras.Variable):
    """A float32 stand-in for a weight, for the inner optimizer.

    While the inner optimizer builds, the view reports the state dtype, so
    the slots made from it get that dtype. Its own storage is one float32
    scalar; its shape, name and path are the weight's.

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
        self._building = False
        # The float32 tensor a batched step updates in place, or None.
        self.working = None
        # While its own scalar is made, the view has the scalar's shape (a
        # distribution lays the scalar out by it).
        self._making_storage = True
        super().__init__(
            0.0,
            dtype="float32",
            trainable=False,
            autocast=False,
            name=f"{weight.name}_float32_view",
        )
        self._making_storage = False
        self._layout = getattr(weight, "_layout", None)

    @property
    def value(self):
        if self.working is not None:
            return self.working
        if self._building:
            return self.weight.value
        if self.compensation is not None:
            return compensated_updates.kahan_read(
                self.weight.value, self.compensation.value
            )
        return ops.cast(self.weight.value, "float32")

    @property
    def dtype(self):
        if not self._building or quantized_slots.quantized_bits(
            self.slot_dtype
        ):
            # Quantized slots come from `add_variable_from_reference`;
            # anything else the inner optimizer makes is float32.
            return "float32"
        return self.slot_dtype

    @property
    def shape(self):
        if self._making_storage:
            return self._shape
        return self.weight.shape

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def name(self):
        return self.weight.name

    @property
    def path(self):
        return self.weight.path

    @property
    def trainable(self):
        return self.weight.trainable

    @trainable.setter
    def trainable(self, value):
        pass

    @property
    def constraint(self):
        return None

    @constraint.setter
    def constraint(self, value):
        pass

    @property
    def overwrite_with_gradient(self):
        return False

    @overwrite_with_gradient.setter
    def overwrite_with_gradient(self, value):
        pass

    def numpy(self):
        return ops.convert_to_numpy(self.value)

    def assign(self, value):
        self.owner._write(self, _dense(value))
        return value

    def assign_add(self, value):
        return self.assign(ops.add(self.value, _as_float32(value)))

    def assign_sub(self, value):
        return self.assign(ops.subtract(self.value, _as_float32(value)))

    def __repr__(self):
        return f"<float32 view of {self.weight.path}>"


def route_writes(inner, wrapper):
    """Routes the inner optimizer's writes to views and rounded slots.

    Only this instance's `assign`, `assign_add`, `assign_sub`, `_var_key`
    (for TensorFlow, which would read a view's value),
    `add_variable_from_reference` (which makes quantized slots, see
    `quantized_slots`) and `load_own_variables` (the wrapper loads the
    inner's saved values with its own) are replaced.

    Args:
        inner: The inner `keras.optimizers.Optimizer`.
        wrapper: The `LowPrecisionOptimizer` around it.
    """
    # A flag, not the wrapper: saving walks the optimizer's attributes.
    if getattr(inner, "_writes_routed", False):
        return
    inner._writes_routed = True
    _routed.add(inner)
    inner_class = type(inner)
    targets = wrapper._targets

    def written(self, variable, value, combine):
        if isinstance(variable, (Float32View, QuantizedSlot)):
            variable.assign(combine(variable.value, _as_float32(value)))
            return True
        slot = targets.rounded_slots.get(id(variable))
        if slot is None:
            return False
        current = ops.cast(slot.value, "float32")
        wrapper._write_slot(slot, combine(current, _as_float32(value)))
        return True

    def assign(self, variable, value):
        if not written(self, variable, value, lambda _, new: new):
            inner_class.assign(self, variable, value)

    def assign_add(self, variable, value):
        if not written(self, variable, value, ops.add):
            inner_class.assign_add(self, variable, value)

    def assign_sub(self, variable, value):
        if not written(self, variable, value, ops.subtract):
            inner_class.assign_sub(self, variable, value)

    def _var_key(self, variable):
        if isinstance(variable, (Float32View, QuantizedSlot)):
            return id(variable)
        return inner_class._var_key(self, variable)

    add_variable_from_reference = quantized_slots.make_slot_creation(
        inner, wrapper
    )

    def load_own_variables(self, store):
        # The wrapper's saved values hold the inner optimizer's: they load
        # (or are skipped) all together, never the inner's alone.
        pass

    for method in (
        assign,
        assign_add,
        assign_sub,
        _var_key,
        add_variable_from_reference,
        load_own_variables,
    ):
        setattr(inner, method.__name__, types.MethodType(method, inner))


def _dense(value):
    """A tensor of `value`; TensorFlow's `IndexedSlices` become dense."""
    return ops.convert_to_tensor(value)


def _as_float32(value):
    return ops.cast(_dense(value), "float32")


def unroute_all():
    """Gives every routed inner optimizer its class' methods back.

    Called by `keras_dtype_policy.uninstall()`; a `LowPrecisionOptimizer`
    routes its inner optimizer again at its next build or step, which
    cannot run without it.
    """
    for inner in list(_routed):
        for name in ROUTED_METHODS:
            vars(inner).pop(name, None)
        inner._writes_routed = False
    _routed.clear()
