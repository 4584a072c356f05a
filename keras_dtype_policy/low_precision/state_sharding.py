"""Optimizer state split across the data-parallel devices (ZeRO stage 1).

ZeRO's first stage (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models", arXiv:1910.02054, section
5.1, "P_os"): each data-parallel device keeps the optimizer state of its
own part of the weights only.

Under `keras.distribution` (JAX), Keras lays each optimizer slot out as
its weight: replicated under `DataParallel`, so every device holds all of
the state. `shard_optimizer_state` gives each state variable of an
optimizer a layout split along the distribution's data axis instead; the
weights keep theirs. XLA's partitioner then runs the update on each
device's shard and gathers the new weights (docs/distributed-training.md
lists the collectives measured). It sets `add_variable` on the optimizer
instances (listed in `patches.INSTANCE_PATCHES`), so state made later is
created split and never whole.

Which dimension is split: the first, if its size is divisible by the data
axis' device count and no mesh axis splits it yet; else the largest such
dimension; else none (the variable stays as its weight's layout says, e.g.
replicated). A variable already split along the data axis is kept.
"""

import types
import weakref

import keras

from keras_dtype_policy import backend_dispatch
from keras_dtype_policy.low_precision import multi_optimizers
from keras_dtype_policy.low_precision import scattered_gradients

# The methods `shard_optimizer_state` sets on optimizer instances
# (`apply` on torch only).
SHARDING_METHODS = ("add_variable", "save_own_variables", "apply")
_sharding: weakref.WeakSet = weakref.WeakSet()

_ELSEWHERE = {
    backend_dispatch.TENSORFLOW: (
        "TensorFlow's tf.distribute strategies keep one copy of the "
        "optimizer state per replica (MirroredStrategy) or place it on "
        "parameter servers (ParameterServerStrategy)"
    ),
    backend_dispatch.TORCH: (
        "Keras {version}'s torch backend has no distribution API (Keras' "
        "development builds, keras-nightly, add one, which the switch "
        "supports); in a torch.distributed loop, shard the state with "
        "torch's own tools (FSDP, or ZeroRedundancyOptimizer for a torch "
        "optimizer)"
    ),
}


def _supports(backend):
    """True where the switch can split state on `backend`: JAX, and torch
    where Keras' torch backend has `keras.distribution`."""
    if backend == backend_dispatch.JAX:
        return True
    return backend == backend_dispatch.TORCH and torch_has_distribution()


def torch_has_distribution():
    """True where Keras' torch backend has `keras.distribution` (Keras'
    development branch); its releases up to 3.15 have none, and
    `keras.distribution.list_devices()` raises `AttributeError` there."""
    try:
        keras.distribution.list_devices()
    except AttributeError:
        return False
    return True


def shard_optimizer_state(
    optimizer: keras.optimizers.Optimizer | keras.Model,
    *,
    reduce_scatter: bool = False,
) -> keras.optimizers.Optimizer | keras.Model:
    """Splits an optimizer's state across the data-parallel devices.

    ZeRO stage 1 on `keras.distribution` (JAX, and torch where Keras'
    torch backend has it: keras-nightly): each state variable (the
    slots of the inner Keras optimizer, a `LowPrecisionOptimizer`'s
    compensation buffers and 8-bit codes and scales) is laid out split
    along the distribution's data axis, on top of its weight's own layout.
    Scalars, loss-scale counters and seeds stay replicated. State already
    built is moved to the new layout now; call it before `fit` makes its
    train step (e.g. right after `compile` or `load_model`).

    With `reduce_scatter=True` (JAX, `DataParallel`), the model's train
    step sums each device's gradients into the split layout with a
    reduce-scatter instead of an all-reduce (DeepSpeed's ZeRO
    `reduce_scatter`): the bytes of data parallelism's all-reduce. It
    asks for a loss that is a mean of per-example terms and no layer
    updating state from the batch (docs/distributed-training.md).

    Args:
        optimizer: A Keras optimizer (wrappers included), or a compiled
            model, whose optimizer is split.
        reduce_scatter: Whether to give the model the reduce-scatter step.

    Returns:
        What it was given, for `model.compile(shard_optimizer_state(...))`.

    Raises:
        NotImplementedError: On TensorFlow and a Keras release's torch,
            naming what they have; on torch, for a `LowPrecisionOptimizer`.
        ValueError: If no `keras.distribution` is set.
        TypeError: For a first argument neither an optimizer nor a
            compiled model, or a `reduce_scatter` not a bool or given
            with an optimizer.

    Example:

    >>> keras.distribution.set_distribution(keras.distribution.DataParallel())
    >>> model.compile(keras.optimizers.Adam(), "mse")
    >>> keras_dtype_policy.shard_optimizer_state(model.optimizer)
    """
    model, optimizer = _model_and_optimizer(optimizer, reduce_scatter)
    _refuse_backend(optimizer)
    distribution = keras.distribution.distribution()
    if distribution is None:
        raise ValueError(
            "shard_optimizer_state needs a keras.distribution: call "
            "keras.distribution.set_distribution(DataParallel() or "
            f"ModelParallel(...)) first. Received: optimizer={optimizer.name!r}"
            " with distribution=None"
        )
    if reduce_scatter:
        scattered_gradients.install(model)  # first: it may refuse
    _shard(optimizer, distribution)
    return optimizer if model is None else model


