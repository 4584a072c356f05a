"""Random bits for stochastic rounding on torch, from saved seeds.

On torch, which runs one kernel a `keras.ops` call, the dozen operations
of `random_bits.hashed_noise` are a dozen passes over memory: there
`random_bits.rounding_noise` draws from a generator seeded with the same
key instead (`TorchNoise`: NumPy's PCG64 on a CPU, torch's own on a GPU).
The bits are reproducible on torch (same seed, same bits, resumed runs
too: the key comes from the `keras.random.SeedGenerator`'s saved state)
but differ from JAX's and TensorFlow's. The torch step draws from it only
the keys its kernels hash (`torch_numerics.hashed_words`).
"""

import keras
import numpy as np
import torch

from keras_dtype_policy.low_precision import random_bits


def rounding_noise(shape, bits, seed):
    """Returns random int32 values in `[0, 2**bits)` as a torch tensor,
    from a `TorchNoise` of `seed`'s next key (`random_bits.rounding_noise`
    on torch).

    Args:
        shape: The shape of the result.
        bits: How many random bits each element gets, 1 to 16.
        seed: A `keras.random.SeedGenerator` (advanced by one) or an int.
    """
    shape = tuple(int(d) for d in shape)
    size = 1
    for dimension in shape:
        size *= dimension
    return TorchNoise(seed).int32(size, bits).reshape(shape)


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
        key, self.device = torch_key(seed, device)
        if self.device.type == "cpu":
            self._bits = np.random.PCG64(key)
        else:
            self._generator = torch.Generator(device=self.device)
            self._generator.manual_seed(key)

    def int32(self, size, bits=16):
        """Returns `size` int32 torch values in `[0, 2**bits)`, flat."""
        if self.device.type == "cpu":
            raw = self._bits.random_raw((size + 3) // 4)
            values = raw.view(np.uint16)[:size] >> np.uint16(16 - bits)
            return torch.from_numpy(values).to(torch.int32)
        return torch.randint(
            0,
            2**bits,
            (size,),
            dtype=torch.int32,
            generator=self._generator,
            device=self.device,
        )

    def kernel_key(self):
        """The next key a kernel hashes (`torch_numerics.hashed_words`):
        two 16-bit draws, an int32 tensor of two values."""
        return self.int32(2)


def torch_key(seed, device=None):
    """Returns `(key, device)`: `seed`'s next key as a Python int, and the
    torch device (the seed state's, else Keras' default)."""
    if isinstance(seed, keras.random.SeedGenerator):
        state = seed.next()
        device = device or state.device
        seed_value, counter = (int(v) for v in state.tolist())
    else:
        random_bits.next_key(seed)  # Checks the argument.
        seed_value, counter = seed, 0
    if device is None:
        device = keras.ops.convert_to_tensor(0).device
    return random_bits.python_key(seed_value, counter), torch.device(device)
