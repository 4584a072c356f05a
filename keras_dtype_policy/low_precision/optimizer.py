"""`LowPrecisionOptimizer`: training bfloat16 and float16 weights."""

import copy
import typing

import keras
from keras import ops

from keras_dtype_policy import backend_dispatch
from keras_dtype_policy import unconverted
from keras_dtype_policy.low_precision import arguments
from keras_dtype_policy.low_precision import chunked_updates
from keras_dtype_policy.low_precision import compensated_updates
from keras_dtype_policy.low_precision import float32_views
from keras_dtype_policy.low_precision import gradient_release
from keras_dtype_policy.low_precision import inner_step
from keras_dtype_policy.low_precision import optimizer_values
from keras_dtype_policy.low_precision import quantized_slots
from keras_dtype_policy.low_precision import stand_ins
from keras_dtype_policy.low_precision import state_sharding
from keras_dtype_policy.low_precision.float32_views import Float32View
from keras_dtype_policy.low_precision.float32_views import route_writes
from keras_dtype_policy.low_precision.step_targets import StepCache
from keras_dtype_policy.low_precision.step_targets import StepTargets
from keras_dtype_policy.policies.registration import register
from keras_dtype_policy.types import Tensor


class PreparedStep(typing.NamedTuple):
    """What comes before the per-variable updates of a step.

    Attributes:
        grads: The gradients, summed across replicas, unscaled, clipped.
        variables: Their variables (those without a gradient left out).
        learning_rate: The learning rate of the step.
    """

    grads: list
    variables: list
    learning_rate: object


