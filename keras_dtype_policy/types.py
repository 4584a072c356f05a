"""The type aliases of the package's annotations; no backend is imported.

A tensor is whatever the running backend computes with (a `jax.Array`, a
`tf.Tensor`, a `torch.Tensor`), a `KerasTensor` or a NumPy array: as in
keras-rs (`keras_rs/src/types.py`), the alias is `Any`, so that annotating
a function never imports a backend.
"""

from collections.abc import Callable
from typing import Any
from typing import TypeAlias

Tensor: TypeAlias = Any
"""A tensor of the running backend, a `KerasTensor` or a NumPy array."""

Data: TypeAlias = Any
"""Inputs or labels: an array, or a list, tuple or dict of arrays."""

LossFunction: TypeAlias = str | Callable[..., Tensor]
"""A loss: a Keras loss name, a `keras.losses.Loss`, or a function of
`(y_true, y_pred)`."""
