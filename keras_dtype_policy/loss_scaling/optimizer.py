"""`LossScaleOptimizer`: dynamic and fixed loss scaling on every backend."""

import inspect

import keras
import numpy as np
from keras import ops

from keras_dtype_policy.loss_scaling import gradient_check
from keras_dtype_policy.loss_scaling import inner_optimizer_config
from keras_dtype_policy.loss_scaling import lso_arguments
from keras_dtype_policy.loss_scaling import scale_rule
from keras_dtype_policy.loss_scaling import state_arrival
from keras_dtype_policy.loss_scaling import tf_keras_configs
from keras_dtype_policy.loss_scaling import tf_replicas
from keras_dtype_policy.loss_scaling.backend_utils import is_concrete
from keras_dtype_policy.loss_scaling.custom_loop_api import CustomLoopApi
from keras_dtype_policy.loss_scaling.inner_hyperparameters import (
    ForwardsHyperparameters,
)
from keras_dtype_policy.loss_scaling.saved_layouts import SavedLayouts
from keras_dtype_policy.low_precision import tensorflow_step
from keras_dtype_policy.policies.registration import register


@register
class LossScaleOptimizer(
    CustomLoopApi,
    SavedLayouts,
    ForwardsHyperparameters,
    keras.optimizers.LossScaleOptimizer,
):
    """An optimizer that scales the loss to keep float16 gradients alive.

    The loss is multiplied by the scale and the gradients divided by it
    before `inner_optimizer` applies them. A step with a NaN or Inf gradient
    is skipped (weights and inner state unchanged) and counted in
    `skipped_steps`; a dynamic scale then shrinks, and grows after
    `dynamic_growth_steps` finite steps in a row. See docs/loss-scaling.md.

    Args:
        inner_optimizer: The `keras.optimizers.Optimizer` to wrap.
        dynamic: Bool. Whether the scale adapts. Defaults to `True`.
        initial_scale: Float. The first scale. Defaults to `2**15`
            (required with `dynamic=False`).
        dynamic_growth_steps: Int. Finite steps in a row that grow the
            scale. Defaults to `2000` (None with `dynamic=False`).
        growth_factor: Float > 1. The growth factor. Defaults to `2.0`.
        backoff_factor: Float in (0, 1). The shrink factor. Defaults to
            `0.5`.
        min_scale: Float. The floor of a dynamic scale. Defaults to `1.0`.
        max_scale: Float. The ceiling of a dynamic scale. Defaults to
            `2**24`.
        hysteresis: Int. Non-finite steps in a row that shrink the scale.
            Defaults to `1`.
        name: String. The optimizer's name.

    Example:

    >>> optimizer = keras_dtype_policy.LossScaleOptimizer(
    ...     keras.optimizers.Adam(), dynamic=False, initial_scale=1024
    ... )
    >>> optimizer.loss_scale
    1024.0
    """

    def __init__(
        self,
        inner_optimizer,
        dynamic=True,
        initial_scale=None,
        dynamic_growth_steps=None,
        growth_factor=2.0,
        backoff_factor=0.5,
        min_scale=1.0,
        max_scale=2.0**24,
        hysteresis=1,
        name=None,
        **kwargs,
    ):
        settings = lso_arguments.checked(
            inner_optimizer,
            dynamic=dynamic,
            initial_scale=initial_scale,
            dynamic_growth_steps=dynamic_growth_steps,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            min_scale=min_scale,
            max_scale=max_scale,
            hysteresis=hysteresis,
        )
        super().__init__(
            inner_optimizer,
            initial_scale=settings.pop("initial_scale"),
            dynamic_growth_steps=settings.pop("dynamic_growth_steps"),
            name=name,
            **kwargs,
        )
        state_arrival.teach_tf_keras_layout(inner_optimizer)
        self._make_records()
        inner_optimizer._is_wrapped_by_loss_scale_optimizer = True
        self._reset_loop_record()
        for key, value in settings.items():
            setattr(self, key, value)

    def build(self, var_list):
        if state_arrival.defers_build(var_list):
            return
        self._reading_own_settings = True
        try:
            super().build(var_list)
        finally:
            self._reading_own_settings = False
        # Not in Keras' layout: each is saved in a store of its own (see
        # `saved_layouts.RECORD_STORES`).
        count = len(self._trainable_variables)
        for attribute, name, shape in (
            ("_skipped_step_counter", "skipped_steps", ()),
            ("_nonfinite_streak", "nonfinite_steps_in_a_row", ()),
            ("_nonfinite_counts", "nonfinite_gradient_counts", (count,)),
            ("_last_nonfinite_mask", "last_nonfinite_gradients", (count,)),
        ):
            variable = self.add_variable(
                shape=shape,
                dtype="int",
                initializer="zeros",
                aggregation="none",
                name=name,
            )
            setattr(self, attribute, variable)
        self._apply_pending_records()

    @property
    def loss_scale(self):
        """The current loss scale, a Python float that also has `.numpy()`.

        As tf.keras' tensor did, it converts to a tensor with
        `keras.ops.convert_to_tensor`.
        """
        if not self.built:
            return _Reading(self.initial_scale)
        return _Reading(float(self.dynamic_scale.numpy()))

    @property
    def dynamic_counter(self):
        """Finite steps since the scale last changed (or a step was
        skipped), as a Python int; None for a fixed scale, as in tf.keras."""
        if not self.dynamic:
            return None
        if not self.built:
            return 0
        return int(self.step_counter.numpy())

    @property
    def dynamic_growth_steps(self):
        """Finite steps in a row that make the scale grow; None for a fixed
        scale, as in tf.keras."""
        if not self.__dict__.get("dynamic", True):
            return None
        return self._growth_steps

    @dynamic_growth_steps.setter
    def dynamic_growth_steps(self, value):
        self._growth_steps = value

    @property
    def skipped_steps(self):
        """The number of steps skipped for non-finite gradients, as an int."""
        if not self.built:
            return 0
        return int(self._skipped_step_counter.numpy())

    @property
    def nonfinite_steps_in_a_row(self):
        """Steps skipped in a row up to the last one, as an int: 0 after a
        finite step. The scale is lowered once this reaches `hysteresis`."""
        if not self.built:
            return 0
        return int(self._nonfinite_streak.numpy())

    @property
    def nonfinite_gradients(self):
        """The paths of the variables whose gradients were not finite at
        the last skipped step, in the order of the variables; `[]` before
        any step was skipped.

        Example: `['dense_3/kernel', 'dense_3/bias']`.
        """
        if not self.built:
            return []
        mask = keras.ops.convert_to_numpy(self._last_nonfinite_mask)
        return [
            variable.path
            for variable, flagged in zip(
                self._trainable_variables, mask, strict=True
            )
            if flagged
        ]

    @property
    def nonfinite_gradient_counts(self):
        """For each variable whose gradient was ever non-finite at a
        skipped step, its path and the number of such steps, as a dict.

        Counted since the optimizer was built, and saved with its state.
        """
        if not self.built:
            return {}
        counts = keras.ops.convert_to_numpy(self._nonfinite_counts)
        return {
            variable.path: int(count)
            for variable, count in zip(
                self._trainable_variables, counts, strict=True
            )
            if count
        }

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        if not self.built:
            raise ValueError(
                f"To call `stateless_apply`, {type(self).__name__} must be "
                "built. Build it with `optimizer.build(trainable_variables)`."
            )
        grads = self._begin_step(grads)
        try:
            return self._stateless_step(
                optimizer_variables, grads, trainable_variables
            )
        finally:
            self._unscales_this_step = True

    def _stateless_step(self, optimizer_variables, grads, trainable_variables):
        own_count = len(self._variables)
        own_values = list(optimizer_variables[:own_count])
        inner_values = list(optimizer_variables[own_count:])
        position = {id(v): i for i, v in enumerate(self._variables)}
        scale_at = position[id(self.dynamic_scale)]
        counter_at = position[id(self.step_counter)]
        skipped_at = position[id(self._skipped_step_counter)]
        streak_at = position[id(self._nonfinite_streak)]
        counts_at = position[id(self._nonfinite_counts)]
        mask_at = position[id(self._last_nonfinite_mask)]

        finite = self.check_finite(grads)

        def apply_step():
            # Unscaled inside the branch, where XLA fuses the division into
            # the inner optimizer's update.
            unscaled_grads = self._unscale(
                grads, own_values[scale_at], self._trainable_variables
            )
            new_trainables, new_inner = self.inner_optimizer.stateless_apply(
                inner_values, unscaled_grads, trainable_variables
            )
            return (
                list(new_trainables),
                list(new_inner),
                own_values[counts_at],
                own_values[mask_at],
            )

        def skip_step():
            # The only place the gradients are checked one by one.
            mask = self._nonfinite_mask(grads)
            return (
                list(trainable_variables),
                list(inner_values),
                ops.add(own_values[counts_at], mask),
                mask,
            )

        (
            new_trainables,
            new_inner_values,
            own_values[counts_at],
            own_values[mask_at],
        ) = ops.cond(finite, apply_step, skip_step)
        (
            own_values[scale_at],
            own_values[counter_at],
            own_values[streak_at],
        ) = self._next_scale_state(
            own_values[scale_at],
            own_values[counter_at],
            own_values[streak_at],
            finite,
        )
        skipped = ops.convert_to_tensor(own_values[skipped_at])
        own_values[skipped_at] = ops.where(
            finite, skipped, ops.add(skipped, ops.ones_like(skipped))
        )
        return list(new_trainables), own_values + list(new_inner_values)

    def _nonfinite_mask(self, grads, trainable_variables=None):
        """An int vector, one entry per variable the optimizer was built
        with: 1 where its gradient among `grads` holds a NaN or Inf."""
        flags = gradient_check.nonfinite_flags(grads)
        if trainable_variables is None:
            by_index = flags
        else:
            by_index = [None] * len(self._trainable_variables)
            for variable, flag in zip(trainable_variables, flags, strict=True):
                by_index[self._get_variable_index(variable)] = flag
        dtype = self._nonfinite_counts.dtype
        zero = ops.zeros((), dtype=dtype)
        entries = [zero if f is None else ops.cast(f, dtype) for f in by_index]
        if not entries:
            return ops.zeros((0,), dtype=dtype)
        return ops.stack(entries)

    def _tf_apply(self, grads, trainable_variables=None):
        if tf_replicas.outside_strategies() and not (
            tensorflow_step.has_sparse(grads)
        ):
            # One XLA computation: the check, the unscale, the inner step
            # and the scale's update (Keras runs TensorFlow op by op on a
            # CPU).
            tensorflow_step.compiled_apply(
                self,
                grads,
                trainable_variables or self._trainable_variables,
                step=self._common_apply,
            )
            return
        # Under tf.distribute, all replicas agree on skipping a step.
        tf_replicas.apply(self, grads, trainable_variables)

    def check_finite(self, grads):
        """Returns a boolean scalar tensor: True if all `grads` are finite.

        One fused check over all gradients (see `gradient_check`).
        """
        return gradient_check.all_finite(grads)

    def _common_apply(self, grads, trainable_variables=None, finite=None):
        if (
            finite is None
            and keras.backend.backend() == "torch"
            and not self._skips_unscaling()
        ):
            # One fused kernel checks and unscales every gradient (in copies:
            # the caller's gradients are left as they are).
            variables = trainable_variables or self._trainable_variables
            finite, unscaled = gradient_check.check_and_unscale(
                grads, self.dynamic_scale, self._kept(variables)
            )
            if bool(finite):
                self.inner_optimizer.apply(
                    unscaled, trainable_variables=trainable_variables
                )
                self._count_finite_step()
            else:
                # Unscaled, a NaN or Inf stays one: the attribution holds.
                self._stateful_handle_non_finite_grads(
                    unscaled, trainable_variables
                )
            return
        if finite is None:
            finite = self.check_finite(grads)
        if not is_concrete(finite):
            ops.cond(
                finite,
                lambda: self._stateful_handle_finite_grads(
                    grads, trainable_variables
                ),
                lambda: self._stateful_handle_non_finite_grads(
                    grads, trainable_variables
                ),
            )
        elif bool(finite):
            self._stateful_handle_finite_grads(grads, trainable_variables)
        else:
            self._stateful_handle_non_finite_grads(grads, trainable_variables)

    def _stateful_handle_finite_grads(self, grads, trainable_variables):
        unscaled_grads = self._unscale(
            grads,
            self.dynamic_scale,
            trainable_variables or self._trainable_variables,
        )
        self.inner_optimizer.apply(
            unscaled_grads, trainable_variables=trainable_variables
        )
        self._count_finite_step()

    def _stateful_handle_non_finite_grads(
        self, grads=None, trainable_variables=None
    ):
        # Skip the step, move the scale, and record which gradients were
        # not finite (unless called without them, as `tf_replicas` does
        # across replicas).
        self._take_scale_step(False)
        self._skipped_step_counter.assign_add(1)
        if grads is not None:
            mask = self._nonfinite_mask(grads, trainable_variables)
            self._nonfinite_counts.assign_add(mask)
            self._last_nonfinite_mask.assign(mask)

    def _count_finite_step(self):
        self._take_scale_step(True)

    def _take_scale_step(self, finite):
        scale, counter, streak = self._next_scale_state(
            self.dynamic_scale,
            self.step_counter,
            self._nonfinite_streak,
            finite,
        )
        if self.dynamic:
            self.dynamic_scale.assign(scale)
        self.step_counter.assign(counter)
        self._nonfinite_streak.assign(streak)

    def _next_scale_state(self, scale, counter, streak, finite):
        """The `(scale, counter, streak)` after one step (see
        `scale_rule.next_scale_state`)."""
        return scale_rule.next_scale_state(
            scale,
            counter,
            streak,
            finite,
            dynamic=self.dynamic,
            growth_steps=self.dynamic_growth_steps,
            hysteresis=self.hysteresis,
            growth_factor=self.growth_factor,
            backoff_factor=self.backoff_factor,
            min_scale=self.min_scale,
            max_scale=self.max_scale,
        )

    def _unscale(self, grads, scale, variables):
        if self._skips_unscaling():
            return [_as_tensor(g) for g in grads]
        return gradient_check.unscale(grads, scale, self._kept(variables))

    def _skips_unscaling(self):
        # A step whose loss was never scaled (see `_begin_step`), or a fixed
        # scale of 1 (a wrapper on a step that needs no scaling): nothing to
        # divide.
        if not self._unscales_this_step:
            return True
        return not self.dynamic and self.initial_scale == 1.0

    def _kept(self, variables):
        # The gradients Keras never unscales: those that overwrite their
        # variable.
        return [self._overwrite_variable_with_gradient(v) for v in variables]

    def get_config(self):
        """Returns Keras' four keys, and each setting of ours not default.

        With the defaults, the config is exactly the one Keras' own
        `LossScaleOptimizer` writes: `name`, `inner_optimizer`,
        `initial_scale` and `dynamic_growth_steps`.
        """
        config = super().get_config()
        config["dynamic_growth_steps"] = self._growth_steps
        for key, default in _EXTRA_DEFAULTS.items():
            value = getattr(self, key)
            if value != default:
                config[key] = value
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """Builds the optimizer from its config, or from a tf.keras 2 one.

        Args:
            config: The output of `get_config`, or the config of a tf.keras 2
                `LossScaleOptimizer`: `inner_optimizer`, `dynamic`,
                `initial_scale` and `dynamic_growth_steps`.
            custom_objects: Optional custom objects for the inner optimizer.

        Returns:
            A `LossScaleOptimizer`.
        """
        config = tf_keras_configs.from_tf_2_3(config)
        if not config.get("dynamic", True):
            # tf.keras 2 saved None here for a fixed scale, Keras a number.
            config.pop("dynamic_growth_steps", None)
        inner_optimizer = inner_optimizer_config.deserialize_optimizer(
            config.pop("inner_optimizer", None), custom_objects=custom_objects
        )
        return cls(inner_optimizer, **config)


