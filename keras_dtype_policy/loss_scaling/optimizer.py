"""`LossScaleOptimizer`: dynamic and fixed loss scaling on every backend."""

import inspect
from typing import Any
from typing import NamedTuple

import keras
import numpy as np
from keras import ops

from keras_dtype_policy import backend_dispatch
from keras_dtype_policy import unconverted
from keras_dtype_policy.loss_scaling import gradient_check
from keras_dtype_policy.loss_scaling import inner_optimizer_config
from keras_dtype_policy.loss_scaling import lso_arguments
from keras_dtype_policy.loss_scaling import scale_rule
from keras_dtype_policy.loss_scaling import state_arrival
from keras_dtype_policy.loss_scaling import tf_keras_configs
from keras_dtype_policy.loss_scaling import tf_replicas
from keras_dtype_policy.loss_scaling.backend_utils import is_concrete
from keras_dtype_policy.loss_scaling.backend_utils import is_indexed_slices
from keras_dtype_policy.loss_scaling.custom_loop_api import CustomLoopApi
from keras_dtype_policy.loss_scaling.inner_hyperparameters import (
    ForwardsHyperparameters,
)
from keras_dtype_policy.loss_scaling.saved_layouts import SavedLayouts
from keras_dtype_policy.low_precision.step_targets import StepCache
from keras_dtype_policy.policies.registration import register
from keras_dtype_policy.types import Tensor


