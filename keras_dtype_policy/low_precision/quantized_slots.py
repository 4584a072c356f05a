"""Optimizer slots stored as 8-bit or 4-bit block codes.

With `state_dtype="8bit"` (or `"4bit"`) the wrapper gives the inner
optimizer a `QuantizedSlot` for each slot of a large weight: a
`keras.Variable` of the weight's shape whose reads dequantize its codes to
float32 and whose writes (routed through the inner optimizer's `assign`,
`assign_add`, `assign_sub`) requantize them. The codes and scales are two
variables of the wrapper, saved with it; within a step the float32 value
last written is read back as it is, so the update uses the unrounded
moments and only the stored state is rounded (as bitsandbytes does).

Which slots may be coded unsigned (never negative, so no level is zero;
see `block_codes`) is known for Keras' own optimizers, by slot name; a
slot of any other optimizer gets the signed code, right for any value.
Weights with fewer than `MIN_QUANTIZED_SIZE` elements keep float32 state:
biases and normalization scales are a negligible share of memory, and
8 bits of a noisy small tensor would buy nothing.
"""

import keras
from keras import ops

from keras_dtype_policy.low_precision import block_codes

QUANTIZED_STATE_DTYPES = {"8bit": 8, "4bit": 4}
# bitsandbytes' and torchao's threshold: smaller tensors stay in 32 bits.
MIN_QUANTIZED_SIZE = 4096
# Slots of Keras' optimizers that hold no negative value.
_UNSIGNED_SLOTS = frozenset(
    (
        "velocity",
        "velocity_hat",
        "accumulator",
        "norm",
        "accumulated_grad",
        "accumulated_delta_var",
    )
)
_KERAS_OPTIMIZERS = "keras.src."


def quantized_bits(state_dtype):
    """Returns 8 or 4 for a quantized state dtype, else None."""
    return QUANTIZED_STATE_DTYPES.get(state_dtype)


def is_quantizable(variable):
    """True where a weight is large enough for quantized state."""
    size = 1
    for dimension in variable.shape:
        size *= int(dimension)
    return size >= MIN_QUANTIZED_SIZE


def slot_code(inner, name, bits):
    """Returns the `block_codes.Code` of the inner optimizer's slot `name`."""
    own = type(inner).__module__.startswith(_KERAS_OPTIMIZERS)
    return block_codes.code_for(bits, not (own and name in _UNSIGNED_SLOTS))


class QuantizedSlot(keras.Variable):
    """An optimizer slot stored as codes and scales.

    Its own storage is one float32 scalar; its shape, name and path are
    those of the slot it stands for.

    Args:
        owner: The `LowPrecisionOptimizer`, whose seed rounds the writes.
        reference: The weight (or its float32 view) the slot belongs to.
        name: The slot's name, as the inner optimizer gave it.
        code: The slot's `block_codes.Code`.
        initializer: The inner optimizer's initializer of the slot.
    """

    def __init__(self, owner, reference, name, code, initializer="zeros"):
        self.owner = owner
        self.code = code
        self.slot_shape = tuple(int(d) for d in reference.shape)
        self.slot_name = f"{reference.path.replace('/', '_')}_{name}"
        self.size = 1
        for dimension in self.slot_shape:
            self.size *= dimension
        blocks = block_codes.block_count(self.size, code)
        initial = None
        if not _is_zeros(initializer):
            initial = keras.initializers.get(initializer)(
                self.slot_shape, "float32"
            )
        codes, scales = _initial_codes(initial, code, blocks, self.size)
        self.codes = owner.add_variable(
            shape=(blocks, code.bytes_per_block),
            dtype="int8",
            initializer=codes,
            name=f"{self.slot_name}_codes",
        )
        self.scales = owner.add_variable(
            shape=(blocks,),
            dtype="float32",
            initializer=scales,
            name=f"{self.slot_name}_scales",
        )
        # The float32 value written this step, read back unrounded.
        self.working = None
        self._making_storage = True
        super().__init__(
            0.0,
            dtype="float32",
            trainable=False,
            autocast=False,
            name=self.slot_name,
        )
        self._making_storage = False

    @property
    def value(self):
        if self.working is not None:
            return self.working
        flat = block_codes.dequantize(
            self.codes.value, self.scales.value, self.code
        )
        if self.size != _padded(self.size, self.code):
            flat = flat[: self.size]
        return ops.reshape(flat, self.slot_shape)

    @property
    def dtype(self):
        return "float32"

    @property
    def shape(self):
        if self._making_storage:
            return self._shape
        return self.slot_shape

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def name(self):
        return self.slot_name

    @property
    def path(self):
        return self.slot_name

    @property
    def trainable(self):
        return False

    @trainable.setter
    def trainable(self, value):
        pass

    def numpy(self):
        return ops.convert_to_numpy(self.value)

    def assign(self, value):
        value = ops.cast(ops.convert_to_tensor(value), "float32")
        value = ops.reshape(value, self.slot_shape)
        self.store(value)
        if self.owner._targets.in_step:
            self.working = value
        return value

    def assign_add(self, value):
        return self.assign(ops.add(self.value, ops.cast(value, "float32")))

    def assign_sub(self, value):
        return self.assign(ops.subtract(self.value, ops.cast(value, "float32")))

    def store(self, value):
        """Quantizes float32 `value` (the slot's shape) into the codes."""
        flat = ops.reshape(value, (-1,))
        padding = _padded(self.size, self.code) - self.size
        if padding:
            flat = ops.pad(flat, [(0, padding)])
        seed = self.owner.state_rounding_seed()
        codes, scales = block_codes.quantize(flat, self.code, seed)
        self.codes.assign(codes)
        self.scales.assign(scales)

    def __repr__(self):
        return f"<{self.code.bits}-bit slot {self.slot_name}>"


def make_slot_creation(inner, wrapper):
    """Returns the inner optimizer's `add_variable_from_reference` that
    gives a `QuantizedSlot` for each slot of a view with quantized state.

    Args:
        inner: The inner `keras.optimizers.Optimizer`.
        wrapper: The `LowPrecisionOptimizer` around it.
    """
    inner_class = type(inner)

    def add_variable_from_reference(
        self, reference_variable, name=None, initializer="zeros"
    ):
        bits = quantized_bits(getattr(reference_variable, "slot_dtype", None))
        if bits is None:
            return inner_class.add_variable_from_reference(
                self, reference_variable, name=name, initializer=initializer
            )
        slot = QuantizedSlot(
            wrapper,
            reference_variable,
            name or "var",
            slot_code(self, name or "var", bits),
            initializer,
        )
        wrapper._targets.quantized_slots[id(slot)] = slot
        return slot

    return add_variable_from_reference


def _padded(size, code):
    return block_codes.block_count(size, code) * code.block


def _is_zeros(initializer):
    if isinstance(initializer, str):
        return initializer == "zeros"
    return isinstance(initializer, keras.initializers.Zeros)


def _initial_codes(initial, code, blocks, size):
    """Initializers of the codes and scales variables."""
    if initial is None:
        # A zero scale makes every code zero.
        return "zeros", "zeros"
    flat = ops.reshape(initial, (-1,))
    padding = blocks * code.block - size
    if padding:
        flat = ops.pad(flat, [(0, padding)])
    codes, scales = block_codes.quantize(flat, code)
    return _Value(codes), _Value(scales)


class _Value(keras.initializers.Initializer):
    """An initializer returning a computed tensor."""

    def __init__(self, value):
        self.value = value

    def __call__(self, shape, dtype=None):
        return ops.cast(self.value, dtype or self.value.dtype)
