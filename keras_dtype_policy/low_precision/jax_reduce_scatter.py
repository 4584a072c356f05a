"""A JAX train step whose gradients are reduce-scattered (ZeRO-1).

Under `keras.distribution.DataParallel`, Keras' JAX train step computes
the gradients of the whole batch in one partitioned program, and XLA sums
them across devices with one all-reduce. Where the optimizer state is
split (`shard_optimizer_state`), each device needs only its own part of
each gradient, and the sum a device does not keep is wasted traffic.
This step computes each device's gradients from its own examples inside
`jax.shard_map` and sums them with `lax.psum_scatter` into the state's
layout: a reduce-scatter, half the bytes of an all-reduce. The update
then runs on each device's part (the partitioned program Keras compiles),
and XLA all-gathers the new weights (in float32 on a CPU, which converts
a bfloat16 collective). Together: the bytes data parallelism's all-reduce
moves, and 1/N of the state a device.

What it asks of the model (the contract of every per-device data-parallel
step: torch's DistributedDataParallel, `jax.pmap`): the loss is a mean of
per-example terms over equal per-device parts of the batch, and no layer
updates state from the batch. A layer that does (`BatchNormalization`'s
moving statistics) raises, naming its variable; random layers (`Dropout`)
draw their bits with the device's index folded into their seed, so the
devices' masks differ, as they must, and the seed state advances as
Keras advances it.
"""

import jax
import keras
import numpy as np
from jax.sharding import PartitionSpec

from keras_dtype_policy.low_precision import state_sharding

if hasattr(jax, "shard_map"):
    _EXPERIMENTAL_SHARD_MAP = None
else:  # JAX releases before 0.7
    from jax.experimental import shard_map as _experimental

    _EXPERIMENTAL_SHARD_MAP = _experimental.shard_map

# Added to a seed generator's first word, times the device's index, to
# give each device its own random bits (the 32-bit golden ratio: indices
# land far from one another and from nearby seeds).
_SEED_STRIDE = 0x9E3779B9


def train_step(model, state, data):
    """Keras' JAX `train_step`, with the gradients reduce-scattered.

    Args:
        model: The Keras model whose step this is.
        state: Keras' `(trainable, non_trainable, optimizer, metrics)`
            variable values.
        data: One batch, as Keras' `train_step` receives it.

    Returns:
        `(logs, state)`, as Keras' `train_step`.
    """
    trainable, non_trainable, optimizer_values, metrics = state
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    step = _LocalStep(model, keras.distribution.distribution())
    kept = [
        value
        for value, split in zip(
            optimizer_values, step.optimizer_split, strict=True
        )
        if not split
    ]
    unscaled_loss, y_pred, non_trainable, metrics, grads = step.run(
        trainable, non_trainable, kept, metrics, (x, y, sample_weight)
    )
    trainable, optimizer_values = model.optimizer.stateless_apply(
        optimizer_values, grads, trainable
    )
    logs, metrics = model._update_metrics_variables(
        metrics, unscaled_loss, x, y, y_pred, sample_weight
    )
    return logs, (trainable, non_trainable, optimizer_values, metrics)