def _model_and_optimizer(given, reduce_scatter):
    """`(model or None, optimizer)` of `shard_optimizer_state`'s first
    argument, checked."""
    if not isinstance(reduce_scatter, bool):
        raise TypeError(
            "shard_optimizer_state's reduce_scatter must be True or False. "
            f"Received: reduce_scatter={reduce_scatter!r}"
        )
    if isinstance(given, keras.Model):
        if getattr(given, "optimizer", None) is None:
            raise TypeError(
                "shard_optimizer_state splits a model's optimizer: compile "
                f"the model first. Received: model {given.name!r} with no "
                "optimizer"
            )
        return given, given.optimizer
    if not isinstance(given, keras.optimizers.Optimizer):
        raise TypeError(
            "shard_optimizer_state expects a keras.optimizers.Optimizer or "
            f"a compiled keras.Model. Received: optimizer={given!r} (of type "
            f"{type(given).__name__})"
        )
    if reduce_scatter:
        raise TypeError(
            "shard_optimizer_state(reduce_scatter=True) changes the model's "
            "train step: pass the compiled model, not its optimizer. "
            f"Received: optimizer={given.name!r} with reduce_scatter=True"
        )
    return None, given


def shards_state(optimizer):
    """True if `shard_optimizer_state` was applied to `optimizer`."""
    return optimizer in _sharding


def follow_inner(wrapper):
    """Shards a wrapper's own state where its inner optimizer's is sharded
    (e.g. a wrapper that `compile` put around a sharded optimizer)."""
    inner = getattr(wrapper, "inner_optimizer", None)
    distribution = keras.distribution.distribution()
    if inner is not None and shards_state(inner) and distribution is not None:
        _shard(wrapper, distribution)


def sharded_layout(shape, layout, distribution):
    """Returns `layout` split along `distribution`'s data axis.

    Args:
        shape: The variable's shape.
        layout: Its `keras.distribution.TensorLayout`, or None (replicated).
        distribution: The `keras.distribution.Distribution`.

    Returns:
        A `TensorLayout`, or `layout` itself where no dimension can split.
    """
    torch_sharding = _torch_sharding()
    if torch_sharding is not None:
        layout = torch_sharding.keras_layout(shape, layout, distribution)
    if layout is not None and not isinstance(
        layout, keras.distribution.TensorLayout
    ):
        return layout  # a backend layout the caller chose: kept
    mesh = distribution.device_mesh
    if layout is not None and layout.device_mesh is not None:
        mesh = layout.device_mesh
    axis = distribution.batch_dim_name
    if axis not in mesh.axis_names:
        return layout
    axes = list(layout.axes) if layout is not None else [None] * len(shape)
    if len(axes) != len(shape) or axis in _used_axes(axes):
        return layout
    devices = mesh.shape[list(mesh.axis_names).index(axis)]
    free = [
        d
        for d, size in enumerate(shape)
        if axes[d] is None and size >= devices and size % devices == 0
    ]
    if devices == 1 or not free:
        return layout
    dimension = 0 if 0 in free else max(free, key=lambda d: shape[d])
    axes[dimension] = axis
    return keras.distribution.TensorLayout(axes, mesh)


def unshard_all():
    """Takes `SHARDING_METHODS` (`add_variable`, `save_own_variables`)
    off every optimizer that holds them.

    Called by `keras_dtype_policy.uninstall()`: state made afterwards gets
    Keras' layout; state already made keeps its own (and is saved as
    Keras saves it, which a value split across processes fails).
    """
    for optimizer in list(_sharding):
        for name in SHARDING_METHODS:
            vars(optimizer).pop(name, None)
    _sharding.clear()


