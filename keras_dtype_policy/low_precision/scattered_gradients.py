"""The train step of `shard_optimizer_state(model, reduce_scatter=True)`.

Sets `train_step` on the model instance (listed in
`patches.INSTANCE_PATCHES`): Keras' JAX step with each device's gradients
reduce-scattered into the split state's layout instead of all-reduced
(`jax_reduce_scatter`). `uninstall()` takes it off every model.
"""

import types
import weakref

import keras

from keras_dtype_policy import backend_dispatch

# The method set on model instances.
SCATTER_METHODS = ("train_step",)
_scattering: weakref.WeakSet = weakref.WeakSet()


def install(model):
    """Gives `model` the reduce-scatter train step (JAX).

    Raises:
        NotImplementedError: Off JAX, and under Keras' Flax NNX mode,
            whose trainer calls the class' `train_step`.
        ValueError: If the model's class defines its own `train_step`.
    """
    if not backend_dispatch.is_jax():
        raise NotImplementedError(
            "shard_optimizer_state(reduce_scatter=True) builds a JAX train "
            "step (jax.shard_map). Received: "
            f"backend={backend_dispatch.name()!r}; use reduce_scatter=False."
        )
    if keras.config.is_nnx_enabled():
        raise NotImplementedError(
            "shard_optimizer_state(reduce_scatter=True) sets the model's "
            "train_step, which Keras' Flax NNX mode does not call. Received: "
            "keras.config.is_nnx_enabled() == True; use reduce_scatter=False."
        )
    own = type(model).train_step
    if own is not keras.Model.train_step:
        raise ValueError(
            "shard_optimizer_state(reduce_scatter=True) replaces Keras' own "
            "train step, and the model's class defines its own. Received: "
            f"model of class {type(model).__name__} with train_step "
            f"{own.__qualname__}; use reduce_scatter=False, or reduce-scatter "
            "in your train_step."
        )
    model.train_step = types.MethodType(_train_step, model)
    model.train_function = None  # made again, with this step, by fit
    _scattering.add(model)


def installed(model):
    """True if `model` has the reduce-scatter train step."""
    return model in _scattering


def remove_all():
    """Takes the reduce-scatter step off every model that holds it."""
    for model in list(_scattering):
        vars(model).pop("train_step", None)
        model.train_function = None
    _scattering.clear()


def _train_step(self, state, data):
    return backend_dispatch.module_for("reduce_scatter").train_step(
        self, state, data
    )