class _LocalStep:
    """The forward and backward pass of each device, as a `shard_map`."""

    def __init__(self, model, distribution):
        check_replicated(model)
        self.model = model
        self.axis = distribution.batch_dim_name
        self.mesh = distribution.device_mesh.backend_mesh
        self.devices = self.mesh.shape[self.axis]
        self.gradient_specs = [
            gradient_spec(v, distribution) for v in model.trainable_variables
        ]
        self.optimizer_split = [
            self.axis in _axes_of(v) for v in model.optimizer.variables
        ]
        self.seeds = [_is_seed_state(v) for v in model.non_trainable_variables]

    def run(self, trainable, non_trainable, kept, metrics, data):
        batch = PartitionSpec(self.axis)
        replicated = PartitionSpec()
        mapped = _shard_map(
            self.local,
            self.mesh,
            (replicated, replicated, replicated, replicated, batch),
            (replicated, batch, replicated, replicated, self.gradient_specs),
        )
        return mapped(trainable, non_trainable, kept, metrics, data)

    def local(self, trainable, non_trainable, kept, metrics, data):
        """One device's pass over its examples; sums across devices."""
        model = self.model
        index = jax.lax.axis_index(self.axis)
        folded = [
            _fold(value, index) if seed else value
            for value, seed in zip(non_trainable, self.seeds, strict=True)
        ]
        values = iter(kept)
        optimizer_values = [
            keras.ops.zeros(v.shape, v.dtype) if split else next(values)
            for v, split in zip(
                model.optimizer.variables, self.optimizer_split, strict=True
            )
        ]
        grad_fn = jax.value_and_grad(self.share_of_loss, has_aux=True)
        (_, aux), grads = grad_fn(
            trainable,
            folded,
            metrics,
            *data,
            training=True,
            optimizer_variables=optimizer_values,
        )
        unscaled_loss, y_pred, new_non_trainable, new_metrics = aux
        grads = [
            self.reduce(g, spec)
            for g, spec in zip(grads, self.gradient_specs, strict=True)
        ]
        new_non_trainable = [
            self.settle(variable, old, folded_old, new)
            for variable, old, folded_old, new in zip(
                model.non_trainable_variables,
                non_trainable,
                folded,
                new_non_trainable,
                strict=True,
            )
        ]
        new_metrics = [
            old + jax.lax.psum(new - old, self.axis)
            for old, new in zip(metrics, new_metrics, strict=True)
        ]
        unscaled_loss = jax.lax.pmean(unscaled_loss, self.axis)
        return unscaled_loss, y_pred, new_non_trainable, new_metrics, grads

    def share_of_loss(self, *args, **kwargs):
        """Keras' loss of this device's examples over the device count:
        its share of the whole batch's mean, so that each device's
        gradients are the parts Keras' step sums (the same range in
        float16, and the same values)."""
        loss, aux = self.model.compute_loss_and_updates(*args, **kwargs)
        return loss / np.asarray(self.devices, dtype=loss.dtype), aux

    def reduce(self, gradient, spec):
        """The sum over devices, kept split where `spec` splits it."""
        dimension = _split_dimension(spec, self.axis)
        if dimension is None:
            return jax.lax.psum(gradient, self.axis)
        return jax.lax.psum_scatter(
            gradient, self.axis, scatter_dimension=dimension, tiled=True
        )

    def settle(self, variable, old, folded_old, new):
        """A non-trainable variable's value after the step, the same on
        every device: unchanged, or a seed advanced as Keras advances it."""
        if new is folded_old:
            return old
        if _is_seed_state(variable):
            return old + (new - folded_old)
        raise ValueError(
            "shard_optimizer_state(reduce_scatter=True) computes each "
            "device's gradients from its own examples, so a layer that "
            "updates a variable from the batch would see one device's part "
            f"of it. Received: a model whose variable {variable.path!r} "
            "changes in the train step (e.g. BatchNormalization's moving "
            "statistics). Use reduce_scatter=False for this model."
        )


def gradient_spec(variable, distribution):
    """The `PartitionSpec` a weight's gradient is summed into: its
    optimizer slots' split layout (`state_sharding.sharded_layout`)."""
    layout = state_sharding.sharded_layout(variable.shape, None, distribution)
    if layout is None:
        return PartitionSpec()
    return PartitionSpec(*layout.axes)


def check_replicated(model):
    """Raises unless every trainable variable of `model` is whole on every
    device (`DataParallel`), which the per-device pass needs."""
    for variable in model.trainable_variables:
        axes = _axes_of(variable)
        if any(entry is not None for entry in axes):
            raise ValueError(
                "shard_optimizer_state(reduce_scatter=True) runs each "
                "device's forward pass on whole weights (DataParallel). "
                f"Received: the variable {variable.path!r} laid out as "
                f"{axes} (ModelParallel); use reduce_scatter=False there."
            )


def _axes_of(variable):
    """A variable's layout as one mesh axis (or None) a dimension."""
    layout = getattr(variable, "_layout", None)
    if isinstance(layout, keras.distribution.TensorLayout):
        return tuple(layout.axes)
    spec = getattr(layout, "spec", None)
    if spec is not None:
        return tuple(spec) + (None,) * (len(variable.shape) - len(spec))
    return (None,) * len(variable.shape)


def _shard_map(function, mesh, in_specs, out_specs):
    """`jax.shard_map` without its replication check (the step sums what
    must agree itself); the experimental one on JAX releases before it."""
    if _EXPERIMENTAL_SHARD_MAP is not None:
        return _EXPERIMENTAL_SHARD_MAP(
            function, mesh, in_specs, out_specs, check_rep=False
        )
    return jax.shard_map(
        function,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        check_vma=False,
    )


def _split_dimension(spec, axis):
    for dimension, entry in enumerate(spec):
        entries = entry if isinstance(entry, tuple) else (entry,)
        if axis in entries:
            return dimension
    return None


def _is_seed_state(variable):
    """True for the state of a `keras.random.SeedGenerator`."""
    return variable.name == "seed_generator_state" and "int" in str(
        variable.dtype
    )


def _fold(seed_state, index):
    """A seed state with the device's index folded into its first word."""
    offset = (index.astype("uint32") * np.uint32(_SEED_STRIDE)).astype(
        seed_state.dtype
    )
    return seed_state.at[0].add(offset)
