"""Training state carried from one model's optimizer to another's.

Two copies of a model (one under the package's policies, one under Keras'
own, or under two configurations of the package) hold the same weights
and the same optimizer state in different forms: a bfloat16 weight and its
Kahan compensation, or a float32 weight; a slot of 8-bit codes, a bfloat16
slot, or a float32 one. Here each is read as the float32 value it stands
for and written in the other copy's form:

- a weight with a compensation buffer reads as weight + compensation
  (`kahan_read`); one is written as the nearest weight and the rest in its
  compensation (`kahan_write`), any other weight as the value rounded to
  nearest in its dtype;
- a slot reads as its float32 value (a coded slot dequantized); it is
  written rounded to nearest (a coded slot quantized to the nearer level);
- the step count and a learning rate held in a variable are copied, as
  are a dynamic loss scale and its counter.

Slots pair by name: Keras names a slot after its weight's path and its
role (`dense_kernel_momentum`), and the package's wrappers keep those
names, so the weights pair in order and the roles by name.
"""

import dataclasses
from typing import NamedTuple

import keras
import numpy as np
from keras import ops

from keras_dtype_policy.low_precision import compensated_updates
from keras_dtype_policy.low_precision import multi_optimizers
from keras_dtype_policy.low_precision.optimizer import LowPrecisionOptimizer
from keras_dtype_policy.low_precision.quantized_slots import QuantizedSlot


class Wrappers(NamedTuple):
    """An optimizer taken apart into the wrappers around a Keras one.

    Attributes:
        loss_scale: The `keras.optimizers.LossScaleOptimizer` (Keras' or
            the package's) outermost, or None.
        low_precision: The `LowPrecisionOptimizer` inside it, or None.
        inner: The Keras optimizer whose step runs.
    """

    loss_scale: keras.optimizers.LossScaleOptimizer | None
    low_precision: LowPrecisionOptimizer | None
    inner: keras.optimizers.Optimizer


class ScaleState(NamedTuple):
    """A dynamic loss scale's state: the scale and its counter."""

    scale: np.ndarray
    counter: np.ndarray


@dataclasses.dataclass
class OptimizerState:
    """An optimizer's state in float32, slots named as Keras names them.

    Attributes:
        iterations: The step count.
        learning_rate: The learning rate where a variable holds it (None
            for a schedule).
        slots: `{slot name: float32 array}`.
        loss_scale: The `ScaleState`, or None without loss scaling.
        subs: For a Keras `MultiOptimizer`, the `OptimizerState` of each
            sub-optimizer, in its order; else empty.
    """

    iterations: np.ndarray
    learning_rate: np.ndarray | None
    slots: dict
    loss_scale: ScaleState | None
    subs: list = dataclasses.field(default_factory=list)


