"""`LossScaleOptimizer`: dynamic and fixed loss scaling on every backend."""

import inspect
import warnings

import keras
import numpy as np
from keras import ops

from keras_dtype_policy.loss_scaling import gradient_check
from keras_dtype_policy.loss_scaling import inner_hyperparameters
from keras_dtype_policy.loss_scaling import inner_optimizer_config
from keras_dtype_policy.loss_scaling import loss_gradients
from keras_dtype_policy.loss_scaling import optimizer_state
from keras_dtype_policy.loss_scaling import tf_keras_configs
from keras_dtype_policy.loss_scaling import tf_replicas
from keras_dtype_policy.loss_scaling.backend_utils import is_concrete
from keras_dtype_policy.policies.registration import register
from keras_dtype_policy.policies.validation import check_positive_int
from keras_dtype_policy.policies.validation import check_positive_number


class _InnerSetting:
    """A setting of Keras' base optimizer that the wrapper keeps on its
    inner optimizer (`clipnorm`, `use_ema`, ...), so that reading or setting
    it through the wrapper reaches the optimizer that applies the step."""

    def __set_name__(self, owner, name):
        self.name = name
        self.own_name = f"_own_{name}"

    def __get__(self, wrapper, owner=None):
        if wrapper is None:
            return self
        inner = wrapper._settings_owner()
        if inner is None:
            return wrapper.__dict__.get(self.own_name)
        return getattr(inner, self.name)

    def __set__(self, wrapper, value):
        inner = wrapper._settings_owner()
        if inner is None:
            wrapper.__dict__[self.own_name] = value
        else:
            setattr(inner, self.name, value)


