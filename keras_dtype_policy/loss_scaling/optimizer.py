"""`LossScaleOptimizer`: dynamic and fixed loss scaling on every backend."""

import inspect

import keras
from keras import ops

from keras_dtype_policy.loss_scaling import gradient_check
from keras_dtype_policy.loss_scaling import inner_optimizer_config
from keras_dtype_policy.loss_scaling import optimizer_state
from keras_dtype_policy.loss_scaling import tf_replicas
from keras_dtype_policy.loss_scaling.backend_utils import is_concrete
from keras_dtype_policy.policies.registration import register
from keras_dtype_policy.policies.validation import check_positive_int
from keras_dtype_policy.policies.validation import check_positive_number


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

    - a skipped step multiplies the scale by `backoff_factor`, but not below
      `min_scale`, and restarts the count of finite steps;
    - after `dynamic_growth_steps` finite steps in a row, the scale is
      multiplied by `growth_factor`, but not above `max_scale`.

    With `dynamic=False` the scale stays at `initial_scale`, as in tf.keras
    2. With the default arguments, this reproduces
    `keras.optimizers.LossScaleOptimizer` step for step while the scale
    stays within `[min_scale, max_scale]`.

    The scale, the count of finite steps since the last change and the
    number of skipped steps are optimizer variables: they are saved with the
    model and restored exactly.

    Args:
        inner_optimizer: The `keras.optimizers.Optimizer` to wrap.
        dynamic: Whether the scale adapts to the gradients. Defaults to
            `True`.
        initial_scale: The first scale, a finite number greater than zero.
            Defaults to `2**15`.
        dynamic_growth_steps: How many finite steps in a row make the scale
            grow, at least 1. Defaults to `2000`.
        growth_factor: The factor the scale grows by, greater than 1.
            Defaults to `2.0`.
        backoff_factor: The factor the scale shrinks by after a non-finite
            step, between 0 and 1. Defaults to `0.5`.
        min_scale: The floor of a dynamic scale. Defaults to `1.0`, as in
            tf.keras 2 (Keras 3 has no floor).
        max_scale: The ceiling of a dynamic scale, which keeps it finite.
            Defaults to `2**24`.
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
        initial_scale=2.0**15,
        dynamic_growth_steps=2000,
        growth_factor=2.0,
        backoff_factor=0.5,
        min_scale=1.0,
        max_scale=2.0**24,
        name=None,
        **kwargs,
    ):
        _check_inner_optimizer(inner_optimizer)
        if not isinstance(dynamic, bool):
            raise TypeError(
                "`dynamic` must be True or False. "
                f"Received: dynamic={dynamic!r} "
                f"(of type {type(dynamic).__name__})"
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
        self.dynamic = dynamic
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.min_scale = min_scale
        self.max_scale = max_scale

    def build(self, var_list):
        if optimizer_state.defers_build(var_list):
            return
        super().build(var_list)
        self.skipped_step_counter = self.add_variable(
            shape=(),
            dtype="int",
            initializer="zeros",
            aggregation="none",
            name="skipped_steps",
        )
        optimizer_state.apply_pending_values(self, self)

    def load_own_variables(self, store):
        """Loads this optimizer's state, also from a tf.keras 2 file.

        A tf.keras 2 file holds the inner optimizer's state only: it is
        loaded, and the scale starts from `initial_scale`.
        """
        values = optimizer_state.store_values(store)
        if len(values) != len(self.variables) and self.built:
            if optimizer_state.assign_optimizer_values(
                self.inner_optimizer, values
            ):
                return
        super().load_own_variables(store)

    def set_weights(self, weights):
        """Sets all optimizer values, own and inner, or a tf.keras 2 set."""
        weights = list(weights)
        if not self.built:
            optimizer_state.keep_pending_values(
                self, weights, self.inner_optimizer.iterations
            )
            return
        if len(weights) == len(self.variables):
            for variable, weight in zip(self.variables, weights, strict=True):
                variable.assign(weight)
            return
        if not optimizer_state.assign_optimizer_values(
            self.inner_optimizer, weights
        ):
            raise ValueError(
                f"Cannot set {len(weights)} values on an optimizer with "
                f"{len(self.variables)} variables (or its inner optimizer's "
                f"{len(self.inner_optimizer.variables)})."
            )

    @property
    def loss_scale(self):
        """The current loss scale, as a Python float."""
        if not self.built:
            return self.initial_scale
        return float(self.dynamic_scale.numpy())

    @property
    def dynamic_counter(self):
        """Finite steps since the scale last changed (or a step was
        skipped), as a Python int."""
        if not self.built:
            return 0
        return int(self.step_counter.numpy())

    @property
    def skipped_steps(self):
        """The number of steps skipped for non-finite gradients, as an int."""
        if not self.built:
            return 0
        return int(self.skipped_step_counter.numpy())

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        if not self.built:
            raise ValueError(
                f"To call `stateless_apply`, {type(self).__name__} must be "
                "built. Build it with `optimizer.build(trainable_variables)`."
            )
        own_count = len(self._variables)
        own_values = list(optimizer_variables[:own_count])
        inner_values = list(optimizer_variables[own_count:])
        position = {id(v): i for i, v in enumerate(self._variables)}
        scale_at = position[id(self.dynamic_scale)]
        counter_at = position[id(self.step_counter)]
        skipped_at = position[id(self.skipped_step_counter)]

        finite = self.check_finite(grads)

        def apply_step():
            # Unscaled inside the branch, where XLA fuses the division into
            # the inner optimizer's update.
            unscaled_grads = self._unscale(
                grads, own_values[scale_at], self._trainable_variables
            )
            return self.inner_optimizer.stateless_apply(
                inner_values, unscaled_grads, trainable_variables
            )

        def skip_step():
            return list(trainable_variables), list(inner_values)

        new_trainables, new_inner_values = ops.cond(
            finite, apply_step, skip_step
        )
        (
            own_values[scale_at],
            own_values[counter_at],
            own_values[skipped_at],
        ) = self._next_state(
            own_values[scale_at],
            own_values[counter_at],
            own_values[skipped_at],
            finite,
        )
        return list(new_trainables), own_values + list(new_inner_values)

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
            and not self._scale_is_one()
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
                self._stateful_handle_non_finite_grads()
            return
        if finite is None:
            finite = self.check_finite(grads)
        if not is_concrete(finite):
            ops.cond(
                finite,
                lambda: self._stateful_handle_finite_grads(
                    grads, trainable_variables
                ),
                self._stateful_handle_non_finite_grads,
            )
        elif bool(finite):
            self._stateful_handle_finite_grads(grads, trainable_variables)
        else:
            self._stateful_handle_non_finite_grads()

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

    def _stateful_handle_non_finite_grads(self):
        # Skip the step: shrink a dynamic scale, restart the count.
        if self.dynamic:
            self.dynamic_scale.assign(
                ops.maximum(
                    ops.multiply(self.dynamic_scale, self.backoff_factor),
                    self.min_scale,
                )
            )
        self.step_counter.assign(0)
        self.skipped_step_counter.assign_add(1)

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
        if self._scale_is_one():
            return list(grads)
        return gradient_check.unscale(grads, scale, self._kept(variables))

    def _scale_is_one(self):
        # A fixed scale of 1 (a wrapper on a step that needs no scaling):
        # nothing to divide.
        return not self.dynamic and self.initial_scale == 1.0

    def _kept(self, variables):
        # The gradients Keras never unscales: those that overwrite their
        # variable.
        return [self._overwrite_variable_with_gradient(v) for v in variables]

    def _next_state(self, scale, counter, skipped, finite):
        """Returns the (scale, counter, skipped) that follow one step.

        The pure form of the rule, for `stateless_apply`; the stateful path
        does the same with fewer ops.
        """
        scale = ops.convert_to_tensor(scale)
        counter = ops.convert_to_tensor(counter)
        skipped = ops.convert_to_tensor(skipped)
        finite = ops.convert_to_tensor(finite, dtype="bool")
        counter_dtype = counter.dtype
        next_counter = ops.add(counter, ops.ones_like(counter))
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
            scale = ops.where(grow, grown, ops.where(finite, scale, shrunk))
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
        )

    def get_config(self):
        """Returns Keras' four keys, and each setting of ours not default.

        With the defaults, the config is exactly the one Keras' own
        `LossScaleOptimizer` writes: `name`, `inner_optimizer`,
        `initial_scale` and `dynamic_growth_steps`.
        """
        config = super().get_config()
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
        config = dict(config)
        if config.get("dynamic_growth_steps", 0) is None:
            # tf.keras 2 saves None here for a fixed scale.
            del config["dynamic_growth_steps"]
        inner_optimizer = inner_optimizer_config.deserialize_optimizer(
            config.pop("inner_optimizer", None), custom_objects=custom_objects
        )
        return cls(inner_optimizer, **config)


# The settings Keras' own LossScaleOptimizer lacks, with their defaults.
_EXTRA_DEFAULTS = {
    name: inspect.signature(LossScaleOptimizer).parameters[name].default
    for name in (
        "dynamic",
        "growth_factor",
        "backoff_factor",
        "min_scale",
        "max_scale",
    )
}


def _check_inner_optimizer(inner_optimizer):
    if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
        raise ValueError(
            "`inner_optimizer` is already a loss-scale optimizer; wrap its "
            "own inner optimizer instead. "
            f"Received: inner_optimizer={inner_optimizer!r}"
        )
    if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            "`inner_optimizer` must be a keras.optimizers.Optimizer "
            f"instance. Received: inner_optimizer={inner_optimizer!r} "
            f"(of type {type(inner_optimizer).__name__})"
        )