# Names the wrapper sets on itself (its settings, its variables), never
# passed to the inner optimizer even if it has a setting of the same name.
LossScaleOptimizer._wrapper_names = frozenset(
    (
        *inspect.signature(LossScaleOptimizer).parameters,
        "step_counter",
        "dynamic_scale",
    )
)


# The settings Keras' own LossScaleOptimizer lacks, with their defaults.
_EXTRA_DEFAULTS = {
    name: inspect.signature(LossScaleOptimizer).parameters[name].default
    for name in (
        "dynamic",
        "growth_factor",
        "backoff_factor",
        "min_scale",
        "max_scale",
        "hysteresis",
    )
}


def release_inner_optimizer(optimizer):
    """Lets `optimizer` be wrapped again, as `Model.compile` does.

    tf.keras refused to wrap one optimizer twice; Keras' compile wraps a
    model's optimizer anew at each `compile`, and so does this package's.
    """
    optimizer.__dict__.pop("_is_wrapped_by_loss_scale_optimizer", None)


class _Reading(float):
    """A Python float that also answers `.numpy()`, as a tensor would."""

    def numpy(self):
        return np.float32(self)


def _as_tensor(value):
    """`value` as a tensor, as unscaling would give it; None and sparse
    values stay as they are."""
    if value is None or type(value).__name__ == "IndexedSlices":
        return value
    return ops.convert_to_tensor(value)