@register
class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """An optimizer that scales the loss to keep float16 gradients alive.

    The trainer multiplies the loss by the current scale (`scale_loss`), so
    small float16 gradients do not flush to zero; this optimizer divides the
    gradients by the same scale before its inner optimizer applies them.

    A step whose gradients hold any NaN or Inf is skipped in both modes: the
    weights and the inner optimizer's state (iterations, moments) stay as
    they were, and `skipped_steps` counts it. In dynamic mode the scale also
    follows this rule:

    - a skipped step restarts the count of finite steps; the
      `hysteresis`-th skipped step in a row, and each one after it until a
      step is finite again, multiplies the scale by `backoff_factor`, but
      not below `min_scale` (with the default `hysteresis=1`, every
      skipped step does);
    - after `dynamic_growth_steps` finite steps in a row, the scale is
      multiplied by `growth_factor`, but not above `max_scale`.

    With `dynamic=False` the scale stays at `initial_scale`, as in tf.keras
    2. With the default arguments, this reproduces
    `keras.optimizers.LossScaleOptimizer` step for step while the scale
    stays within `[min_scale, max_scale]`.

    The scale, the count of finite steps since the last change, the
    number of skipped steps and the number of skipped steps in a row are
    optimizer variables: they are saved with the model and restored
    exactly.

    A skipped step also records which variables' gradients were not finite
    (`nonfinite_gradients`, `nonfinite_gradient_counts`). That check runs
    only on the skipped step's branch of the step: a finite step costs the
    one fused check over all gradients, as before.

    Args:
        inner_optimizer: The `keras.optimizers.Optimizer` to wrap.
        dynamic: Whether the scale adapts to the gradients. Defaults to
            `True`.
        initial_scale: The first scale, a finite number greater than zero.
            Defaults to `2**15` for a dynamic scale; required with
            `dynamic=False`, as in tf.keras 2.
        dynamic_growth_steps: How many finite steps in a row make the scale
            grow, at least 1. Defaults to `2000`; must be None with
            `dynamic=False`, as in tf.keras 2.
        growth_factor: The factor the scale grows by, greater than 1.
            Defaults to `2.0`.
        backoff_factor: The factor the scale shrinks by after a non-finite
            step, between 0 and 1. Defaults to `0.5`.
        min_scale: The floor of a dynamic scale. Defaults to `1.0`, as in
            tf.keras 2 (Keras 3 has no floor).
        max_scale: The ceiling of a dynamic scale, which keeps it finite.
            Defaults to `2**24`.
        hysteresis: How many non-finite steps in a row it takes to lower a
            dynamic scale, at least 1; every step with a non-finite
            gradient is skipped all the same. DeepSpeed's `hysteresis` with
            `consecutive_hysteresis=True`: a finite step restarts the
            count. Defaults to `1` (every skipped step lowers the scale).
        name: The optimizer's name.

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
        _check_inner_optimizer(inner_optimizer)
        if not isinstance(dynamic, bool):
            # tf.keras' wording first.
            raise TypeError(
                '"dynamic" argument to LossScaleOptimizer.__init__ must be '
                f"a bool, but got: {dynamic!r}. "
                f"Received: dynamic={dynamic!r} "
                f"(of type {type(dynamic).__name__})"
            )
        initial_scale, dynamic_growth_steps = _scale_arguments(
            dynamic, initial_scale, dynamic_growth_steps
        )
        initial_scale = check_positive_number("initial_scale", initial_scale)
        dynamic_growth_steps = check_positive_int(
            "dynamic_growth_steps", dynamic_growth_steps
        )
        growth_factor = check_positive_number("growth_factor", growth_factor)
        if growth_factor <= 1.0:
            raise ValueError(
                "`growth_factor` must be greater than 1. "
                f"Received: growth_factor={growth_factor!r}"
            )
        backoff_factor = check_positive_number("backoff_factor", backoff_factor)
        if backoff_factor >= 1.0:
            raise ValueError(
                "`backoff_factor` must be between 0 and 1. "
                f"Received: backoff_factor={backoff_factor!r}"
            )
        min_scale = check_positive_number("min_scale", min_scale)
        max_scale = check_positive_number("max_scale", max_scale)
        hysteresis = check_positive_int("hysteresis", hysteresis)
        if dynamic and not min_scale <= initial_scale <= max_scale:
            raise ValueError(
                "A dynamic scale needs min_scale <= initial_scale <= "
                f"max_scale. Received: min_scale={min_scale!r}, "
                f"initial_scale={initial_scale!r}, max_scale={max_scale!r}"
            )
        super().__init__(
            inner_optimizer,
            initial_scale=initial_scale,
            dynamic_growth_steps=dynamic_growth_steps,
            name=name,
            **kwargs,
        )
        optimizer_state.teach_tf_keras_layout(inner_optimizer)
        # Saved beside this optimizer's own store, which keeps Keras' layout.
        self.skipped_steps_record = optimizer_state.SavedCounter(
            self._read_skipped_steps, self._write_skipped_steps
        )
        # The state Keras' own optimizer lacks, each in a store of its own.
        self._pending_extras = {}
        self.nonfinite_streak_record = self._saved("nonfinite_streak")
        self.nonfinite_counts_record = self._saved("nonfinite_counts")
        self.last_nonfinite_record = self._saved("last_nonfinite_mask")
        inner_optimizer._is_wrapped_by_loss_scale_optimizer = True
        # What the loop did since the last step (see `_begin_step`).
        self._loss_scaled_by = None
        self._grads_come_unscaled = False
        self._unscales_this_step = True
        self.dynamic = dynamic
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.min_scale = min_scale
        self.max_scale = max_scale
        self.hysteresis = hysteresis

    def build(self, var_list):
        if optimizer_state.defers_build(var_list):
            return
        self._reading_own_settings = True
        try:
            super().build(var_list)
        finally:
            self._reading_own_settings = False
        self.skipped_step_counter = self.add_variable(
            shape=(),
            dtype="int",
            initializer="zeros",
            aggregation="none",
            name="skipped_steps",
        )
        # Not in Keras' layout (see `_keras_layout`): each is saved in a
        # store of its own (see `_saved`).
        self.nonfinite_streak = self.add_variable(
            shape=(),
            dtype="int",
            initializer="zeros",
            aggregation="none",
            name="nonfinite_steps_in_a_row",
        )
        count = len(self._trainable_variables)
        self.nonfinite_counts = self.add_variable(
            shape=(count,),
            dtype="int",
            initializer="zeros",
            aggregation="none",
            name="nonfinite_gradient_counts",
        )
        self.last_nonfinite_mask = self.add_variable(
            shape=(count,),
            dtype="int",
            initializer="zeros",
            aggregation="none",
            name="last_nonfinite_gradients",
        )
        optimizer_state.apply_pending_values(self, self)
        pending_skipped = getattr(self, "_pending_skipped_steps", None)
        if pending_skipped is not None:
            self._pending_skipped_steps = None
            with optimizer_state.outside_tracing():
                self.skipped_step_counter.assign(pending_skipped)
        pending, self._pending_extras = self._pending_extras, {}
        for name, value in pending.items():
            with optimizer_state.outside_tracing():
                self._write_extra(name, value)

    def save_own_variables(self, store):
        """Saves the state in the layout of Keras' own `LossScaleOptimizer`.

        That is every variable but the count of skipped steps, which goes
        to the store of `skipped_steps_record`, so Keras alone can load it.
        """
        for i, variable in enumerate(self._keras_layout()):
            store[str(i)] = variable.numpy()

    def load_own_variables(self, store):
        """Loads this optimizer's state, from any layout it was saved in.

        Accepted: the layout `save_own_variables` writes, which is that of
        Keras' own `LossScaleOptimizer` (the skipped-step count, if saved,
        comes from its own store); all variables, as earlier releases
        saved them; the inner optimizer's state alone (Keras 3 or tf.keras 2
        layout), after which the scale starts from `initial_scale`. An
        optimizer not built yet keeps the values until it is. Values that
        fit none of these layouts (another optimizer's, another model's)
        are skipped with Keras' warning, and nothing is assigned.
        """
        values = optimizer_state.store_values(store)
        if not values:
            super().load_own_variables(store)
        elif not self.built:
            self._keep_pending_values(values)
        elif not self._assign_saved(values):
            optimizer_state.warn_mismatch(self, values)

    def set_weights(self, weights):
        """Sets the optimizer's values, in any layout `load_own_variables`
        accepts.

        Raises:
            ValueError: (an `OptimizerStateMismatch`) if `weights` fit none
                of them; nothing is assigned then.
        """
        weights = list(weights)
        if not self.built:
            self._keep_pending_values(weights)
        elif not self._assign_saved(weights):
            raise optimizer_state.mismatch(self, weights)

    def _keep_pending_values(self, values):
        """Keeps values for the build; sets the inner step count now."""
        step = _saved_inner_step(values)
        at_once = []
        if step is not None:
            at_once = [(self.inner_optimizer.iterations, step)]
        optimizer_state.keep_pending_values(self, values, set_at_once=at_once)

    def _keras_layout(self):
        """This optimizer's variables but those Keras' own lacks."""
        extra = self._extra_variables()
        return [v for v in self.variables if not _is_among(v, extra)]

    def _earlier_layout(self):
        """The variables earlier releases saved: Keras' and the
        skipped-step count."""
        extra = self._extra_variables()[1:]
        return [v for v in self.variables if not _is_among(v, extra)]

    def _extra_variables(self):
        """The variables Keras' own `LossScaleOptimizer` lacks, the
        skipped-step count first."""
        names = (
            "skipped_step_counter",
            "nonfinite_streak",
            "nonfinite_counts",
            "last_nonfinite_mask",
        )
        found = (getattr(self, name, None) for name in names)
        return [v for v in found if v is not None]

    def _assign_saved(self, values):
        """Assigns `values` if they fit a layout; returns whether they did.

        The layouts: all variables (as Keras' legacy .h5 format saves
        them), those of earlier releases (Keras' and the skipped-step
        count), Keras' (all but the state its own wrapper lacks), then the
        inner optimizer's own (see
        `optimizer_state.assign_optimizer_values`). Shapes, kinds of dtype
        and, where saved, names are checked before anything is assigned.
        """
        names = optimizer_state.saved_names(values)
        values = [np.asarray(v) for v in values]
        roles = dict(
            zip(
                map(id, self.variables),
                optimizer_state.roles(self),
                strict=True,
            )
        )
        layouts = [
            (targets, [roles[id(v)] for v in targets])
            for targets in (
                self.variables,
                self._earlier_layout(),
                self._keras_layout(),
            )
        ]
        for targets, target_roles in layouts:
            if optimizer_state.fits(targets, values, names, target_roles):
                for variable, value in zip(targets, values, strict=True):
                    variable.assign(value)
                return True
        if names is not None:
            values = [
                optimizer_state.named(v, n)
                for v, n in zip(values, names, strict=True)
            ]
        return optimizer_state.assign_optimizer_values(
            self.inner_optimizer, values
        )

    def _read_skipped_steps(self):
        if not self.built:
            return None
        return self.skipped_step_counter.numpy()

    def _write_skipped_steps(self, value):
        if self.built:
            self.skipped_step_counter.assign(value)
        else:
            self._pending_skipped_steps = value

    def _saved(self, name):
        """A `SavedCounter` for the variable at attribute `name`."""

        def read():
            if not self.built:
                return None
            return keras.ops.convert_to_numpy(getattr(self, name))

        def write(value):
            if self.built:
                self._write_extra(name, value)
            else:
                self._pending_extras[name] = value

        return optimizer_state.SavedCounter(read, write)

    def _write_extra(self, name, value):
        # A count per variable saved for another model's variables does
        # not fit: it is left out, and the counts start from zero.
        variable = getattr(self, name)
        if tuple(np.shape(value)) == tuple(variable.shape):
            variable.assign(value)

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
        return int(self.skipped_step_counter.numpy())

    @property
    def nonfinite_steps_in_a_row(self):
        """Steps skipped in a row up to the last one, as an int: 0 after a
        finite step. The scale is lowered once this reaches `hysteresis`."""
        if not self.built:
            return 0
        return int(self.nonfinite_streak.numpy())

    @property
    def nonfinite_gradients(self):
        """The paths of the variables whose gradients were not finite at
        the last skipped step, in the order of the variables; `[]` before
        any step was skipped.

        Example: `['dense_3/kernel', 'dense_3/bias']`.
        """
        if not self.built:
            return []
        mask = keras.ops.convert_to_numpy(self.last_nonfinite_mask)
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
        counts = keras.ops.convert_to_numpy(self.nonfinite_counts)
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
        skipped_at = position[id(self.skipped_step_counter)]
        streak_at = position[id(self.nonfinite_streak)]
        counts_at = position[id(self.nonfinite_counts)]
        mask_at = position[id(self.last_nonfinite_mask)]

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
            own_values[skipped_at],
            own_values[streak_at],
        ) = self._next_state(
            own_values[scale_at],
            own_values[counter_at],
            own_values[skipped_at],
            finite,
            own_values[streak_at],
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
        dtype = self.nonfinite_counts.dtype
        zero = ops.zeros((), dtype=dtype)
        entries = [zero if f is None else ops.cast(f, dtype) for f in by_index]
        if not entries:
            return ops.zeros((0,), dtype=dtype)
        return ops.stack(entries)

    def _tf_apply(self, grads, trainable_variables=None):
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
            # One fused kernel checks and unscales (in place) every gradient.
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
                # In place, a NaN or Inf stays one: the attribution holds.
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
        # Skip the step: shrink a dynamic scale (at the `hysteresis`-th
        # skipped step in a row), restart the count, and record which
        # gradients were not finite (unless called without them, as
        # `tf_replicas` does across replicas).
        streak = ops.add(self.nonfinite_streak, 1)
        if self.dynamic:
            shrunk = ops.maximum(
                ops.multiply(self.dynamic_scale, self.backoff_factor),
                self.min_scale,
            )
            if self.hysteresis > 1:
                shrunk = ops.where(
                    ops.greater_equal(streak, self.hysteresis),
                    shrunk,
                    self.dynamic_scale.value,
                )
            self.dynamic_scale.assign(shrunk)
        self.nonfinite_streak.assign(streak)
        self.step_counter.assign(0)
        self.skipped_step_counter.assign_add(1)
        if grads is not None:
            mask = self._nonfinite_mask(grads, trainable_variables)
            self.nonfinite_counts.assign_add(mask)
            self.last_nonfinite_mask.assign(mask)

    def _count_finite_step(self):
        def grow():
            self.dynamic_scale.assign(
                ops.minimum(
                    ops.multiply(self.dynamic_scale, self.growth_factor),
                    self.max_scale,
                )
            )
            self.step_counter.assign(0)

        def count():
            self.step_counter.assign_add(1)

        self.nonfinite_streak.assign(0)
        if not self.dynamic:
            count()
            return
        due = ops.greater_equal(
            ops.add(self.step_counter, 1), self.dynamic_growth_steps
        )
        if not is_concrete(due):
            ops.cond(due, grow, count)
        elif bool(due):
            grow()
        else:
            count()

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

    def _next_state(self, scale, counter, skipped, finite, streak):
        """Returns the (scale, counter, skipped, streak) after one step.

        The pure form of the rule, for `stateless_apply`; the stateful path
        does the same with fewer ops.
        """
        scale = ops.convert_to_tensor(scale)
        counter = ops.convert_to_tensor(counter)
        skipped = ops.convert_to_tensor(skipped)
        streak = ops.convert_to_tensor(streak)
        finite = ops.convert_to_tensor(finite, dtype="bool")
        counter_dtype = counter.dtype
        next_counter = ops.add(counter, ops.ones_like(counter))
        streak = ops.where(finite, ops.zeros_like(streak), ops.add(streak, 1))
        if self.dynamic:
            grow = ops.logical_and(
                finite,
                ops.greater_equal(next_counter, self.dynamic_growth_steps),
            )
            grown = ops.minimum(
                ops.multiply(scale, self.growth_factor), self.max_scale
            )
            shrunk = ops.maximum(
                ops.multiply(scale, self.backoff_factor), self.min_scale
            )
            back_off = ops.logical_and(
                ops.logical_not(finite),
                ops.greater_equal(streak, self.hysteresis),
            )
            scale = ops.where(grow, grown, ops.where(back_off, shrunk, scale))
            next_counter = ops.where(
                grow, ops.zeros_like(counter), next_counter
            )
        counter = ops.where(finite, next_counter, ops.zeros_like(counter))
        skipped = ops.where(
            finite, skipped, ops.add(skipped, ops.ones_like(skipped))
        )
        return (
            ops.cast(scale, "float32"),
            ops.cast(counter, counter_dtype),
            ops.cast(skipped, skipped.dtype),
            ops.cast(streak, streak.dtype),
        )

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

    # The custom-loop API of tf.keras 2 and of Keras. Each step, `apply`
    # (and `stateless_apply`) asks what the loop did since the last step:
    #
    # - the loss was scaled (`scale_loss`, as Keras' trainers do, or
    #   `get_scaled_loss`) and the gradients were not unscaled by hand:
    #   `apply` unscales them, as Keras' own wrapper does;
    # - the gradients were unscaled by hand (`get_unscaled_gradients`): they
    #   are multiplied back by the same scale (exact for a power of two), so
    #   the step is the same as Keras' own;
    # - neither: the loss was never scaled, so the gradients are applied as
    #   given, as tf.keras 2 did, with its warning. Keras' own wrapper
    #   divides them by the scale (2**15 by default) in this case.
    #
    # The answer is read in Python, at the point the step runs: eagerly on
    # torch, and while tracing on TensorFlow (`tf.function`) and JAX (`jit`),
    # where the loop's calls run in the same order within one trace.

    def get_scaled_loss(self, loss):
        """Returns the loss multiplied by the current scale.

        Args:
            loss: A loss tensor, or a callable with no arguments that
                returns one; a callable gets a callable back.

        Returns:
            The scaled loss, in the loss' dtype, or a callable returning it.
        """
        self._loss_scaled_by = "get_scaled_loss"
        if callable(loss):

            def scaled_loss():
                return _multiply(loss(), self._current_scale())

            return scaled_loss
        return _multiply(loss, self._current_scale())

    def get_unscaled_gradients(self, grads):
        """Returns the gradients divided by the current scale.

        The next `apply_gradients` (or `apply`, `stateless_apply`) expects
        the unscaled gradients this returns.

        Args:
            grads: A list of gradients; None entries stay None, and
                TensorFlow's `IndexedSlices` stay sparse.

        Returns:
            The list of unscaled gradients.
        """
        self._grads_come_unscaled = True
        reciprocal = ops.divide(1.0, self._current_scale())
        return [_multiply(g, reciprocal) for g in grads]

    def scale_loss(self, loss):
        """Returns the loss multiplied by the current scale.

        Keras' trainers call it on every training step; the next `apply`
        then unscales the gradients.
        """
        self._loss_scaled_by = "scale_loss"
        return super().scale_loss(loss)

    def apply(self, grads, trainable_variables=None):
        """Applies one step of (scaled) gradients.

        Gradients of a loss that `scale_loss` or `get_scaled_loss` scaled
        are unscaled first; a step whose loss was never scaled applies its
        gradients as given, with tf.keras' warning. A step with a NaN or Inf
        gradient is skipped in both cases.
        """
        grads = self._begin_step(grads)
        try:
            return super().apply(grads, trainable_variables)
        finally:
            self._unscales_this_step = True

    def minimize(self, loss, var_list, tape=None):
        """Scales the loss, takes its gradients and applies one step.

        tf.keras 2's `minimize`, on every backend: the loss is scaled with
        `scale_loss`, differentiated, and the gradients are unscaled and
        applied (or the step is skipped) as in `apply`.

        Args:
            loss: A callable with no arguments that returns the loss. On
                TensorFlow, also a loss tensor recorded on `tape`.
            var_list: The variables to minimize over: a variable, a list of
                them, or a callable returning one of those.
            tape: TensorFlow only: the `tf.GradientTape` that recorded a
                loss tensor.

        Example:

        >>> optimizer = keras_dtype_policy.LossScaleOptimizer(
        ...     keras.optimizers.SGD(0.25)
        ... )
        >>> var = keras.Variable(1.0)
        >>> optimizer.minimize(lambda: var**2, var_list=var)
        >>> float(var.numpy())
        0.5
        """
        variables = loss_gradients.variable_list(var_list)
        if not self.built:
            self.build(variables)
        grads = loss_gradients.scaled_gradients(self, loss, variables, tape)
        if keras.backend.backend() == "torch":
            import torch

            with torch.no_grad():
                self.apply(grads, variables)
        else:
            self.apply(grads, variables)

    def _begin_step(self, grads):
        """Reads and resets what the loop did since the last step.

        Returns the gradients for the step, and sets whether it unscales.
        """
        scaled_by = self._loss_scaled_by
        unscaled = self._grads_come_unscaled
        self._loss_scaled_by = None
        self._grads_come_unscaled = False
        _warn_about_scaling(scaled_by, unscaled)
        self._unscales_this_step = scaled_by is not None or unscaled
        if not unscaled:
            return grads
        scale = self._current_scale()
        return [_multiply(g, scale) for g in grads]

    def _current_scale(self):
        return self.dynamic_scale if self.built else self.initial_scale

    # The wrapper is transparent to the inner optimizer's hyperparameters,
    # both ways, as tf.keras 2's was: `opt.beta_1 = 0.7` sets the inner
    # optimizer's `beta_1`, the value its next step uses.

    use_ema = _InnerSetting()
    ema_momentum = _InnerSetting()
    ema_overwrite_frequency = _InnerSetting()
    weight_decay = _InnerSetting()
    clipnorm = _InnerSetting()
    global_clipnorm = _InnerSetting()
    clipvalue = _InnerSetting()

    def _settings_owner(self):
        """The inner optimizer, or None while the wrapper reads its own.

        Keras' base class sets and reads these settings on the wrapper in
        `__init__` (before there is an inner optimizer) and in `build`.
        """
        state = self.__dict__
        if state.get("_reading_own_settings"):
            return None
        return state.get("inner_optimizer")

    def _forwarded_to(self, name):
        """Returns the inner optimizer if `name` is its hyperparameter and
        not the wrapper's own attribute, else None."""
        if name.startswith("_") or name in _WRAPPER_NAMES:
            return None
        inner = self._settings_owner()
        if inner is None or name in self.__dict__:
            return None
        if any(name in klass.__dict__ for klass in type(self).__mro__):
            return None
        if not inner_hyperparameters.is_hyperparameter(inner, name):
            return None
        return inner

    def __setattr__(self, name, value):
        inner = self._forwarded_to(name)
        if inner is not None:
            setattr(inner, name, value)
            return
        super().__setattr__(name, value)

    def __getattr__(self, name):
        # Only for names the wrapper itself lacks, such as `beta_1`.
        inner = self._forwarded_to(name)
        if inner is None:
            raise AttributeError(
                f"'{type(self).__name__}' object has no attribute '{name}' "
                "(the wrapper passes through only the hyperparameters of "
                "its inner optimizer; read other attributes on "
                "`inner_optimizer`)"
            )
        return getattr(inner, name)

    def __dir__(self):
        names = set(super().__dir__())
        inner = self.__dict__.get("inner_optimizer")
        if inner is not None:
            names.update(inner_hyperparameters.hyperparameter_names(inner))
        return sorted(names)


