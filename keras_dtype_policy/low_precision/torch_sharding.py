"""Optimizer state split along the data axis on Keras' torch distribution.

Keras' development branch (keras-nightly 3.16.0.dev2026102704 and later)
gives its torch backend `keras.distribution`: `DataParallel` wraps the
model in torch's DistributedDataParallel, `ModelParallel` lays variables
out as DTensors. A variable whose layout splits a dimension holds a
DTensor with a `Shard` placement there. `state_sharding` gives each state
variable such a layout, split along the data axis, as on JAX; this module
is torch's part of it:

- a weight's own layout read back as axes: Keras keeps the torch
  `DTensorLayout` (mesh and placements) on a variable it distributed;
- state already made moved to its new layout: on torch `assign` keeps
  the value's layout, Keras lays a value out only when it is made;
- the update run in Keras' DTensor promotion mode, which turns the plain
  gradients and replicated weights that meet a split slot into replicated
  DTensors (torch refuses to mix plain tensors and DTensors in one
  operation). Each process then updates its own part of the state, and
  the weights come out replicated, as DistributedDataParallel expects.

Importing this module imports torch and Keras' torch backend: reach it
through `backend_dispatch.module_for("sharding")`.
"""

import threading

import keras
import torch
from keras.src.backend.torch.distribution_lib import DTensorLayout
from keras.src.backend.torch.ops.core import KerasDTensorPromotionMode
from torch.distributed.tensor import DTensor

_promotion = threading.local()


def keras_layout(shape, layout, distribution):
    """A torch `DTensorLayout` as the `keras.distribution.TensorLayout` it
    stands for (other layouts as they are).

    Args:
        shape: The variable's shape.
        layout: Its layout.
        distribution: The `keras.distribution.Distribution` whose mesh it
            is laid out on.
    """
    if not isinstance(layout, DTensorLayout):
        return layout
    names = layout.device_mesh.mesh_dim_names
    axes = [None] * len(shape)
    for name, placement in zip(names, layout.placements, strict=True):
        if placement.is_shard():
            dimension = placement.dim
            if axes[dimension] is None:
                axes[dimension] = name
            else:
                axes[dimension] = tuple(_listed(axes[dimension])) + (name,)
    return keras.distribution.TensorLayout(axes, distribution.device_mesh)


def relayout(variable, layout):
    """Moves a variable's value to `layout` (every process together: a
    value split another way is redistributed, a collective)."""
    value = variable._value
    if isinstance(value, torch.nn.Parameter):
        value = value.data
    variable._layout = layout
    variable._initialize(value.detach().clone())


def promoted(apply, *args, **kwargs):
    """Runs `apply(*args, **kwargs)` in Keras' DTensor promotion mode,
    entered once however deeply optimizers nest their `apply`."""
    if getattr(_promotion, "active", False):
        return apply(*args, **kwargs)
    _promotion.active = True
    try:
        with KerasDTensorPromotionMode():
            return apply(*args, **kwargs)
    finally:
        _promotion.active = False


def local_elements(variable):
    """How many elements of `variable` this process holds."""
    value = variable._value
    value = getattr(value, "data", value)
    if isinstance(value, DTensor):
        return value.to_local().numel()
    return value.numel()


def _listed(entry):
    return entry if isinstance(entry, (tuple, list)) else (entry,)