@register
@unconverted.leave_unconverted
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
        name: String. The optimizer's name. Defaults to
            `"loss_scale_optimizer"` (Keras' numbers each new one).

    Example:

    >>> optimizer = keras_dtype_policy.LossScaleOptimizer(
    ...     keras.optimizers.Adam(), dynamic=False, initial_scale=1024
    ... )
    >>> optimizer.loss_scale
    1024.0
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        dynamic: bool = True,
        initial_scale: float | None = None,
        dynamic_growth_steps: int | None = None,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        hysteresis: int = 1,
        name: str | None = None,
        **kwargs: Any,
    ) -> None:
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
            initial_scale=settings.initial_scale,
            dynamic_growth_steps=settings.dynamic_growth_steps,
            # Not numbered per process: Orbax restores the state by its
            # paths, which start with the name.
            name=name or "loss_scale_optimizer",
            **kwargs,
        )
        state_arrival.teach_tf_keras_layout(inner_optimizer)
        self._make_records()
        # The TensorFlow step compiled once (`_tf_apply`), out of tracking.
        self._step_cache = StepCache()
        inner_optimizer._is_wrapped_by_loss_scale_optimizer = True
        for key in _EXTRA_DEFAULTS:
            setattr(self, key, getattr(settings, key))

    def build(self, var_list: list) -> None:
        # Built already (a user's `build` after `load_model`): Keras'
        # wrapper would add its counters again, fresh, in front of the
        # loaded ones.
        if self.built or state_arrival.defers_build(var_list):
            return
        self._reading_own_settings = True
        try:
            super().build(var_list)
        finally:
            self._reading_own_settings = False
        # Keras' own wrapper lacks these: see `saved_layouts.RECORD_STORES`.
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
    def loss_scale(self) -> float:
        """The current loss scale, a Python float that also has `.numpy()`
        (and converts to a tensor, as tf.keras' tensor did)."""
        scale = self.dynamic_scale.numpy() if self.built else self.initial_scale
        return _Reading(float(scale))

    @property
    def dynamic_counter(self) -> int | None:
        """Finite steps since the scale last changed (or a step was
        skipped), as an int; None for a fixed scale, as in tf.keras."""
        if not self.dynamic:
            return None
        return int(self.step_counter.numpy()) if self.built else 0

    @property
    def dynamic_growth_steps(self) -> int | None:
        """Finite steps in a row that make the scale grow; None for a fixed
        scale, as in tf.keras."""
        if not self.__dict__.get("dynamic", True):
            return None
        return self._growth_steps

    @dynamic_growth_steps.setter
    def dynamic_growth_steps(self, value):
        self._growth_steps = value

    @property
    def skipped_steps(self) -> int:
        """The number of steps skipped for non-finite gradients, as an int."""
        return int(self._skipped_step_counter.numpy()) if self.built else 0

    @property
    def nonfinite_steps_in_a_row(self) -> int:
        """Steps skipped in a row up to the last one (0 after a finite
        step), as an int; the scale shrinks once it reaches `hysteresis`."""
        return int(self._nonfinite_streak.numpy()) if self.built else 0

    @property
    def nonfinite_gradients(self) -> list[str]:
        """The paths of the variables whose gradients were not finite at
        the last skipped step (`[]` before any), such as
        `['dense_3/kernel', 'dense_3/bias']`."""
        return list(self._nonzero_by_path("_last_nonfinite_mask"))

    @property
    def nonfinite_gradient_counts(self) -> dict[str, int]:
        """For each variable whose gradient was ever non-finite at a
        skipped step, its path and the number of such steps (saved with
        the optimizer's state)."""
        return self._nonzero_by_path("_nonfinite_counts")

    def _nonzero_by_path(self, name):
        # `{path: entry}` for each trainable variable whose entry in the int
        # vector at attribute `name` is not 0; `{}` before the build.
        if not self.built:
            return {}
        entries = keras.ops.convert_to_numpy(getattr(self, name))
        return {
            variable.path: int(entry)
            for variable, entry in zip(
                self._trainable_variables, entries, strict=True
            )
            if entry
        }

    def stateless_apply(
        self,
        optimizer_variables: list[Tensor],
        grads: list[Tensor],
        trainable_variables: list[Tensor],
    ) -> tuple[list[Tensor], list[Tensor]]:
        if not self.built:
            raise ValueError(
                f"To call `stateless_apply`, {type(self).__name__} must be "
                "built. Build it with `optimizer.build(trainable_variables)`."
            )
        grads = self._begin_step(grads)
        # As in Keras' own wrapper: in the scope every variable reads its
        # given value, and what the step assigns is read back from it.
        mapping = list(zip(self.variables, optimizer_variables, strict=True))
        try:
            with keras.StatelessScope(state_mapping=mapping) as scope:
                inner = [
                    scope.get_current_value(v)
                    for v in self.inner_optimizer.variables
                ]
                finite = self.check_finite(grads)
                outcome = ops.cond(
                    finite,
                    lambda: self._stateless_apply_branch(
                        grads, inner, trainable_variables
                    ),
                    lambda: self._stateless_skip_branch(
                        grads, inner, trainable_variables
                    ),
                )
                self._nonfinite_counts.assign(outcome.nonfinite_counts)
                self._last_nonfinite_mask.assign(outcome.last_nonfinite_mask)
                self._take_scale_step(finite)
                skipped = ops.convert_to_tensor(self._skipped_step_counter)
                self._skipped_step_counter.assign(
                    ops.where(finite, skipped, ops.add(skipped, 1))
                )
        finally:
            self._unscales_this_step = True
        own_values = [scope.get_current_value(v) for v in self._variables]
        return list(outcome.trainables), own_values + list(outcome.inner)

    def _stateless_apply_branch(self, grads, inner_values, trainables):
        # Unscaled inside the branch, where XLA fuses the multiply into the
        # inner optimizer's update.
        unscaled = self._unscale(grads, self._trainable_variables)
        new_trainables, new_inner = self.inner_optimizer.stateless_apply(
            inner_values, unscaled, trainables
        )
        return _StatelessOutcome(
            trainables=list(new_trainables),
            inner=list(new_inner),
            nonfinite_counts=ops.convert_to_tensor(self._nonfinite_counts),
            last_nonfinite_mask=ops.convert_to_tensor(
                self._last_nonfinite_mask
            ),
        )

    def _stateless_skip_branch(self, grads, inner_values, trainables):
        # The only place the gradients are checked one by one.
        mask = self._nonfinite_mask(grads)
        return _StatelessOutcome(
            trainables=list(trainables),
            inner=list(inner_values),
            nonfinite_counts=ops.add(self._nonfinite_counts, mask),
            last_nonfinite_mask=mask,
        )

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
        step = backend_dispatch.module_for("low_precision_step")
        if tf_replicas.outside_strategies() and not step.has_sparse(grads):
            variables = trainable_variables or self._trainable_variables
            if self._inner_steps_in_groups(step, variables):
                # The inner step's groups bound its memory; the check and
                # the scale's update run around them.
                self._common_apply(grads, trainable_variables)
                return
            if not step.compiles_whole_step(variables):
                # Op by op, as Keras' own wrapper: compiling a step of
                # this many variables would cost more memory than it saves
                # time.
                self._common_apply(grads, trainable_variables)
                return
            # One XLA computation for the whole step (Keras runs TensorFlow
            # op by op on a CPU).
            step.compiled_apply(self, grads, variables, step=self._common_apply)
            return
        # Under tf.distribute, all replicas agree on skipping a step.
        tf_replicas.apply(self, grads, trainable_variables)

    def _inner_steps_in_groups(self, step, variables):
        """True where the inner optimizer (a `LowPrecisionOptimizer`) runs
        its TensorFlow step group by group over `variables`."""
        grouped = getattr(self.inner_optimizer, "_step_cache", None)
        return grouped is not None and step.in_groups(variables)

    def check_finite(self, grads: list[Tensor | None]) -> Tensor:
        """Returns a boolean scalar tensor: True if all `grads` are finite
        (one fused check, see `gradient_check`)."""
        return gradient_check.all_finite(grads)

    def _common_apply(self, grads, trainable_variables=None, finite=None):
        if finite is None:
            if backend_dispatch.is_torch() and not self._skips_unscaling():
                self._fused_apply(grads, trainable_variables)
                return
            finite = self.check_finite(grads)
        args = (grads, trainable_variables)
        apply_step = self._stateful_handle_finite_grads
        skip_step = self._stateful_handle_non_finite_grads
        if is_concrete(finite):
            (apply_step if bool(finite) else skip_step)(*args)
        else:
            ops.cond(
                finite, lambda: apply_step(*args), lambda: skip_step(*args)
            )

    def _fused_apply(self, grads, trainable_variables):
        # One fused kernel checks and unscales every gradient, in copies.
        variables = trainable_variables or self._trainable_variables
        checked = gradient_check.check_and_unscale(
            grads, self.dynamic_scale, self._kept(variables)
        )
        if bool(checked.finite):
            self._apply_unscaled(checked.grads, trainable_variables)
        else:
            # Unscaled, a NaN or Inf stays one: the attribution holds.
            self._stateful_handle_non_finite_grads(
                checked.grads, trainable_variables
            )

    def _stateful_handle_finite_grads(self, grads, trainable_variables):
        variables = trainable_variables or self._trainable_variables
        unscaled = self._unscale(grads, variables)
        self._apply_unscaled(unscaled, trainable_variables)

    def _apply_unscaled(self, grads, trainable_variables):
        self.inner_optimizer.apply(
            grads, trainable_variables=trainable_variables
        )
        self._take_scale_step(True)

    def _stateful_handle_non_finite_grads(
        self, grads=None, trainable_variables=None
    ):
        # `tf_replicas` calls it without gradients, across replicas.
        self._take_scale_step(False)
        self._skipped_step_counter.assign_add(1)
        if grads is not None:
            mask = self._nonfinite_mask(grads, trainable_variables)
            self._nonfinite_counts.assign_add(mask)
            self._last_nonfinite_mask.assign(mask)

    def _take_scale_step(self, finite):
        """Assigns the scale, its counter and the streak after one step."""
        rule = scale_rule.ScaleRule(
            growth_steps=self.dynamic_growth_steps,
            **{key: getattr(self, key) for key in _EXTRA_DEFAULTS},
        )
        old = scale_rule.ScaleState(
            self.dynamic_scale, self.step_counter, self._nonfinite_streak
        )
        state = rule.next_state(old, finite)
        if self.dynamic:
            self.dynamic_scale.assign(state.scale)
        self.step_counter.assign(state.counter)
        self._nonfinite_streak.assign(state.streak)

    def _unscale(self, grads, variables):
        if not self._skips_unscaling():
            kept = self._kept(variables)
            return gradient_check.unscale(grads, self.dynamic_scale, kept)
        # As unscaling would give them: tensors (None and sparse as is).
        return [
            g if g is None or is_indexed_slices(g) else ops.convert_to_tensor(g)
            for g in grads
        ]

    def _skips_unscaling(self):
        # A step whose loss was never scaled (see `_begin_step`), or a fixed
        # scale of 1: nothing to divide.
        if not self._unscales_this_step:
            return True
        return not self.dynamic and self.initial_scale == 1.0

    def _kept(self, variables):
        # Keras never unscales the gradients that overwrite their variable.
        return [self._overwrite_variable_with_gradient(v) for v in variables]

    def get_config(self) -> dict[str, Any]:
        """Returns Keras' four keys, and each setting of ours not default
        (with the defaults, exactly the config of Keras' own wrapper)."""
        config = super().get_config()
        config["dynamic_growth_steps"] = self._growth_steps
        for key, default in _EXTRA_DEFAULTS.items():
            value = getattr(self, key)
            if value != default:
                config[key] = value
        return config

    @classmethod
    def from_config(
        cls,
        config: dict[str, Any],
        custom_objects: dict[str, Any] | None = None,
    ) -> "LossScaleOptimizer":
        """Builds the optimizer from its config, or from a tf.keras 2 one."""
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
    inspect.signature(LossScaleOptimizer).parameters
).union(("step_counter", "dynamic_scale"))


# The settings Keras' own LossScaleOptimizer lacks, with their defaults
# (named as the fields of `scale_rule.ScaleRule`).
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
    """Lets `optimizer` be wrapped again, as `Model.compile` does anew at
    each `compile` (tf.keras refused to wrap one optimizer twice)."""
    optimizer.__dict__.pop("_is_wrapped_by_loss_scale_optimizer", None)


class _Reading(float):
    """A Python float that also answers `.numpy()`, as a tensor would."""

    def numpy(self):
        return np.float32(self)


class _StatelessOutcome(NamedTuple):
    """What either branch of the stateless step gives back: the new values
    of the trainable variables, of the inner optimizer's variables, and of
    the two non-finite records."""

    trainables: list
    inner: list
    nonfinite_counts: object
    last_nonfinite_mask: object
