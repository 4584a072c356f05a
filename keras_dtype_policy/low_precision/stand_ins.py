"""`StandIn`: a `keras.Variable` standing for a value stored elsewhere.

The wrapper gives the inner optimizer variables whose value lives
somewhere else: a weight read in float32 (`Float32View`), a slot stored
as block codes (`QuantizedSlot`). The inner optimizer takes a stand-in for
the variable it stands for (its shape, name and path are that value's);
reads go to the subclass' `stored_value` and writes to its `assign`. Its
own storage is one float32 scalar, which a `keras.Variable` must have (and
a distribution lays out like any variable).
"""

import keras
from keras import ops


class StandIn(keras.Variable):
    """A float32 `keras.Variable` that stands for a value stored elsewhere.

    Subclasses give `stored_value()` and `assign(value)`.

    Args:
        shape: The shape of the value stood for.
        name: Its name.
        path: Its path.
        storage_name: The name of the stand-in's own scalar storage.

    Attributes:
        working: The float32 tensor of the value that a step updates in
            place or wrote last, read back as it is; None outside a step.
    """

    def __init__(self, *, shape, name, path, storage_name):
        self.stood_shape = shape
        self.stood_name = name
        self.stood_path = path
        self.working = None
        # While its own scalar is made, the stand-in has the scalar's shape
        # (a distribution lays the scalar out by it).
        self._making_storage = True
        super().__init__(
            0.0,
            dtype="float32",
            trainable=False,
            autocast=False,
            name=storage_name,
        )
        self._making_storage = False

    def stored_value(self):
        """Returns the float32 value stood for, read from its storage."""
        raise NotImplementedError

    @property
    def value(self):
        if self.working is not None:
            return self.working
        return self.stored_value()

    @property
    def dtype(self):
        return "float32"

    @property
    def shape(self):
        if self._making_storage:
            return self._shape
        return self.stood_shape

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def name(self):
        return self.stood_name

    @property
    def path(self):
        return self.stood_path

    @property
    def trainable(self):
        return False

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

    def assign_add(self, value):
        return self.assign(ops.add(self.value, as_float32(value)))

    def assign_sub(self, value):
        return self.assign(ops.subtract(self.value, as_float32(value)))


def as_float32(value):
    """A float32 tensor of `value`; TensorFlow's `IndexedSlices` become
    dense."""
    return ops.cast(ops.convert_to_tensor(value), "float32")