def unwrapped(optimizer):
    """Returns the `Wrappers` of `optimizer`.

    Raises:
        TypeError: if `optimizer` is not a Keras optimizer.
        ValueError: for wrappers in another order than a loss-scale one
            around a low-precision one around a Keras optimizer.
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            "`optimizer` must be a keras.optimizers.Optimizer. Received: "
            f"optimizer={optimizer!r} (of type {type(optimizer).__name__})"
        )
    scale = low = None
    inner = optimizer
    if isinstance(inner, keras.optimizers.LossScaleOptimizer):
        scale, inner = inner, inner.inner_optimizer
    if isinstance(inner, LowPrecisionOptimizer):
        low, inner = inner, inner.inner_optimizer
    if isinstance(
        inner, (keras.optimizers.LossScaleOptimizer, LowPrecisionOptimizer)
    ):
        raise ValueError(
            "Only a loss-scale optimizer around a LowPrecisionOptimizer "
            "around a Keras optimizer can be taken apart. Received: "
            f"optimizer={optimizer!r}, with {inner!r} inside"
        )
    return Wrappers(scale, low, inner)


def is_built(optimizer):
    """True once `optimizer` (and the optimizers inside it) built."""
    return bool(getattr(unwrapped(optimizer).inner, "built", False))


def slot_variables(optimizer):
    """Returns `{slot name: variable}` of the state of `optimizer`'s inner
    Keras optimizer: its variables but the step count and learning rate,
    and its coded slots (`QuantizedSlot`s) where a `LowPrecisionOptimizer`
    keeps them."""
    parts = unwrapped(optimizer)
    inner = parts.inner
    if multi_optimizers.is_multi_optimizer(inner):
        # Its slots are its sub-optimizers' (`OptimizerState.subs`).
        return {}
    skip = {id(inner.iterations)}
    if isinstance(inner._learning_rate, keras.Variable):
        skip.add(id(inner._learning_rate))
    slots = {v.name: v for v in inner.variables if id(v) not in skip}
    if parts.low_precision is not None:
        slots.update({s.name: s for s in parts.low_precision.quantized_slots})
    return slots


def read_state(optimizer):
    """Returns the `OptimizerState` of a built `optimizer`."""
    parts = unwrapped(optimizer)
    inner = parts.inner
    rate = inner._learning_rate
    scale = None
    if parts.loss_scale is not None:
        scale = ScaleState(
            _numpy(parts.loss_scale.dynamic_scale),
            _numpy(parts.loss_scale.step_counter),
        )
    return OptimizerState(
        iterations=_numpy(inner.iterations),
        learning_rate=(
            _numpy(rate) if isinstance(rate, keras.Variable) else None
        ),
        slots={
            name: _numpy(ops.cast(variable.value, "float32"))
            for name, variable in slot_variables(optimizer).items()
        },
        loss_scale=scale,
        subs=[
            read_state(sub) for sub in multi_optimizers.sub_optimizers(inner)
        ],
    )


def write_state(optimizer, state, rename=None):
    """Writes `state` into the built `optimizer`, in its slots' forms.

    Every value is checked before the first is written: a mismatch
    leaves `optimizer` as it was.

    Args:
        optimizer: The optimizer to write into, built.
        state: An `OptimizerState`.
        rename: A function of a slot name in `state` returning its name
            in `optimizer` (see `slot_renamer`); None keeps the names.

    Raises:
        ValueError: if the slots differ in names or shapes.
    """
    check_state(optimizer, state, rename)
    _write_state(optimizer, state, rename)


def check_state(optimizer, state, rename=None):
    """Raises a ValueError where `state` (as `write_state` takes it)
    does not fit the built `optimizer`: slots' names or shapes, or the
    number of a MultiOptimizer's sub-optimizers."""
    _check_slots(slot_variables(optimizer), _renamed(state.slots, rename))
    subs = multi_optimizers.sub_optimizers(unwrapped(optimizer).inner)
    if len(subs) != len(state.subs):
        raise ValueError(
            "The optimizers hold different numbers of sub-optimizers: "
            f"{len(state.subs)} saved, {len(subs)} in the new one"
        )
    for sub, sub_state in zip(subs, state.subs, strict=True):
        check_state(sub, sub_state, rename)


def _write_state(optimizer, state, rename):
    parts = unwrapped(optimizer)
    targets = slot_variables(optimizer)
    values = _renamed(state.slots, rename)
    for name, variable in targets.items():
        if isinstance(variable, QuantizedSlot):
            variable.store(values[name], nearest=True)
        else:
            variable.assign(ops.cast(values[name], variable.dtype))
    inner = parts.inner
    inner.iterations.assign(ops.cast(state.iterations, inner.iterations.dtype))
    rate = inner._learning_rate
    if state.learning_rate is not None and isinstance(rate, keras.Variable):
        rate.assign(ops.cast(state.learning_rate, rate.dtype))
    if parts.loss_scale is not None and state.loss_scale is not None:
        wrapper = parts.loss_scale
        wrapper.dynamic_scale.assign(
            ops.cast(state.loss_scale.scale, wrapper.dynamic_scale.dtype)
        )
        wrapper.step_counter.assign(
            ops.cast(state.loss_scale.counter, wrapper.step_counter.dtype)
        )
    subs = multi_optimizers.sub_optimizers(inner)
    for sub, sub_state in zip(subs, state.subs, strict=True):
        _write_state(sub, sub_state, rename)


def _check_slots(targets, values):
    missing = sorted(set(targets) - set(values))
    extra = sorted(set(values) - set(targets))
    if missing or extra:
        raise ValueError(
            "The optimizers hold different state: slots only in the new "
            f"one: {missing}; only in the saved one: {extra}"
        )
    for name, variable in targets.items():
        if tuple(values[name].shape) != tuple(variable.shape):
            raise ValueError(
                f"The optimizers' slot {name} differs in shape: "
                f"{tuple(values[name].shape)} saved, "
                f"{tuple(variable.shape)} in the new one"
            )


