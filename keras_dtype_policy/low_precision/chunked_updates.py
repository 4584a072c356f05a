"""One large variable's update with coded state, a chunk at a time (JAX).

XLA computes a variable's update with coded state as one piece: the
dequantized moments, their new values (read twice: for each block's
largest magnitude, then to code them) and the random bits are whole-
variable float32 temporaries. In XLA's buffer assignment of the JAX
step, one embedding's update with 8-bit state holds 14 bytes an element
of temporaries (18 with Kahan compensation, 13 with 4-bit state) against
the 4 of its float32 gradient. Variables are updated one after another,
so the cost is set by the largest one: an LLM's embedding table, or one
projection of tens of millions of elements.

The largest variable, if it has more than `CHUNKED_ABOVE` elements,
`DOMINANCE` times the next largest's, codes in every slot and an inner
optimizer of `ELEMENTWISE_OPTIMIZERS`, is updated by
`keras.ops.fori_loop`s over chunks of `CHUNK_ELEMENTS` elements (whole
blocks): the loop body slices the weight, its compensation and each
slot's codes and scales, runs the same update on the slices (the stand-
ins stand for the chunk, see `stand_ins.ChunkState`) and puts the new
slices back into the loop's carry. The random bits are those of the
whole update: each draw's key comes from the generator's state before
the update (`random_bits.ChunkKeys`), each element's bits from its index
in the whole variable. The chunked update equals the whole one bit for
bit where XLA compiles the same arithmetic the same way in the loop (the
tests: Adam, AdamW, Adamax, Nadam, Lion, SGD, RMSprop, Adagrad);
Adadelta's differs by float32 rounding; and where XLA's excess precision
(on by default) lets the whole update read a gradient in float32 before
its rounding to bfloat16, the chunked update reads the bfloat16
gradient. Its temporaries are 8 bytes an element with 8-bit codes (10
with compensation, 7 with 4-bit codes): the gradient's 4 and one copy of
the weight and codes, which XLA makes because a loop cannot update a
donated argument in place, and which lives to the end of the step. That
copy is why only one dominant variable (an embedding table) is chunked:
chunking every variable of a Dense stack raised the step's temporaries
from 2 to 6 bytes a parameter, where the whole updates' own temporaries,
one variable at a time, do not grow with the model.

Only on JAX inside `jax.jit` (as `fit` runs it), without a
`keras.distribution` (a dynamic slice of a sharded array would gather
it). Not measured worth it elsewhere (docs/low-precision-training.md):
TensorFlow's loop ran 1.8 times slower than its whole update; an eager
JAX update runs op by op, its own memory freed as it goes; PyTorch runs
its own batched step.
"""

import keras
from keras import ops

from keras_dtype_policy import backend_dispatch
from keras_dtype_policy.low_precision import block_codes
from keras_dtype_policy.low_precision import random_bits
from keras_dtype_policy.low_precision import slot_lists
from keras_dtype_policy.low_precision.stand_ins import ChunkState
from keras_dtype_policy.low_precision.step_targets import NOT_COMPUTED

# Elements of one chunk: whole blocks of every code (`block_codes.BLOCKS`).
CHUNK_ELEMENTS = 2**20
# A variable of more elements may be updated a chunk at a time...
CHUNKED_ABOVE = 2 * CHUNK_ELEMENTS
# ... if it has this many times the elements of the next largest.
DOMINANCE = 2
# The codes whose chunked update was measured to run at the whole one's
# step time or faster (8-bit: 1.03x and 0.85x on an embedding, 4-bit:
# 1.06x and 0.84x, stochastic rounding and Kahan).
CHUNKED_BITS = (8, 4)
# Keras' optimizers whose `update_step` treats every element on its own
# and updates the slots without reading the weight (Ftrl's `linear` reads
# it: not here).
ELEMENTWISE_OPTIMIZERS = (
    "Adadelta",
    "Adagrad",
    "Adam",
    "Adamax",
    "AdamW",
    "Lion",
    "Nadam",
    "RMSprop",
    "SGD",
)


def stand_ins_of(wrapper, variable, grad):
    """Returns `(view, slots)` of a variable whose update runs a chunk at
    a time, or None where it runs whole.

    Args:
        wrapper: The built `LowPrecisionOptimizer`.
        variable: One of its model variables.
        grad: Its gradient.
    """
    if id(variable) != _dominant_variable(wrapper):
        return None
    if variable.constraint is not None:
        return None
    if not _elementwise(wrapper.inner_optimizer):
        return None
    if not _loops_in_place(grad):
        return None
    targets = wrapper._targets
    view = targets.views.get(id(variable))
    slots = slot_lists.slots_by_variable(wrapper)
    if view is None or slots is None or not slots[id(variable)]:
        return None
    coded = [targets.quantized_slots.get(id(s)) for s in slots[id(variable)]]
    if any(
        slot is None or slot.code.bits not in CHUNKED_BITS for slot in coded
    ):
        return None
    return view, coded


