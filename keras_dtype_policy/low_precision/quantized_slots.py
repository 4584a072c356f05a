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

import functools

import keras
from keras import ops

from keras_dtype_policy import backend_dispatch
from keras_dtype_policy.low_precision import block_codes
from keras_dtype_policy.low_precision.stand_ins import StandIn

QUANTIZED_STATE_DTYPES = {"8bit": 8, "4bit": 4}
# bitsandbytes' and torchao's threshold: smaller tensors stay in 32 bits
# (`min_8bit_size=4096` of bitsandbytes' 8-bit optimizers, in its
# `bitsandbytes/optim/optimizer.py`; torchao's `torchao/optim/adam.py`).
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


def quantized_bits(state_dtype):
    """Returns 8 or 4 for a quantized state dtype, else None."""
    return QUANTIZED_STATE_DTYPES.get(state_dtype)


def is_quantizable(variable):
    """True where a weight is large enough for quantized state."""
    return block_codes.element_count(variable.shape) >= MIN_QUANTIZED_SIZE


def slot_code(inner, name, bits):
    """Returns the `block_codes.Code` of the inner optimizer's slot `name`."""
    own = type(inner) in keras_optimizer_classes(backend_dispatch.name())
    return block_codes.code_for(bits, not (own and name in _UNSIGNED_SLOTS))


@functools.cache
def keras_optimizer_classes(backend):
    """Keras' own optimizer classes on `backend` (the current one).

    The classes `keras.optimizers` exports, and the class Keras makes of
    each on the backend (on torch, `keras.optimizers.Adam(...)` is an
    instance of Keras' torch Adam, a subclass), matched by identity: a
    subclass of the user's may change what its slots hold.

    Args:
        backend: The backend's name, which the answer depends on.

    Returns:
        A frozenset of classes.
    """
    del backend  # The cache's key: `__new__` below answers for it.
    exported = [
        value
        for value in vars(keras.optimizers).values()
        if isinstance(value, type)
        and issubclass(value, keras.optimizers.Optimizer)
    ]
    # `__new__` alone picks the class, as constructing does, and makes no
    # variable.
    made = [type(cls.__new__(cls)) for cls in exported]
    return frozenset(exported + made)


class QuantizedSlot(StandIn):
    """An optimizer slot stored as codes and scales.

    Its shape, name and path are those of the slot it stands for; its
    float32 value is that of its codes and scales (the working value
    within a step).

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
        shape = tuple(int(d) for d in reference.shape)
        slot_name = f"{reference.path.replace('/', '_')}_{name}"
        self.size = block_codes.element_count(shape)
        self.codes, self.scales = _coded_storage(
            owner, slot_name, code, self.size, initializer, shape
        )
        super().__init__(
            shape=shape, name=slot_name, path=slot_name, storage_name=slot_name
        )

    def storage(self):
        return {"codes": self.codes, "scales": self.scales}

    def stored_value(self):
        size = self._stood_size()
        flat = block_codes.dequantize(
            self.read("codes"), self.read("scales"), self.code
        )
        if size != _padded(size, self.code):
            flat = flat[:size]
        return ops.reshape(flat, self.shape)

    def assign(self, value):
        value = ops.cast(ops.convert_to_tensor(value), "float32")
        value = ops.reshape(value, self.shape)
        self.store(value)
        if self.owner._targets.in_step:
            self.working = value
        return value

    def store(self, value, nearest=False):
        """Quantizes float32 `value` (the slot's shape) into the codes:
        to the nearer level with `nearest` (a value carried over from
        another optimizer), else as the owner's steps round."""
        seed = None
        if not nearest:
            seed = self.rounding_seed(self.owner.state_rounding_seed())
        codes, scales = block_codes.quantize(
            _padded_flat(value, self._stood_size(), self.code), self.code, seed
        )
        self.write(codes=codes, scales=scales)

    def _stood_size(self):
        """Elements of what it stands for: the slot's, or its chunk's."""
        return self.size if self.chunk is None else self.chunk.size

    def __repr__(self):
        return f"<{self.code.bits}-bit slot {self.name}>"


def new_slot(wrapper, inner, reference, name, initializer):
    """Returns a `QuantizedSlot` for the slot `name` of `reference`, or
    None where its state is not quantized.

    The inner optimizer's `add_variable_from_reference` asks it first (see
    `float32_views.route_writes`).

    Args:
        wrapper: The `LowPrecisionOptimizer`.
        inner: The inner `keras.optimizers.Optimizer`.
        reference: The variable the inner optimizer makes a slot for.
        name: The slot's name, or None.
        initializer: The slot's initializer.
    """
    bits = quantized_bits(getattr(reference, "slot_dtype", None))
    if bits is None:
        return None
    name = name or "var"
    slot = QuantizedSlot(
        wrapper, reference, name, slot_code(inner, name, bits), initializer
    )
    wrapper._targets.quantized_slots[id(slot)] = slot
    return slot


def _coded_storage(owner, slot_name, code, size, initializer, shape):
    """The codes and scales variables of a slot, made by `owner`."""
    blocks = block_codes.block_count(size, code)
    codes, scales = "zeros", "zeros"  # A zero scale makes every code zero.
    if not _is_zeros(initializer):
        initial = keras.initializers.get(initializer)(shape, "float32")
        codes, scales = block_codes.quantize(
            _padded_flat(initial, size, code), code
        )
        codes, scales = _Value(codes), _Value(scales)
    return (
        owner.add_variable(
            shape=(blocks, code.bytes_per_block),
            dtype="int8",
            initializer=codes,
            name=f"{slot_name}_codes",
        ),
        owner.add_variable(
            shape=(blocks,),
            dtype="float32",
            initializer=scales,
            name=f"{slot_name}_scales",
        ),
    )


def _padded(size, code):
    return block_codes.block_count(size, code) * code.block


def _is_zeros(initializer):
    if isinstance(initializer, str):
        return initializer == "zeros"
    return isinstance(initializer, keras.initializers.Zeros)


def _padded_flat(value, size, code):
    """`value` flat, padded with zeros to whole blocks."""
    flat = ops.reshape(value, (-1,))
    padding = _padded(size, code) - size
    if padding:
        flat = ops.pad(flat, [(0, padding)])
    return flat


class _Value(keras.initializers.Initializer):
    """An initializer returning a computed tensor."""

    def __init__(self, value):
        self.value = value

    def __call__(self, shape, dtype=None):
        return ops.cast(self.value, dtype or self.value.dtype)
