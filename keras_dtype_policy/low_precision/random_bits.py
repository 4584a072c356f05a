"""Cheap, reproducible random bits for stochastic rounding.

Rounding a float32 value to bfloat16 at random needs 16 random bits an
element (13 for float16), not a fresh 32-bit draw from a generator built
for cryptographic strength. The bits here are a hash of a counter: each
call takes one key from a `keras.random.SeedGenerator` (its state is a
variable, saved with the optimizer, so a resumed run draws what the
uninterrupted one would) and hashes every element's index with it. The
hash is Chris Wellons' `lowbias32` (two xor-shift-multiply rounds, a
bijection of 32-bit integers with a low avalanche bias:
https://nullprogram.com/blog/2018/07/31/, multipliers from
https://github.com/skeeto/hash-prospector), written in `int32`
`keras.ops`: multiplication wraps modulo 2**32 and logical shifts are
arithmetic shifts with the sign bits masked off, so JAX, TensorFlow and
torch compute the same bits, eagerly and under `jit`, and XLA fuses the
dozen integer operations into the rounding. This module is the `keras.ops`
reference of the hash; `torch_numerics.mix` is its torch form.

On torch, which runs one kernel a `keras.ops` call, `rounding_noise`
draws from a generator seeded with the same key instead
(`torch_noise.TorchNoise`); `hashed_noise` still gives the
backend-independent bits there.
"""

import keras
import numpy as np
from keras import ops

from keras_dtype_policy import backend_dispatch

# lowbias32's multipliers, as signed int32 values.
MULTIPLY_1 = 0x7FEB352D
MULTIPLY_2 = 0x846CA68B - 2**32
# Mixed into the seed so that seed 0 does not give key 0.
_SEED_SALT = 0x3C6EF372
_INT32_MASK = 0x7FFFFFFF


def logical_right_shift(x, bits):
    """Shifts int32 `x` right by `bits`, filling with zeros."""
    return ops.bitwise_and(ops.right_shift(x, bits), (1 << (32 - bits)) - 1)


def mix(x):
    """Hashes int32 `x` elementwise (`lowbias32`, without its last
    xor-shift, which leaves the high bits `noise_bits` keeps unchanged)."""
    x = ops.bitwise_xor(x, logical_right_shift(x, 16))
    x = ops.multiply(x, MULTIPLY_1)
    x = ops.bitwise_xor(x, logical_right_shift(x, 15))
    return ops.multiply(x, MULTIPLY_2)


def key_of(seed_state):
    """Returns the int32 key hashed from a seed generator's `(seed,
    counter)` state.

    Only the low 31 bits of the seed and of the counter enter the key:
    seeds that differ by 2**31 draw the same bits, and the bits of a
    generator repeat after 2**31 draws (Keras' default seeds are below
    1e9; a step draws once a rounded tensor).
    """
    state = ops.cast(
        ops.bitwise_and(ops.convert_to_tensor(seed_state), _INT32_MASK),
        "int32",
    )
    seed = mix(ops.bitwise_xor(state[0], _SEED_SALT))
    return mix(ops.bitwise_xor(seed, state[1]))


def next_key(seed):
    """Returns the next int32 key of `seed`.

    Args:
        seed: A `keras.random.SeedGenerator` (advanced by one), or an int
            (always the same key).
    """
    if isinstance(seed, keras.random.SeedGenerator):
        return key_of(seed.next())
    if isinstance(seed, int) and not isinstance(seed, bool):
        return key_of(ops.convert_to_tensor([seed & _INT32_MASK, 0], "int32"))
    raise TypeError(
        "`seed` must be a keras.random.SeedGenerator or an int. "
        f"Received: seed={seed!r} (of type {type(seed).__name__})"
    )


def hashed_noise(shape, bits, key, offset=None):
    """Returns int32 values in `[0, 2**bits)`, the hash of each element's
    index with `key`: the same on every backend.

    Args:
        shape: The shape of the result.
        bits: How many random bits each element gets, 1 to 16.
        key: An int32 scalar tensor (see `next_key`).
        offset: The index of the first element (an int or an int32
            scalar tensor), for a piece of a larger tensor: the piece
            gets the bits of those elements of the whole. None for 0.
    """
    size = 1
    for dimension in shape:
        size *= int(dimension)
    index = ops.arange(size, dtype="int32")
    if offset is not None:
        index = ops.add(index, ops.cast(offset, "int32"))
    hashed = mix(ops.bitwise_xor(index, key))
    return ops.reshape(logical_right_shift(hashed, 32 - bits), shape)


def rounding_noise(shape, bits, seed):
    """Returns int32 random values in `[0, 2**bits)` for rounding.

    The backend's own noise where it has one (`torch_noise` on torch),
    else `hashed_noise` of `seed`'s next key.

    Args:
        shape: The shape of the result.
        bits: How many random bits each element gets, 1 to 16.
        seed: A `keras.random.SeedGenerator` (advanced by one), an int, or
            the `ChunkKeys` of one chunk of a variable's update.
    """
    if isinstance(seed, ChunkKeys):
        return seed.noise(shape, bits)
    own = backend_dispatch.module_for("rounding_noise")
    if own is not None:
        return own.rounding_noise(shape, bits, seed)
    return hashed_noise(shape, bits, next_key(seed))


class ChunkKeys:
    """A generator's next keys, for one chunk of a larger update.

    A variable updated a chunk at a time (`chunked_updates`) must draw
    the bits the whole update would: the update's `n`-th draw takes the
    key of the generator's state `n` draws after the state it started
    from (Keras' `SeedGenerator.next` adds `[0, 1]` a draw), hashed with
    each element's index in the whole variable. The generator itself is
    advanced once, after the chunks, by `drawn`.

    Args:
        start_state: The generator's state before the update (a tensor).
        offset: The index of the chunk's first element in the variable.

    Attributes:
        drawn: How many keys the chunk drew so far.
    """

    def __init__(self, start_state, offset):
        self.start_state = start_state
        self.offset = offset
        self.drawn = 0

    def noise(self, shape, bits):
        """`hashed_noise` of the next key, at the chunk's elements."""
        key = key_of(advanced_state(self.start_state, self.drawn))
        self.drawn += 1
        return hashed_noise(shape, bits, key, self.offset)


def advanced_state(state, draws):
    """A generator's state `draws` ordered draws after `state`."""
    state = ops.convert_to_tensor(state)
    step = ops.convert_to_tensor(np.array([0, draws]), dtype=state.dtype)
    return ops.add(state, step)


def python_key(seed_value, counter):
    """`key_of` of the state `(seed_value, counter)`, as an unsigned
    32-bit Python int."""
    state = np.array([seed_value & _INT32_MASK, counter & _INT32_MASK])
    key = ops.convert_to_numpy(key_of(state.astype(np.int32)))
    return int(key) & 0xFFFFFFFF