def update(wrapper, stand_ins, grad, learning_rate, update_one):
    """Runs one variable's update a chunk at a time.

    Two loops over the chunks: the first writes the weight (and its
    compensation) and leaves the codes as they were, the second writes
    the codes and scales. Each runs the whole update of a chunk, and
    XLA drops what the loop does not keep: the first loop reads the old
    codes while the second rewrites them, so that no loop reads a value
    it has overwritten (else XLA copies the whole variable's storage at
    every chunk). The moments are computed twice, a few operations an
    element; the slots' updates read no weight (`ELEMENTWISE_OPTIMIZERS`).

    Args:
        wrapper: The `LowPrecisionOptimizer`.
        stand_ins: `(view, slots)` from `stand_ins_of`.
        grad: The variable's gradient.
        learning_rate: The step's learning rate.
        update_one: `update_one(grad, variable, target, learning_rate)`,
            the wrapper's update of one variable through its view.
    """
    looped = _LoopedUpdate(wrapper, stand_ins, grad)
    view = stand_ins[0]
    for written in (
        [p for p in looped.pieces if p.stand_in is view],
        [p for p in looped.pieces if p.stand_in is not view],
    ):
        looped.loop(
            written, lambda g: update_one(g, view.weight, view, learning_rate)
        )
    looped.finish()


class _LoopedUpdate:
    """One variable's storage, gradient and random keys, while its
    update runs in loops over chunks.

    Args:
        wrapper: The `LowPrecisionOptimizer`.
        stand_ins: `(view, slots)` from `stand_ins_of`.
        grad: The variable's gradient.
    """

    def __init__(self, wrapper, stand_ins, grad):
        self.stand_ins = [stand_ins[0], *stand_ins[1]]
        self.pieces = [
            _Piece(stand_in, name, _elements_per_row(stand_in))
            for stand_in in self.stand_ins
            for name in stand_in.storage()
        ]
        self.size = block_codes.element_count(stand_ins[0].stood_shape)
        grad = ops.convert_to_tensor(grad)
        self.grad_dtype = keras.backend.standardize_dtype(grad.dtype)
        self.grad = _as_bits(ops.reshape(grad, (-1,)))
        self.generator = wrapper.seed_generator
        self.start_state = None
        if self.generator is not None:
            state = self.generator.state.value
            self.start_state = ops.convert_to_tensor(state)
        self.values = {
            piece: _as_bits(_flat_rows(piece.variable().value, piece.per_row))
            for piece in self.pieces
        }
        self.drawn = set()

    def loop(self, written, update_chunk):
        """Runs `update_chunk(grad)` on every chunk, keeping the new
        values of the pieces `written`."""
        chunks, tail = divmod(self.size, CHUNK_ELEMENTS)
        carry = ops.fori_loop(
            0,
            chunks,
            lambda index, carry: self.run_chunk(
                ops.multiply(ops.cast(index, "int32"), CHUNK_ELEMENTS),
                CHUNK_ELEMENTS,
                written,
                list(carry),
                update_chunk,
            ),
            [self.values[p] for p in written],
        )
        if tail:
            first = chunks * CHUNK_ELEMENTS
            carry = self.run_chunk(
                first, tail, written, list(carry), update_chunk
            )
        self.values.update(zip(written, carry, strict=True))

    def run_chunk(self, first, chunk_size, written, carry, update_chunk):
        """Updates elements `[first, first + chunk_size)`; returns `carry`
        (the storage of the pieces `written`) with their new values."""
        keys = None
        if self.start_state is not None:
            keys = random_bits.ChunkKeys(self.start_state, first)
        current = dict(self.values)
        current.update(zip(written, carry, strict=True))
        for stand_in in self.stand_ins:
            stand_in.chunk = ChunkState(chunk_size, {}, keys)
        for piece in self.pieces:
            rows = _rows(
                current[piece], piece.row(first), piece.rows(chunk_size)
            )
            piece.stand_in.chunk.stored[piece.name] = _from_bits(
                rows, piece.variable().dtype
            )
        try:
            grad = ops.slice(self.grad, [first], [chunk_size])
            update_chunk(_from_bits(grad, self.grad_dtype))
            new = [_as_bits(p.stand_in.chunk.stored[p.name]) for p in written]
        finally:
            for stand_in in self.stand_ins:
                stand_in.chunk = None
                stand_in.working = None
        self.drawn.add(0 if keys is None else keys.drawn)
        return [
            _put_rows(whole, piece.row(first), value)
            for piece, whole, value in zip(written, carry, new, strict=True)
        ]

    def finish(self):
        """Assigns the new values, and advances the generator by the
        keys each chunk drew."""
        for piece in self.pieces:
            variable = piece.variable()
            value = _from_bits(self.values[piece], variable.dtype)
            variable.assign(ops.reshape(value, variable.shape))
        if len(self.drawn) != 1:
            raise RuntimeError(
                "A chunked update drew a different number of random keys "
                f"in different chunks: {sorted(self.drawn)}."
            )
        if self.generator is not None:
            self.generator.state.assign(
                random_bits.advanced_state(self.start_state, self.drawn.pop())
            )


