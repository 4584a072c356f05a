"""`StandIn`: a `keras.Variable` standing for a value stored elsewhere.

The wrapper gives the inner optimizer variables whose value lives
somewhere else: a weight read in float32 (`Float32View`), a slot stored
as block codes (`QuantizedSlot`). The inner optimizer takes a stand-in for
the variable it stands for (its shape, name and path are that value's);
reads go to the subclass' `stored_value` and writes to its `assign`. Its
own storage is one float32 scalar, which a `keras.Variable` must have (and
a distribution lays out like any variable).

While one chunk of a large variable's update runs (`chunked_updates`),
a stand-in has a `ChunkState`: it stands for that chunk, flat, and reads
and writes the chunk's tensors instead of its storage variables.

A stand-in is never saved: what it stands for is saved in its own right
(the weight and its compensation buffer, or the codes and scales). Keras'
files save the optimizer's `variables`, which hold no stand-in;
TensorFlow's checkpoints, which reach every attribute, find stand-ins in
the inner optimizer's lists and save nothing of them.
"""

import contextlib
import dataclasses

import keras
from keras import ops


@dataclasses.dataclass
class ChunkState:
    """What a stand-in reads and writes while one chunk of it is updated.

    Attributes:
        size: How many elements the chunk has (a Python int).
        stored: `{name: tensor}` of the chunk of each storage variable
            (named as `StandIn.storage` names them), replaced as it is
            written.
        keys: The `random_bits.ChunkKeys` its rounding draws from, or
            None where nothing rounds at random.
    """

    size: int
    stored: dict
    keys: object = None


class StandIn(keras.Variable):
    """A float32 `keras.Variable` that stands for a value stored elsewhere.

    Subclasses give `storage()`, `stored_value()` and `assign(value)`,
    reading and writing storage through `read` and `write`.

    Args:
        shape: The shape of the value stood for.
        name: Its name.
        path: Its path.
        storage_name: The name of the stand-in's own scalar storage.

    Attributes:
        working: The float32 tensor of the value that a step updates in
            place or wrote last, read back as it is; None outside a step.
        chunk: The `ChunkState` of the chunk it stands for, or None.
    """

    def __init__(self, *, shape, name, path, storage_name):
        self.stood_shape = shape
        self.stood_name = name
        self.stood_path = path
        self.working = None
        self.chunk = None
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

    def storage(self):
        """Returns `{name: keras.Variable}` of what stores the value."""
        raise NotImplementedError

    def stored_value(self):
        """Returns the float32 value stood for, read from its storage."""
        raise NotImplementedError

    def read(self, name):
        """The value of the storage variable `name` (of the chunk, in a
        chunk)."""
        if self.chunk is not None:
            return self.chunk.stored[name]
        return self.storage()[name].value

    def write(self, **values):
        """Assigns each storage variable named its new value (in a chunk,
        keeps it as the chunk's)."""
        if self.chunk is not None:
            self.chunk.stored.update(values)
            return
        storage = self.storage()
        for name, value in values.items():
            storage[name].assign(value)

    def rounding_seed(self, seed):
        """The seed a write rounds with: `seed` (a `SeedGenerator`, or
        None for rounding to nearest), or the chunk's keys in a chunk."""
        if seed is None or self.chunk is None:
            return seed
        return self.chunk.keys

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
        if self.chunk is not None:
            return (self.chunk.size,)
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

    # `tf.train.Checkpoint` calls these on every variable it reaches;
    # Keras' would save `self.value`, a computed tensor here.
    def _serialize_to_tensors(self):
        return {}

    def _restore_from_tensors(self, restored_tensors):
        return None

    # A SavedModel (`tf.saved_model.save`) exports each variable it
    # reaches as a copy; Keras' would copy `self.value`, computed here:
    # the stand-in's own scalar storage is exported instead.
    def _export_to_saved_model_graph(
        self, object_map, tensor_map, options, **kwargs
    ):
        storage = self._value
        resources = storage._export_to_saved_model_graph(
            object_map, tensor_map, options, **kwargs
        )
        object_map[self] = object_map[storage]
        return resources

    def _copy_trackable_to_cpu(self, object_map):
        storage = self._value
        storage._copy_trackable_to_cpu(object_map)
        object_map[self] = object_map[storage]

    def _write_object_proto(self, proto, options):
        return self._value._write_object_proto(proto, options)


@contextlib.contextmanager
def untracked(optimizer):
    """Within it, `optimizer` adds no stand-in to its `variables`.

    Keras' optimizer adds every `keras.Variable` set on it (in a list
    too) to the variables it saves; a stand-in is saved elsewhere. Keeping
    stand-ins out as they are made leaves the optimizer's lists as Keras
    made them (TensorFlow refuses to save a tracked list once an item was
    deleted from it).

    Args:
        optimizer: A `keras.optimizers.Optimizer`, about to build.
    """
    tracker = optimizer._tracker
    is_variable, store = tracker.config["variables"]

    def is_saved_variable(value):
        return is_variable(value) and not isinstance(value, StandIn)

    tracker.config["variables"] = (is_saved_variable, store)
    try:
        yield
    finally:
        tracker.config["variables"] = (is_variable, store)


def as_float32(value):
    """A float32 tensor of `value`; TensorFlow's `IndexedSlices` become
    dense."""
    return ops.cast(ops.convert_to_tensor(value), "float32")
