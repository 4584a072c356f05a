"""Whole values of JAX arrays split across processes, for saving."""

import numpy as np
from jax.experimental import multihost_utils


def host_value(value):
    """Returns a `jax.Array` as one NumPy array on this process.

    An array split across processes (optimizer state under
    `shard_optimizer_state` with several processes) has no value on any
    one of them: it is gathered from all. That is a collective, which
    every process must join in the same order, as every process calls
    `model.save` (docs/distributed-training.md).

    Args:
        value: A `jax.Array`.

    Returns:
        A NumPy array of the whole value.
    """
    if value.is_fully_addressable or value.is_fully_replicated:
        return np.asarray(value)
    return np.asarray(multihost_utils.process_allgather(value, tiled=True))