class _Piece:
    """One storage variable of a stand-in, as the chunks cut it.

    Args:
        stand_in: The stand-in.
        name: The variable's name in `stand_in.storage()`.
        per_row: Elements of the value stood for in one row of it.
    """

    def __init__(self, stand_in, name, per_row):
        self.stand_in = stand_in
        self.name = name
        self.per_row = per_row

    def variable(self):
        return self.stand_in.storage()[self.name]

    def row(self, first):
        """The row holding element `first` (a block's first)."""
        if self.per_row == 1 or isinstance(first, int):
            return first // self.per_row
        return ops.floor_divide(first, self.per_row)

    def rows(self, elements):
        """Rows that `elements` elements from a row's first take."""
        return -(-elements // self.per_row)


def _dominant_variable(wrapper):
    """The `id` of the variable whose update may run a chunk at a time:
    the largest, if it has more than `CHUNKED_ABOVE` elements and
    `DOMINANCE` times the next largest's; else None."""
    targets = wrapper._targets
    if targets.chunked_variable is NOT_COMPUTED:
        sizes = sorted(
            (
                (block_codes.element_count(target.shape), id(target))
                for target in (getattr(t, "weight", t) for t in targets.order)
            ),
            reverse=True,
        )
        chosen = None
        if sizes and sizes[0][0] > CHUNKED_ABOVE:
            runner_up = sizes[1][0] if len(sizes) > 1 else 0
            if sizes[0][0] >= DOMINANCE * runner_up:
                chosen = sizes[0][1]
        targets.chunked_variable = chosen
    return targets.chunked_variable


def _elementwise(inner):
    """True for an instance of exactly one of `ELEMENTWISE_OPTIMIZERS`."""
    kinds = tuple(getattr(keras.optimizers, n) for n in ELEMENTWISE_OPTIMIZERS)
    return type(inner) in kinds


def _loops_in_place(grad):
    """True where a `fori_loop` over a variable's chunks updates its carry
    in place and the whole update would be one XLA computation too (see
    the module docstring)."""
    if not backend_dispatch.is_jax():
        return False
    if not backend_dispatch.module_for("tracing").is_traced(grad):
        return False
    return keras.distribution.distribution() is None


def _elements_per_row(stand_in):
    """Elements of the value stood for in one row of `stand_in`'s
    storage: 1 for a weight, a block for codes and scales."""
    code = getattr(stand_in, "code", None)
    return 1 if code is None else code.block


def _as_bits(value):
    """A bfloat16 or float16 tensor viewed as int16, else `value`.

    XLA's CPU compiler does the slicing and putting back of a bfloat16
    array in float32 (converting the whole array, at every chunk); its
    bits as int16 are moved as they are.
    """
    dtype = keras.backend.standardize_dtype(value.dtype)
    if dtype in ("bfloat16", "float16"):
        return ops.view(value, "int16")
    return value


def _from_bits(value, dtype):
    """`value` back in `dtype` where `_as_bits` viewed it as int16."""
    dtype = keras.backend.standardize_dtype(dtype)
    if dtype in ("bfloat16", "float16"):
        return ops.view(value, dtype)
    return value


def _flat_rows(value, per_row):
    """A weight flat; codes and scales as they are (one row a block)."""
    return ops.reshape(value, (-1,)) if per_row == 1 else value


def _rows(whole, start, count):
    """`count` rows of `whole` from row `start`."""
    rest = [int(d) for d in whole.shape[1:]]
    return ops.slice(whole, [start] + [0] * len(rest), [count] + rest)


def _put_rows(whole, start, rows):
    """`whole` with `rows` put in from row `start`."""
    return ops.slice_update(whole, [start] + [0] * (len(whole.shape) - 1), rows)