@register
@unconverted.leave_unconverted
class LowPrecisionOptimizer(keras.optimizers.Optimizer):
    """An optimizer whose updates survive bfloat16 and float16 weights.

    Wraps a Keras optimizer: its arithmetic runs in float32, on values read
    from the low-precision weights, and only the writes are rounded, as
    `update_rule` says (float32 weights get the inner optimizer's own
    update).
    The compile hook installs it for the `"kahan_bfloat16"`,
    `"stochastic_bfloat16"`, `"kahan_float16"` and `"stochastic_float16"`
    policies, and with 8-bit or 4-bit state for the same names ending in
    `"_8bit"` or `"_4bit"`. docs/low-precision-training.md says how it
    works, what it supports and what it costs.

    Args:
        inner_optimizer: The unbuilt `keras.optimizers.Optimizer` to wrap.
        update: `"kahan"` (default), `"stochastic_rounding"` or `"nearest"`.
        state_dtype: The optimizer state's dtype: None for each weight's,
            `"float32"`, `"bfloat16"`, `"float16"`, or `"8bit"` / `"4bit"`
            for block-wise quantized state. Or a dict from regexes of
            variable paths to those, the first full match deciding
            (`{"embedding/.*": "float32", ".*": "8bit"}`; None where
            none matches).
        seed: An int seeding the random rounding; None draws one.
        release_gradients: True to update each variable inside the
            backward pass as soon as its gradient is complete, and free
            the gradient there (PyTorch; on JAX XLA's compiled step does
            so already; TensorFlow warns; see `gradient_release`).
        name: The optimizer's name. Defaults to
            `"low_precision_optimizer"`.

    Example:

    >>> optimizer = keras_dtype_policy.LowPrecisionOptimizer(
    ...     keras.optimizers.SGD(1e-4), update="kahan"
    ... )
    >>> weight = keras.Variable(1.0, dtype="bfloat16")
    >>> for _ in range(1000):
    ...     optimizer.apply([keras.ops.ones((), "bfloat16")], [weight])
    >>> round(float(weight.numpy()), 2)
    0.9
    """

    # Its torch step runs batched kernels on whole tensors, which state
    # split across torch processes (DTensors) is not.
    splits_state_on_torch = False

    inner_optimizer: keras.optimizers.Optimizer
    # Set by Keras' `Optimizer`: True once `build` ran.
    built: bool
    # None until `build` finds that a step draws random bits.
    seed_generator: keras.random.SeedGenerator | None

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        update: str = "kahan",
        state_dtype: str | dict[str, str | None] | None = None,
        seed: int | None = None,
        name: str | None = None,
        release_gradients: bool = False,
    ) -> None:
        arguments.check_inner_optimizer(inner_optimizer, LowPrecisionOptimizer)
        update = arguments.check_update(update)
        state_dtype = arguments.check_state_dtype(state_dtype)
        seed = arguments.check_seed(seed)
        release_gradients = gradient_release.check_release_gradients(
            release_gradients, inner_optimizer
        )
        # A name of its own by default, as Keras' Adam has "adam", not
        # numbered per process: Orbax restores the state by its paths,
        # which start with the name, and a compile hook wraps anew on load.
        super().__init__(
            learning_rate=0.0, name=name or "low_precision_optimizer"
        )
        self.inner_optimizer = inner_optimizer
        self._update_rule = update
        self._state_dtype = state_dtype
        self._seed = seed
        self._release_gradients = release_gradients
        self._release = gradient_release.GradientRelease(self)
        self._targets = StepTargets()
        self._step_cache = StepCache()
        self.seed_generator = None
        route_writes(inner_optimizer, self)

    @property
    def update_rule(self) -> str:
        """How results are written: `"kahan"`, `"stochastic_rounding"` or
        `"nearest"` (the constructor's `update` argument)."""
        return self._update_rule

    @property
    def update(self) -> str:
        """`update_rule` under its constructor argument's name, kept for
        existing code (to an optax reader, `update` is a function)."""
        return self._update_rule

    @property
    def state_dtype(self) -> str | dict[str, str | None] | None:
        """The dtype of the optimizer state, None for each weight's, or a
        dict from variable-path regexes to those."""
        if isinstance(self._state_dtype, dict):
            return dict(self._state_dtype)
        return self._state_dtype

    @property
    def seed(self) -> int | None:
        """The seed of the random rounding, or None."""
        return self._seed

    @property
    def release_gradients(self) -> bool:
        """True where each variable is updated in the backward pass and
        its gradient freed there (the constructor's argument)."""
        return self._release_gradients

    @property
    def quantized_slots(self) -> list:
        """The slots stored as 8-bit or 4-bit codes (`QuantizedSlot`s), in
        the order they were made; empty before `build` or without
        quantized state."""
        return list(self._targets.quantized_slots.values())

    @property
    def variables(self) -> list:
        return self._variables + self.inner_optimizer.variables

    @property
    def iterations(self) -> keras.Variable:
        return self.inner_optimizer.iterations

    @property
    def learning_rate(self) -> typing.Any:
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    def scale_loss(self, loss: Tensor) -> Tensor:
        # Keras' trainers call this right before the backward pass.
        if self._release_gradients and self.built:
            self._release.arm()
        return self.inner_optimizer.scale_loss(loss)

    def compensation_of(
        self, variable: keras.Variable
    ) -> keras.Variable | None:
        """Returns the compensation buffer of a weight, or None."""
        view = self._targets.views.get(id(variable))
        return None if view is None else view.compensation

    def build(self, var_list: list) -> None:
        if self.built:
            return
        # Wrapped by `compile` around a sharded optimizer: shard ours too.
        state_sharding.follow_inner(self)
        var_list = list(var_list)
        super().build(var_list)
        for variable in var_list:
            self._add_target(variable)
        self._build_inner()
        self._find_rounded_slots()
        if self._rounds_at_random(var_list):
            with keras.name_scope(self.name, caller=self):
                generator = keras.random.SeedGenerator(
                    self._seed, name="rounding_seed"
                )
                self.seed_generator = generator
            self._track_variable(generator.state)
        if self._release_gradients:
            self._release.install(var_list)

    def _add_target(self, variable):
        """Adds what the inner optimizer builds on for `variable`: the
        variable itself, or a `Float32View` of it (with its compensation
        buffer under `update="kahan"`)."""
        weight_dtype = keras.backend.standardize_dtype(variable.dtype)
        slot_dtype = self._slot_dtype(variable, weight_dtype)
        low = compensated_updates.is_low_precision(weight_dtype)
        if not keras.backend.is_float_dtype(weight_dtype) or (
            not low and slot_dtype == weight_dtype
        ):
            self._targets.order.append(variable)
            return
        compensation = None
        if low and self._update_rule == "kahan":
            compensation = self.add_variable(
                shape=variable.shape,
                dtype=weight_dtype,
                name=_slot_name(variable, "compensation"),
                layout=getattr(variable, "_layout", None),
            )
        view = Float32View(self, variable, compensation, slot_dtype)
        self._targets.views[id(variable)] = view
        self._targets.order.append(view)

    def _slot_dtype(self, variable, weight_dtype):
        """The dtype of the state of `variable`: `state_dtype` (the entry
        its path matches, for a dict) or the weight's, float32 where
        quantized state does not apply (an integer weight, or one below
        `MIN_QUANTIZED_SIZE`)."""
        state_dtype = arguments.state_dtype_for(
            self._state_dtype, variable.path
        )
        slot_dtype = state_dtype or weight_dtype
        if quantized_slots.quantized_bits(slot_dtype) and not (
            keras.backend.is_float_dtype(weight_dtype)
            and quantized_slots.is_quantizable(variable)
        ):
            return "float32"
        return slot_dtype

    def _build_inner(self):
        """Builds the inner optimizer on the targets, its writes routed."""
        inner = self.inner_optimizer
        targets = self._targets
        route_writes(inner, self)
        # A quantized slot's state is its codes and scales, the wrapper's:
        # the inner optimizer does not track it among its variables.
        with float32_views.building(targets.views.values()):
            with stand_ins.untracked(inner):
                inner.build(targets.order)

    def _find_rounded_slots(self):
        """Records the inner optimizer's slots stored in bfloat16 or
        float16 (not its step count or learning rate)."""
        inner = self.inner_optimizer
        skip = {id(inner._iterations)}
        if isinstance(inner._learning_rate, keras.Variable):
            skip.add(id(inner._learning_rate))
        for slot in inner.variables:
            if id(slot) not in skip and compensated_updates.is_low_precision(
                slot.dtype
            ):
                self._targets.rounded_slots[id(slot)] = slot

    def _rounds_at_random(self, var_list):
        """True where a step draws random bits: stochastic rounding of a
        low-precision weight, or of narrow or quantized state."""
        targets = self._targets
        stochastic_weights = self._update_rule == "stochastic_rounding" and any(
            compensated_updates.is_low_precision(v.dtype) for v in var_list
        )
        stochastic_slots = self._update_rule != "nearest" and bool(
            targets.rounded_slots or targets.quantized_slots
        )
        return stochastic_weights or stochastic_slots

    def apply(
        self, grads: list[Tensor], trainable_variables: list | None = None
    ) -> None:
        """Applies one step: the inner optimizer's, with rounded writes."""
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "`apply` without `trainable_variables` needs an "
                    "optimizer built on them: call `optimizer.build("
                    "trainable_variables)` first, or pass them. Received: "
                    "trainable_variables=None"
                )
            trainable_variables = self._trainable_variables
        trainable_variables = list(trainable_variables)
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        if not self._targets.views and not self._release.open:
            self._release.disarm()
            return self.inner_optimizer.apply(grads, trainable_variables)
        # Put back if `keras_dtype_policy.uninstall()` took them off.
        route_writes(self.inner_optimizer, self)
        # TensorFlow's compiles the step, torch's turns autograd off; JAX
        # has none (`fit` compiles the whole step).
        backend_apply = backend_dispatch.module_for("low_precision_apply")
        if backend_apply is None:
            return self._apply(grads, trainable_variables)
        return backend_apply.apply(self, grads, trainable_variables)

    def _apply(self, grads, trainable_variables):
        inner = self.inner_optimizer
        if self._release.open:
            with keras.name_scope(inner.name, caller=inner):
                return self._release.finish(grads, trainable_variables)
        self._release.disarm()
        with keras.name_scope(inner.name, caller=inner):
            prepared = self._prepare_step(grads, trainable_variables)
            self._run_updates(
                prepared.grads, prepared.variables, prepared.learning_rate
            )
            inner._iterations.assign_add(1)

    def _prepare_step(self, grads, trainable_variables):
        """What comes before the per-variable updates: the gradients
        summed across replicas, unscaled and clipped, and the state the
        inner optimizer advances once a step.

        Returns:
            A `PreparedStep`.
        """
        inner = self.inner_optimizer
        pairs = [
            (g, v)
            for g, v in zip(grads, trainable_variables, strict=True)
            if g is not None
        ]
        if not pairs:
            raise ValueError("No gradients provided for any variable.")
        grads = inner_step.summed_across_replicas([g for g, _ in pairs])
        if _clips(inner):
            # Clipped in float32, as the rest of the inner arithmetic.
            views = self._targets.views
            grads = [
                ops.cast(g, "float32") if id(v) in views else g
                for g, (_, v) in zip(grads, pairs, strict=True)
            ]
        scale = inner.loss_scale_factor
        if scale is not None:
            grads = [g / scale for g in grads]
        grads = inner._clip_gradients(grads)
        learning_rate = inner.learning_rate
        inner_step.advance_step_state(inner)
        return PreparedStep(grads, [v for _, v in pairs], learning_rate)

    def _begin_released_step(self):
        """What comes once before a released step's first update (see
        `gradient_release`); returns its `ReleasedStep`."""
        inner = self.inner_optimizer
        inner_step.advance_step_state(inner)
        noise = None
        if backend_dispatch.is_torch():
            torch_step = backend_dispatch.module_for("low_precision_step")
            noise = torch_step.step_noise(self)
        return gradient_release.ReleasedStep(inner.learning_rate, noise)

    def _release_updates(self, grads, variables, step):
        """Updates variables of a released step from their gradients,
        unscaled and clipped as `_prepare_step` does."""
        inner = self.inner_optimizer
        views = self._targets.views
        with keras.name_scope(inner.name, caller=inner):
            if _clips(inner):
                grads = [
                    ops.cast(g, "float32") if id(v) in views else g
                    for g, v in zip(grads, variables, strict=True)
                ]
            scale = inner.loss_scale_factor
            if scale is not None:
                grads = [g / scale for g in grads]
            grads = inner._clip_gradients(grads)
            if not views:
                # No view: the usual step is the inner optimizer's own.
                inner._apply_weight_decay(variables)
                rate = step.learning_rate
                inner._backend_update_step(grads, variables, rate)
                return
            self._run_updates(grads, variables, step.learning_rate, step)

    def _run_updates(self, grads, variables, learning_rate, step=None):
        """The per-variable updates of `variables` (all, or a group), of
        a released step where `step` (a `ReleasedStep`) is given."""
        torch_step = None
        if backend_dispatch.is_torch():
            torch_step = backend_dispatch.module_for("low_precision_step")
        self._targets.in_step = True
        try:
            if torch_step is not None and torch_step.can_batch(self):
                noise = (
                    torch_step.step_noise(self) if step is None else step.noise
                )
                self._batched_updates(
                    torch_step, grads, variables, learning_rate, noise
                )
            else:
                self._updates(grads, variables, learning_rate)
        finally:
            self._targets.in_step = False
            for slot in self._targets.quantized_slots.values():
                slot.working = None

    def _updates(self, grads, variables, learning_rate):
        """The inner optimizer's `update_step`, one variable at a time (a
        large one a chunk at a time, see `chunked_updates`)."""
        for grad, variable in zip(grads, variables, strict=True):
            if getattr(variable, "overwrite_with_gradient", False):
                variable.assign(grad)
                continue
            target = self._targets.views.get(id(variable), variable)
            chunked = chunked_updates.stand_ins_of(self, variable, grad)
            if chunked is not None:
                chunked_updates.update(
                    self, chunked, grad, learning_rate, self._update_one
                )
                continue
            self._update_one(grad, variable, target, learning_rate)
            if variable.constraint is not None:
                target.assign(
                    variable.constraint(ops.convert_to_tensor(target))
                )

    def _update_one(self, grad, variable, target, learning_rate):
        """The weight decay and `update_step` of one variable, through
        `target` (its view, or itself)."""
        inner = self.inner_optimizer
        if inner.weight_decay is not None and inner._use_weight_decay(variable):
            decay = ops.multiply(
                ops.cast(inner.weight_decay, target.dtype),
                ops.cast(learning_rate, target.dtype),
            )
            value = ops.convert_to_tensor(target)
            target.assign(value - value * decay)
        inner.update_step(grad, target, learning_rate)

    def _batched_updates(
        self, torch_step, grads, variables, learning_rate, noise
    ):
        """All variables' updates as batched torch operations (by the
        module `torch_step`), drawing random bits from `noise`."""
        batched_grads, batched = [], []
        for grad, variable in zip(grads, variables, strict=True):
            if getattr(variable, "overwrite_with_gradient", False):
                variable.assign(grad)
            else:
                batched_grads.append(grad)
                batched.append(variable)
        torch_step.batched_apply(
            self, batched_grads, batched, learning_rate, noise
        )
        for variable in batched:
            if variable.constraint is not None:
                target = self._targets.views.get(id(variable), variable)
                target.assign(
                    variable.constraint(ops.convert_to_tensor(target))
                )

    def _write(self, view, value):
        """Writes a float32 result into the weight behind `view` (into
        its chunk, while a chunk is updated)."""
        dtype = view.weight.dtype
        value = ops.cast(value, "float32")
        if not compensated_updates.is_low_precision(dtype):
            view.write(weight=ops.cast(value, dtype))
        elif view.compensation is not None:
            rounded, residual = compensated_updates.kahan_split(
                value, dtype, view.compensation.dtype
            )
            view.write(weight=rounded, compensation=residual)
        elif self._update_rule == "stochastic_rounding":
            seed = view.rounding_seed(self.seed_generator)
            view.write(
                weight=compensated_updates.stochastic_round(value, dtype, seed)
            )
        else:
            view.write(weight=ops.cast(value, dtype))

    def _write_slot(self, slot, value):
        """Writes a float32 result into a low-precision optimizer slot."""
        slot.assign(self._rounded_slot_value(value, slot))

    def _rounded_slot_value(self, value, slot):
        """Returns float32 `value` rounded to a slot's dtype: to nearest
        for `update="nearest"`, else stochastically."""
        value = ops.cast(value, "float32")
        if self._update_rule == "nearest":
            return ops.cast(value, slot.dtype)
        return compensated_updates.stochastic_round(
            value, slot.dtype, self.seed_generator
        )

    def state_rounding_seed(self) -> keras.random.SeedGenerator | None:
        """The seed of stochastic rounding of the state, or None where it
        rounds to nearest (`update="nearest"`)."""
        return None if self._update_rule == "nearest" else self.seed_generator

    def finalize_variable_values(self, var_list: list) -> None:
        self.inner_optimizer.finalize_variable_values(var_list)

    def load_own_variables(self, store: typing.Any) -> None:
        """Loads the saved state, refusing values that make no sense (a
        negative step count, a learning rate that is not finite)."""
        values = [store[str(i)] for i in range(len(store.keys()))]
        if len(values) == len(self.variables):
            optimizer_values.check_saved(self.variables, values)
        super().load_own_variables(store)

    def get_config(self) -> dict[str, typing.Any]:
        config = {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(
                self.inner_optimizer
            ),
            "update": self._update_rule,
            "state_dtype": self.state_dtype,
            "seed": self._seed,
        }
        # Only where set: files without it load in earlier versions.
        if self._release_gradients:
            config["release_gradients"] = True
        return config

    @classmethod
    def from_config(
        cls,
        config: dict[str, typing.Any],
        custom_objects: dict[str, typing.Any] | None = None,
    ) -> "LowPrecisionOptimizer":
        config = dict(config)
        inner_optimizer = config.pop("inner_optimizer", None)
        if isinstance(inner_optimizer, dict):
            # A copy: Keras rewrites the class name of the dict it is given.
            inner_optimizer = keras.optimizers.deserialize(
                copy.deepcopy(inner_optimizer), custom_objects=custom_objects
            )
        elif isinstance(inner_optimizer, str):
            inner_optimizer = keras.optimizers.get(inner_optimizer)
        return cls(inner_optimizer, **config)


def _clips(optimizer):
    return any(
        getattr(optimizer, name, None) is not None
        for name in ("clipnorm", "clipvalue", "global_clipnorm")
    )


def _slot_name(variable, name):
    return f"{variable.path.replace('/', '_')}_{name}"
