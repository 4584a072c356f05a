"""Cheap, reproducible random bits for stochastic rounding.

Rounding a float32 value to bfloat16 at random needs 16 random bits an
element (13 for float16), not a fresh 32-bit draw from a generator built
for cryptographic strength. The bits here are a hash of a counter: each
call takes one key from a `keras.random.SeedGenerator` (its state is a
variable, saved with the optimizer, so a resumed run draws what the
uninterrupted one would) and hashes every element's index with it. The
hash is Chris Wellons' `lowbias32` (two xor-shift-multiply rounds, a
bijection of 32-bit integers with a low avalanche bias), written in
`int32` `keras.ops`: multiplication wraps modulo 2**32 and logical shifts
are arithmetic shifts with the sign bits masked off, so JAX, TensorFlow
and torch compute the same bits, eagerly and under `jit`, and XLA fuses
the dozen integer operations into the rounding.

On torch, which runs one kernel a `keras.ops` call, the dozen operations
are a dozen passes over memory: there `rounding_noise` draws from a
generator seeded with the same key instead (`TorchNoise`: NumPy's PCG64
on a CPU, torch's own on a GPU). The bits are then reproducible on torch
(same seed, same bits, resumed too) but differ from JAX's and
TensorFlow's; `hashed_noise` still gives the backend-independent bits on
torch.
"""

import keras
import numpy as np
from keras import ops

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


def hashed_noise(shape, bits, key):
    """Returns int32 values in `[0, 2**bits)`, the hash of each element's
    index with `key`: the same on every backend.

    Args:
        shape: The shape of the result.
        bits: How many random bits each element gets, 1 to 16.
        key: An int32 scalar tensor (see `next_key`).
    """
    size = 1
    for dimension in shape:
        size *= int(dimension)
    index = ops.arange(size, dtype="int32")
    hashed = mix(ops.bitwise_xor(index, key))
    return ops.reshape(logical_right_shift(hashed, 32 - bits), shape)


def rounding_noise(shape, bits, seed):
    """Returns int32 random values in `[0, 2**bits)` for rounding.

    Args:
        shape: The shape of the result.
        bits: How many random bits each element gets, 1 to 16.
        seed: A `keras.random.SeedGenerator` (advanced by one) or an int.
    """
    if keras.backend.backend() == "torch":
        return torch_noise(shape, bits, seed)
    return hashed_noise(shape, bits, next_key(seed))


def torch_noise(shape, bits, seed, device=None):
    """Returns random int32 values in `[0, 2**bits)` as a torch tensor,
    from a `TorchNoise` of `seed`'s next key.

    Args:
        shape: The shape of the result.
        bits: How many random bits each element gets, 1 to 16.
        seed: A `keras.random.SeedGenerator` (advanced by one) or an int.
        device: The torch device of the result; None for Keras' default.
    """
    shape = tuple(int(d) for d in shape)
    size = 1
    for dimension in shape:
        size *= dimension
    return TorchNoise(seed, device).int32(size, bits).reshape(shape)


class TorchNoise:
    """Random 16-bit values for torch, drawn in sequence from one key.

    On a CPU the key seeds NumPy's PCG64, whose raw 64-bit outputs are
    split into four 16-bit values (about ten times faster than torch's
    Mersenne Twister drawing one value at a time); on a GPU it seeds
    torch's own generator (Philox there).

    Args:
        seed: A `keras.random.SeedGenerator` (advanced by one) or an int.
        device: The torch device of the values; None for the seed
            state's, else Keras' default.
    """

    def __init__(self, seed, device=None):
        import torch

        key, self.device = torch_key(seed, device)
        if self.device.type == "cpu":
            self._bits = np.random.PCG64(key)
        else:
            self._generator = torch.Generator(device=self.device)
            self._generator.manual_seed(key)

    def uint16(self, size):
        """Returns `size` uniform uint16 NumPy values (CPU only)."""
        raw = self._bits.random_raw((size + 3) // 4)
        return raw.view(np.uint16)[:size]

    def int32(self, size, bits=16):
        """Returns `size` int32 torch values in `[0, 2**bits)`, flat."""
        import torch

        if self.device.type == "cpu":
            values = self.uint16(size) >> np.uint16(16 - bits)
            return torch.from_numpy(values).to(torch.int32)
        return torch.randint(
            0,
            2**bits,
            (size,),
            dtype=torch.int32,
            generator=self._generator,
            device=self.device,
        )


def torch_key(seed, device=None):
    """Returns `(key, device)`: `seed`'s next key as a Python int, and the
    torch device (the seed state's, else Keras' default)."""
    import torch

    if isinstance(seed, keras.random.SeedGenerator):
        state = seed.next()
        device = device or state.device
        seed_value, counter = (int(v) for v in state.tolist())
    else:
        next_key(seed)  # Checks the argument.
        seed_value, counter = seed, 0
    if device is None:
        device = ops.convert_to_tensor(0).device
    return python_key(seed_value, counter), torch.device(device)


def python_key(seed_value, counter):
    """`key_of` in Python integers, as an unsigned 32-bit int."""
    state = [seed_value & _INT32_MASK, counter & _INT32_MASK]
    seed = _python_mix(state[0] ^ _SEED_SALT)
    return _python_mix(seed ^ state[1])


def _python_mix(x):
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * MULTIPLY_1) & 0xFFFFFFFF
    x ^= x >> 15
    return (x * (MULTIPLY_2 & 0xFFFFFFFF)) & 0xFFFFFFFF