def _saved_inner_step(values):
    """Returns the inner optimizer's step count among saved values, or None.

    Saved by a loss-scale optimizer, the values start with its own step
    count and learning rate, its counter and scale, then (all but in
    Keras' layout) its skipped-step count, then (in the layout of all its
    variables) its count of skipped steps in a row and two int vectors
    (the attribution of skipped steps), then the inner optimizer's step
    count and learning rate. A tf.keras 2 file holds the inner state
    alone: its step count comes first, followed by slots.
    """
    values = [np.asarray(v) for v in values]

    def scalar(i, kinds):
        return (
            i < len(values)
            and values[i].shape == ()
            and values[i].dtype.kind in kinds
        )

    def int_vector(i):
        return (
            i < len(values)
            and values[i].ndim == 1
            and values[i].dtype.kind in "iu"
        )

    if not scalar(1, "f"):
        at = 0
    elif scalar(5, "f"):
        at = 4
    elif scalar(5, "iu") and int_vector(6) and int_vector(7):
        at = 8
    else:
        at = 5
    return values[at] if scalar(at, "iu") else None


# Names the wrapper sets on itself (its settings, its variables), never
# passed to the inner optimizer even if it has a setting of the same name.
_WRAPPER_NAMES = frozenset(
    (
        *inspect.signature(LossScaleOptimizer).parameters,
        "step_counter",
        "dynamic_scale",
        "skipped_step_counter",
        "skipped_steps_record",
        "nonfinite_streak",
        "nonfinite_streak_record",
        "nonfinite_counts_record",
        "last_nonfinite_record",
        "_pending_extras",
        "nonfinite_counts",
        "last_nonfinite_mask",
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


def _is_among(variable, variables):
    return any(variable is v for v in variables)


def _check_inner_optimizer(inner_optimizer):
    if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
        # tf.keras' error type and wording first.
        raise TypeError(
            "LossScaleOptimizer cannot wrap another LossScaleOptimizer, but "
            f"got: {inner_optimizer!r}. `inner_optimizer` is already a "
            "loss-scale optimizer; wrap its own inner optimizer instead. "
            f"Received: inner_optimizer={inner_optimizer!r}"
        )
    if getattr(inner_optimizer, "_is_wrapped_by_loss_scale_optimizer", False):
        raise ValueError(
            '"inner_optimizer" is already wrapped by a LossScaleOptimizer. '
            "An optimizer can only be wrapped by a single "
            f"LossScaleOptimizer. Received: inner_optimizer={inner_optimizer!r}"
        )
    if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            "`inner_optimizer` must be a keras.optimizers.Optimizer "
            f"instance. Received: inner_optimizer={inner_optimizer!r} "
            f"(of type {type(inner_optimizer).__name__})"
        )


def _scale_arguments(dynamic, initial_scale, dynamic_growth_steps):
    """Returns `(initial_scale, dynamic_growth_steps)` by tf.keras' rules."""
    if dynamic:
        if initial_scale is None:
            initial_scale = 2.0**15
        if dynamic_growth_steps is None:
            dynamic_growth_steps = 2000
        return initial_scale, dynamic_growth_steps
    if initial_scale is None:
        raise ValueError(
            '"initial_scale" must be specified if "dynamic" is False. '
            "Received: initial_scale=None"
        )
    if dynamic_growth_steps is not None:
        raise ValueError(
            '"dynamic_growth_steps" must be None if "dynamic" is False, but '
            f"got: {dynamic_growth_steps}. "
            f"Received: dynamic_growth_steps={dynamic_growth_steps!r}"
        )
    # Keras' base class keeps a number; a fixed scale never reads it.
    return initial_scale, 2000


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


def _multiply(value, factor):
    """`value * factor` in the value's dtype; sparse values stay sparse."""
    if value is None:
        return None
    if type(value).__name__ == "IndexedSlices":
        import tensorflow as tf

        return tf.IndexedSlices(
            _multiply(value.values, factor), value.indices, value.dense_shape
        )
    value = ops.convert_to_tensor(value)
    return ops.multiply(value, ops.cast(factor, value.dtype))


def _warn_about_scaling(scaled_by, unscaled):
    """tf.keras' warnings for a custom loop that forgot a step.

    `scaled_by` names the method that scaled the loss, or is None.
    Gradients of a loss that `scale_loss` (Keras' spelling) scaled need no
    unscaling by hand: `apply` unscales them, without warning.
    """
    if scaled_by == "scale_loss" or (scaled_by and unscaled):
        return
    example = (
        "\n    with tf.GradientTape() as tape:\n      loss = loss_fn()\n"
        "      scaled_loss = opt.get_scaled_loss(loss)\n"
        "    scaled_grads = tape.gradient(scaled_loss, vars)\n"
        "    grads = opt.get_unscaled_gradients(scaled_grads)\n"
        "    opt.apply_gradients([(grads, var)])"
    )
    if scaled_by:
        start = (
            "You forgot to call LossScaleOptimizer.get_unscaled_gradients() "
            "before calling LossScaleOptimizer.apply_gradients() (you did "
            "call get_scaled_loss() however). The gradients are unscaled "
            "for you here, as for Keras' `scale_loss`; tf.keras 2 applied "
            "them scaled."
        )
    elif unscaled:
        start = (
            "You forgot to call LossScaleOptimizer.get_scaled_loss() before "
            "calling LossScaleOptimizer.apply_gradients() (you did call "
            "get_unscaled_gradients() however). This will likely result in "
            "worse model quality, so please call get_scaled_loss() in the "
            "correct place!"
        )
    else:
        start = (
            "You forgot to call LossScaleOptimizer.get_scaled_loss() and "
            "LossScaleOptimizer.get_unscaled_gradients() before calling "
            "LossScaleOptimizer.apply_gradients(). The loss was not "
            "scaled, so the gradients are applied as given (as tf.keras 2 "
            "did), with no protection from float16 underflow."
        )
    warnings.warn(f"{start} For example:{example}", UserWarning, stacklevel=4)