def weight_pairs(source, target):
    """Pairs the trainable weights of two copies of a model, in order.

    Raises:
        ValueError: if their number or shapes differ.
    """
    ours = list(source.trainable_variables)
    theirs = list(target.trainable_variables)
    if len(ours) != len(theirs) or any(
        tuple(a.shape) != tuple(b.shape)
        for a, b in zip(ours, theirs, strict=True)
    ):
        raise ValueError(
            f"The copy of model {source.name!r} holds other trainable "
            "weights than the model; its optimizer state cannot be carried"
        )
    return list(zip(ours, theirs, strict=True))


def slot_renamer(pairs):
    """Returns the function renaming a slot of a weight that has another
    path in the copy (`pairs` from `weight_pairs`) after its new path."""
    prefixes = [
        (a.path.replace("/", "_") + "_", b.path.replace("/", "_") + "_")
        for a, b in pairs
        if a.path != b.path
    ]
    # The longest first: `dense_1_kernel_` before `dense_1_`.
    prefixes.sort(key=lambda pair: len(pair[0]), reverse=True)

    def rename(name):
        for old, new in prefixes:
            if name.startswith(old):
                return new + name[len(old) :]
        return name

    return rename


def _renamed(slots, rename):
    if rename is None:
        return dict(slots)
    return {rename(name): value for name, value in slots.items()}


def weight_value(variable, optimizer):
    """The float32 value of a weight: with its Kahan compensation added
    where `optimizer` (or None) keeps one."""
    compensation = _compensation(variable, optimizer)
    if compensation is None:
        return ops.cast(variable.value, "float32")
    return compensated_updates.kahan_read(variable.value, compensation.value)


def carried_weight(source, source_optimizer, target, target_optimizer):
    """Returns a function writing `source`'s value into `target` where
    their forms differ (a compensation on either side), else None: the
    copy holds the weight already."""
    ours = _compensation(source, source_optimizer)
    theirs = _compensation(target, target_optimizer)
    if theirs is not None:
        value = weight_value(source, source_optimizer)
        return lambda: compensated_updates.kahan_write(target, theirs, value)
    if ours is None:
        return None
    if compensated_updates.is_low_precision(target.dtype):
        value = compensated_updates.kahan_fold(source.value, ours.value)
    else:
        value = compensated_updates.kahan_read(source.value, ours.value)
    value = ops.cast(value, target.dtype)
    return lambda: target.assign(value)


def _compensation(variable, optimizer):
    if optimizer is None:
        return None
    parts = unwrapped(optimizer)
    lows = [parts.low_precision]
    for sub in multi_optimizers.sub_optimizers(parts.inner):
        lows.append(unwrapped(sub).low_precision)
    for low in lows:
        found = None if low is None else low.compensation_of(variable)
        if found is not None:
            return found
    return None


def carry(source, target):
    """Gives `target`, a copy of the model `source`, its training state.

    `target` holds `source`'s weights already (`rules_application.rebuild`
    copied them); where either keeps Kahan compensation, the weights are
    written again (the compensation folded in or split out) and, where
    both are compiled and `source`'s optimizer is built, so is the
    optimizer state. Everything is checked before anything is written.

    Args:
        source: The trained `keras.Model`.
        target: Its copy, its optimizer (if any) built.

    Raises:
        ValueError: if the copies differ in weights or optimizer slots.
    """
    pairs = weight_pairs(source, target)
    ours = getattr(source, "optimizer", None)
    theirs = getattr(target, "optimizer", None)
    state = None
    if ours is not None and theirs is not None and is_built(ours):
        state = read_state(ours)
        if not is_built(theirs):
            theirs.build(target.trainable_variables)
    writes = [carried_weight(a, ours, b, theirs) for a, b in pairs]
    if state is not None:
        # Checked here, written below: nothing half-done.
        rename = slot_renamer(pairs)
        check_state(theirs, state, rename)
    for write in writes:
        if write is not None:
            write()
    if state is not None:
        write_state(theirs, state, rename)


def _numpy(value):
    # A copy: JAX may hand out (and later donate) the variable's buffer.
    return np.array(ops.convert_to_numpy(value), copy=True)