def _shard(optimizer, distribution):
    for member in _chain(optimizer):
        # A loss-scale optimizer's own variables are its scale and
        # counters: they stay replicated.
        if isinstance(member, keras.optimizers.LossScaleOptimizer):
            continue
        if member not in _sharding:
            member.add_variable = types.MethodType(_add_variable, member)
            member.save_own_variables = types.MethodType(
                _save_own_variables, member
            )
            if backend_dispatch.is_torch():
                member.apply = types.MethodType(_promoted_apply, member)
            _sharding.add(member)
        if member.built:
            for variable in _state_of(member):
                layout = sharded_layout(
                    variable.shape, variable._layout, distribution
                )
                if layout is not variable._layout:
                    _relayout(variable, layout)


def _relayout(variable, layout):
    """Moves a built state variable to `layout`."""
    torch_sharding = _torch_sharding()
    if torch_sharding is not None:
        torch_sharding.relayout(variable, layout)
        return
    value = variable.value
    variable._layout = layout
    variable.assign(value)


def _promoted_apply(self, grads, trainable_variables=None):
    """Keras' `apply` in its torch DTensor promotion mode: the plain
    gradients and weights that meet split state become replicated
    DTensors (see `torch_sharding`)."""
    return _torch_sharding().promoted(
        type(self).apply, self, grads, trainable_variables
    )


def _refuse_backend(optimizer):
    """Raises where `optimizer`'s state cannot split on this backend."""
    backend = backend_dispatch.name()
    if not _supports(backend):
        elsewhere = _ELSEWHERE[backend].format(version=keras.__version__)
        raise NotImplementedError(
            "shard_optimizer_state works on keras.distribution: JAX, and "
            f"torch on Keras' development builds. {elsewhere}. "
            f"Received: optimizer={optimizer.name!r} on backend={backend!r}"
        )
    if backend_dispatch.is_torch():
        _refuse_unsplit(optimizer)


def _torch_sharding():
    """`torch_sharding` where Keras' torch backend has a distribution
    API (the module reads its internals), else None."""
    if backend_dispatch.is_torch() and torch_has_distribution():
        return backend_dispatch.module_for("sharding")
    return None


def _refuse_unsplit(optimizer):
    """Raises for an optimizer in `optimizer`'s chain whose torch step
    cannot run on split state."""
    for member in _chain(optimizer):
        # The package's optimizers whose torch step runs batched kernels
        # on whole tensors say so (LowPrecisionOptimizer).
        if not getattr(member, "splits_state_on_torch", True):
            raise NotImplementedError(
                "shard_optimizer_state cannot split a LowPrecisionOptimizer's "
                "state on torch: its step runs batched torch kernels on "
                "whole tensors. Split the state of a Keras optimizer (under "
                "a mixed policy, wrapped by this package's "
                "LossScaleOptimizer or not), or use the JAX backend. "
                f"Received: optimizer={optimizer.name!r} holding "
                f"{member.name!r} of type {type(member).__name__}"
            )


def _add_variable(
    self,
    shape,
    initializer="zeros",
    dtype=None,
    aggregation="none",
    layout=None,
    name=None,
):
    distribution = keras.distribution.distribution()
    if distribution is not None:
        layout = sharded_layout(shape, layout, distribution)
    return type(self).add_variable(
        self,
        shape,
        initializer=initializer,
        dtype=dtype,
        aggregation=aggregation,
        layout=layout,
        name=name,
    )


def _save_own_variables(self, store):
    """Keras' `Optimizer.save_own_variables`, each value whole: state
    split across processes is gathered first (see `saved_value`)."""
    for i, variable in enumerate(self.variables):
        store[str(i)] = saved_value(variable)


def saved_value(variable):
    """Returns a variable's whole value as a NumPy array, as
    `variable.numpy()` does, gathered from every process where it is split
    across processes (JAX; every process saves together)."""
    gathering = backend_dispatch.module_for("gathering")
    if gathering is None:
        return variable.numpy()
    return gathering.host_value(variable.value)


def _chain(optimizer):
    """The optimizer, the inner optimizers it wraps, and the sub-optimizers
    of a Keras `MultiOptimizer` among them (and what those wrap)."""
    while optimizer is not None:
        yield optimizer
        for sub in multi_optimizers.sub_optimizers(optimizer):
            yield from _chain(sub)
        optimizer = getattr(optimizer, "inner_optimizer", None)


def _state_of(optimizer):
    """The optimizer's own variables that can split: all but scalars and
    its random seed."""
    seed = getattr(getattr(optimizer, "seed_generator", None), "state", None)
    return [
        v
        for v in optimizer._variables
        if len(v.shape) and v is not seed and getattr(v, "_layout", None)
    ]


def _used_axes(axes):
    used = set()
    for entry in axes:
        if isinstance(entry, (tuple, list)):
            used.update(entry)
        elif entry is not None:
            used.add(entry)
    return used
