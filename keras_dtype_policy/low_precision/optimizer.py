"""`LowPrecisionOptimizer`: training bfloat16 and float16 weights."""

import types

import keras
from keras import ops

from keras_dtype_policy.loss_scaling.inner_optimizer_config import (
    deserialize_optimizer,
)
from keras_dtype_policy.low_precision import compensated_updates
from keras_dtype_policy.policies.registration import register

UPDATES = ("kahan", "stochastic_rounding", "nearest")
STATE_DTYPES = (None, "float32", "bfloat16", "float16")


@register
class LowPrecisionOptimizer(keras.optimizers.Optimizer):
    """An optimizer whose updates survive bfloat16 and float16 weights.

    A bfloat16 number keeps 8 significant bits: an update smaller than half
    a unit in the last place of a weight is rounded away (a weight of 1.0
    receiving -1e-4 a step stays 1.0 for ever), and Keras alone runs the
    optimizer's arithmetic in the weight's dtype too, so Adam's
    `beta_2=0.999` becomes 1.0 and its updates vanish. This wrapper keeps
    the weights in their dtype and changes how they are updated:

    - the inner optimizer's arithmetic runs in float32, on values loaded
      from low-precision storage: `beta_1`, `beta_2`, `epsilon`, the bias
      correction and the learning rate are float32 numbers there, exactly
      as under float32 weights;
    - only the writes are rounded, as `update` says: `"kahan"` keeps one
      compensation buffer per low-precision weight (in the weight's dtype,
      an optimizer variable) holding what rounding took off, which the next
      read adds back; `"stochastic_rounding"` rounds up or down at random,
      unbiased, with no buffer; `"nearest"` rounds to nearest, which loses
      small updates as Keras alone does, but keeps the float32 arithmetic.

    Weight decay (`weight_decay=`, AdamW), gradient clipping and variable
    constraints of the inner optimizer go through the same float32 path.
    float32 weights get the inner optimizer's own update (`state_dtype`
    aside): with no low-precision weight and no `state_dtype`, the wrapper
    hands the step to the inner optimizer unchanged, bit for bit; beside
    low-precision weights they go through its per-variable `update_step`
    (on torch the built-in optimizers' fused step may round differently in
    the last bit).

    Optimizer state (Adam's moments, momentum, accumulators) is kept in
    `state_dtype`, or, with `state_dtype=None`, in each weight's own dtype,
    as Keras does. Moments are computed in float32 and rounded when stored.
    Low-precision state is stored with stochastic rounding (seeded by the
    same generator), under `"kahan"` too: a compensation buffer per slot
    would give back the memory saved, and rounding to nearest freezes a
    bfloat16 second moment (a change of `1 - beta_2 = 0.001` of its value
    is below half its ulp, so it could never decay). `"nearest"` rounds
    the state to nearest. Hyperparameters never pass through low
    precision, so any `beta_2` and `epsilon` work. bfloat16 has float32's
    exponent range, so a bfloat16 second moment does not underflow; a
    float16 one underflows for gradients below about 2.4e-4 (their square
    is below float16's smallest number), which makes `m / (sqrt(v) +
    epsilon)` large: keep Adam-like state in bfloat16 or float32 under
    float16 weights (the compile hook uses float32 there).

    The design: for each bfloat16/float16 weight (and each weight whose
    state dtype differs from its own), the inner optimizer is built on a
    float32 view of it, a `keras.Variable` whose reads return the float32
    value the weight stands for (plus its compensation) and whose writes
    go through the rounding above. The wrapper runs the inner optimizer's
    per-variable `update_step`, as every backend's base optimizer does (on
    torch, instead of the fused `_parallel_update_step` of the built-in
    optimizers, which would write in place around the views). The inner
    optimizer's own `assign`, `assign_add` and `assign_sub` are routed the
    same way on this instance only; nothing in Keras is patched.

    Which models get it: a model whose policy is `"kahan_bfloat16"`,
    `"stochastic_bfloat16"`, `"kahan_float16"` or `"stochastic_float16"`
    (bfloat16 or float16 compute and weights) has its optimizer wrapped at
    `compile` (inside the `LossScaleOptimizer` of a float16 model). A plain
    `"bfloat16"` or `"float16"` policy trains exactly as with Keras alone:
    nothing is wrapped, results do not change. Opt in by the policy name or
    by wrapping the optimizer yourself; to go back, use the plain name or
    `update="nearest"`.

    The compensation buffers, the random generator's state and the
    low-precision state are optimizer variables: saved in `.keras` and
    `.weights.h5` files and restored bit for bit.

    A Kahan compensation in the weight's dtype carries 8 more bits: the
    weight and its compensation hold about 16 significant bits, so updates
    below about 2**-17 of a weight are still partly lost (stochastic
    rounding keeps them on average, at the cost of noise).

    Keras' trainers, custom loops (`apply`, `apply_gradients`, JAX's
    `stateless_apply`), `jit` on JAX and XLA on TensorFlow, JAX's
    `keras.distribution.DataParallel` and TensorFlow's `MirroredStrategy`
    (the wrapper sums the replicas' gradients, as Keras' TensorFlow
    optimizer does) all work. Nadam's once-a-step state (its momentum
    schedule's product) is advanced by the wrapper, which runs the
    per-variable steps itself.

    Keras alone reads the weights of a `.weights.h5` file this optimizer
    saved (its state is skipped with Keras' warning); a `.keras` file names
    this class, so loading it needs this package.

    Not supported: an inner optimizer with `use_ema` or
    `gradient_accumulation_steps`, or one already built (the wrapper builds
    it on its views).

    Args:
        inner_optimizer: The `keras.optimizers.Optimizer` to wrap (not a
            `LossScaleOptimizer`: that one goes outside).
        update: `"kahan"` (the default), `"stochastic_rounding"` or
            `"nearest"`.
        state_dtype: The dtype of the optimizer state: None (each slot in
            its weight's dtype), `"float32"`, `"bfloat16"` or `"float16"`.
        seed: An int seeding the random rounding, for reproducible runs;
            None draws one.
        name: The optimizer's name.

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

    def __init__(
        self,
        inner_optimizer,
        update="kahan",
        state_dtype=None,
        seed=None,
        name=None,
    ):
        _check_inner_optimizer(inner_optimizer)
        update = _check_update(update)
        state_dtype = _check_state_dtype(state_dtype)
        seed = _check_seed(seed)
        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = inner_optimizer
        self._update = update
        self._state_dtype = state_dtype
        self._seed = seed
        self._targets = _Targets()
        self.seed_generator = None

    @property
    def update(self):
        """How results are written: `"kahan"`, `"stochastic_rounding"` or
        `"nearest"`."""
        return self._update

    @property
    def state_dtype(self):
        """The dtype of the optimizer state, or None for each weight's."""
        return self._state_dtype

    @property
    def seed(self):
        """The seed of the random rounding, or None."""
        return self._seed

    @property
    def variables(self):
        return self._variables + self.inner_optimizer.variables

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def compensation_of(self, variable):
        """Returns the compensation buffer of a weight, or None."""
        view = self._targets.views.get(id(variable))
        return None if view is None else view.compensation

    def build(self, var_list):
        if self.built:
            return
        var_list = list(var_list)
        super().build(var_list)
        targets = self._targets
        slot_dtypes = []
        for variable in var_list:
            weight_dtype = keras.backend.standardize_dtype(variable.dtype)
            slot_dtype = self._state_dtype or weight_dtype
            low = compensated_updates.is_low_precision(weight_dtype)
            if not keras.backend.is_float_dtype(weight_dtype) or (
                not low and slot_dtype == weight_dtype
            ):
                targets.order.append(variable)
                continue
            compensation = None
            if low and self._update == "kahan":
                compensation = self.add_variable(
                    shape=variable.shape,
                    dtype=weight_dtype,
                    name=_slot_name(variable, "compensation"),
                    layout=getattr(variable, "_layout", None),
                )
            view = _Float32View(self, variable, compensation, slot_dtype)
            targets.views[id(variable)] = view
            targets.order.append(view)
            slot_dtypes.append(slot_dtype)
        inner = self.inner_optimizer
        _route_writes(inner, self)
        for view in targets.views.values():
            view._building = True
        try:
            inner.build(targets.order)
        finally:
            for view in targets.views.values():
                view._building = False
        skip = {id(inner._iterations)}
        if isinstance(inner._learning_rate, keras.Variable):
            skip.add(id(inner._learning_rate))
        for slot in inner.variables:
            if id(slot) not in skip and compensated_updates.is_low_precision(
                slot.dtype
            ):
                targets.rounded_slots[id(slot)] = slot
        stochastic_weights = self._update == "stochastic_rounding" and any(
            compensated_updates.is_low_precision(v.dtype) for v in var_list
        )
        stochastic_slots = self._update != "nearest" and bool(
            targets.rounded_slots
        )
        if stochastic_weights or stochastic_slots:
            with keras.name_scope(self.name, caller=self):
                self.seed_generator = keras.random.SeedGenerator(
                    self._seed, name="rounding_seed"
                )
            self._track_variable(self.seed_generator.state)

    def apply(self, grads, trainable_variables=None):
        """Applies one step: the inner optimizer's, with rounded writes."""
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        if trainable_variables is None:
            trainable_variables = self._trainable_variables
        trainable_variables = list(trainable_variables)
        if not self._targets.views:
            return self.inner_optimizer.apply(grads, trainable_variables)
        if keras.backend.backend() == "torch":
            import torch

            with torch.no_grad():
                return self._apply(grads, trainable_variables)
        return self._apply(grads, trainable_variables)

    def _apply(self, grads, trainable_variables):
        inner = self.inner_optimizer
        pairs = [
            (g, v)
            for g, v in zip(grads, trainable_variables, strict=True)
            if g is not None
        ]
        if not pairs:
            raise ValueError("No gradients provided for any variable.")
        with keras.name_scope(inner.name, caller=inner):
            grads = _summed_across_replicas([g for g, _ in pairs])
            scale = inner.loss_scale_factor
            if scale is not None:
                grads = [g / scale for g in grads]
            grads = inner._clip_gradients(grads)
            learning_rate = inner.learning_rate
            _advance_step_state(inner)
            variables = [v for _, v in pairs]
            for grad, variable in zip(grads, variables, strict=True):
                if getattr(variable, "overwrite_with_gradient", False):
                    variable.assign(grad)
                    continue
                target = self._targets.views.get(id(variable), variable)
                if inner.weight_decay is not None and inner._use_weight_decay(
                    variable
                ):
                    decay = ops.multiply(
                        ops.cast(inner.weight_decay, target.dtype),
                        ops.cast(learning_rate, target.dtype),
                    )
                    value = ops.convert_to_tensor(target)
                    target.assign(value - value * decay)
                inner.update_step(grad, target, learning_rate)
                if variable.constraint is not None:
                    target.assign(
                        variable.constraint(ops.convert_to_tensor(target))
                    )
            inner._iterations.assign_add(1)

    def _write(self, view, value):
        """Writes a float32 result into the weight behind `view`."""
        weight = view.weight
        value = ops.cast(value, "float32")
        if not compensated_updates.is_low_precision(weight.dtype):
            weight.assign(ops.cast(value, weight.dtype))
        elif view.compensation is not None:
            compensated_updates.kahan_write(weight, view.compensation, value)
        elif self._update == "stochastic_rounding":
            weight.assign(
                compensated_updates.stochastic_round(
                    value, weight.dtype, self.seed_generator
                )
            )
        else:
            weight.assign(ops.cast(value, weight.dtype))

    def _write_slot(self, slot, value):
        """Writes a float32 result into a low-precision optimizer slot."""
        value = ops.cast(value, "float32")
        if self._update == "nearest":
            slot.assign(ops.cast(value, slot.dtype))
        else:
            slot.assign(
                compensated_updates.stochastic_round(
                    value, slot.dtype, self.seed_generator
                )
            )

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    def get_config(self):
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(
                self.inner_optimizer
            ),
            "update": self._update,
            "state_dtype": self._state_dtype,
            "seed": self._seed,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner_optimizer = deserialize_optimizer(
            config.pop("inner_optimizer", None), custom_objects=custom_objects
        )
        return cls(inner_optimizer, **config)


class _Targets:
    """What the wrapper built, kept out of Keras' variable tracking."""

    def __init__(self):
        self.views = {}
        self.order = []
        self.rounded_slots = {}


class _Float32View(keras.Variable):
    """A float32 stand-in for a weight, for the inner optimizer.

    Reads return the float32 value the weight stands for (its compensation
    added); writes go to the wrapper, which rounds them into the weight.
    While the inner optimizer builds, the view reports the state dtype, so
    the slots made from it get that dtype. Its own storage is one float32
    scalar; its shape, name and path are the weight's.
    """

    def __init__(self, owner, weight, compensation, slot_dtype):
        self.owner = owner
        self.weight = weight
        self.compensation = compensation
        self.slot_dtype = slot_dtype
        self._building = False
        # While its own scalar is made, the view has the scalar's shape (a
        # distribution lays the scalar out by it).
        self._making_storage = True
        super().__init__(
            0.0,
            dtype="float32",
            trainable=False,
            autocast=False,
            name=f"{weight.name}_float32_view",
        )
        self._making_storage = False
        self._layout = getattr(weight, "_layout", None)

    @property
    def value(self):
        if self._building:
            return self.weight.value
        if self.compensation is not None:
            return compensated_updates.kahan_read(
                self.weight.value, self.compensation.value
            )
        return ops.cast(self.weight.value, "float32")

    @property
    def dtype(self):
        return self.slot_dtype if self._building else "float32"

    @property
    def shape(self):
        if self._making_storage:
            return self._shape
        return self.weight.shape

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def name(self):
        return self.weight.name

    @property
    def path(self):
        return self.weight.path

    @property
    def trainable(self):
        return self.weight.trainable

    @trainable.setter
    def trainable(self, value):
        pass

    @property
    def constraint(self):
        return None

    @constraint.setter
    def constraint(self, value):
        pass

    @property
    def overwrite_with_gradient(self):
        return False

    @overwrite_with_gradient.setter
    def overwrite_with_gradient(self, value):
        pass

    def numpy(self):
        return ops.convert_to_numpy(self.value)

    def assign(self, value):
        self.owner._write(self, _dense(value))
        return value

    def assign_add(self, value):
        return self.assign(ops.add(self.value, _as_float32(value)))

    def assign_sub(self, value):
        return self.assign(ops.subtract(self.value, _as_float32(value)))

    def __repr__(self):
        return f"<float32 view of {self.weight.path}>"


def _summed_across_replicas(grads):
    """Sums each replica's gradients under a `tf.distribute` strategy.

    Keras' trainer hands the optimizer each replica's local gradients, and
    its TensorFlow optimizer sums them before the update; the wrapper runs
    the update itself, so it sums them here. Every replica then writes the
    same values into its copy of each variable.
    """
    if keras.backend.backend() != "tensorflow":
        return grads
    import tensorflow as tf

    if not tf.distribute.has_strategy() or (
        tf.distribute.in_cross_replica_context()
    ):
        return grads
    context = tf.distribute.get_replica_context()
    if context.num_replicas_in_sync == 1:
        return grads
    return context.all_reduce(tf.distribute.ReduceOp.SUM, list(grads))


def _advance_step_state(inner):
    """Runs what the inner optimizer updates once a step, before the
    per-variable updates (which the wrapper runs itself).

    Of Keras' optimizers only Nadam has such state: the product of its
    momentum schedule, `u_product *= beta_1 * (1 - 0.5 * 0.96**(t + 1))`.
    """
    if not isinstance(inner, keras.optimizers.Nadam):
        return
    step = ops.cast(inner.iterations + 1, "float32")
    factor = inner.beta_1 * (1.0 - 0.5 * ops.power(0.96, step))
    product = ops.cast(inner._u_product, "float32")
    inner.assign(inner._u_product, ops.multiply(product, factor))


def _dense(value):
    """A tensor of `value`; TensorFlow's `IndexedSlices` become dense."""
    return ops.convert_to_tensor(value)


def _as_float32(value):
    return ops.cast(_dense(value), "float32")


def _route_writes(inner, wrapper):
    """Routes the inner optimizer's writes to views and rounded slots.

    Only this instance's `assign`, `assign_add`, `assign_sub` (and, for
    TensorFlow, `_var_key`, which would read a view's value) are replaced.
    """
    # A flag, not the wrapper: saving walks the optimizer's attributes.
    if getattr(inner, "_writes_routed", False):
        return
    inner._writes_routed = True
    inner_class = type(inner)
    targets = wrapper._targets

    def written(self, variable, value, combine):
        if isinstance(variable, _Float32View):
            variable.assign(combine(variable.value, _as_float32(value)))
            return True
        slot = targets.rounded_slots.get(id(variable))
        if slot is None:
            return False
        current = ops.cast(slot.value, "float32")
        wrapper._write_slot(slot, combine(current, _as_float32(value)))
        return True

    def assign(self, variable, value):
        if not written(self, variable, value, lambda _, new: new):
            inner_class.assign(self, variable, value)

    def assign_add(self, variable, value):
        if not written(self, variable, value, ops.add):
            inner_class.assign_add(self, variable, value)

    def assign_sub(self, variable, value):
        if not written(self, variable, value, ops.subtract):
            inner_class.assign_sub(self, variable, value)

    def _var_key(self, variable):
        if isinstance(variable, _Float32View):
            return id(variable)
        return inner_class._var_key(self, variable)

    for method in (assign, assign_add, assign_sub, _var_key):
        setattr(inner, method.__name__, types.MethodType(method, inner))


def _slot_name(variable, name):
    return f"{variable.path.replace('/', '_')}_{name}"


def _check_inner_optimizer(inner_optimizer):
    if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
        raise TypeError(
            "LowPrecisionOptimizer goes inside a LossScaleOptimizer, not "
            "around one: wrap the inner optimizer first, then the result "
            "in the LossScaleOptimizer. "
            f"Received: inner_optimizer={inner_optimizer!r}"
        )
    if isinstance(inner_optimizer, LowPrecisionOptimizer):
        raise TypeError(
            "`inner_optimizer` is already a LowPrecisionOptimizer. "
            f"Received: inner_optimizer={inner_optimizer!r}"
        )
    if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            "`inner_optimizer` must be a keras.optimizers.Optimizer "
            f"instance. Received: inner_optimizer={inner_optimizer!r} "
            f"(of type {type(inner_optimizer).__name__})"
        )
    if inner_optimizer.use_ema:
        raise ValueError(
            "LowPrecisionOptimizer does not support an inner optimizer with "
            "`use_ema=True`. Received: inner_optimizer with use_ema=True"
        )
    if inner_optimizer.gradient_accumulation_steps:
        raise ValueError(
            "LowPrecisionOptimizer does not support an inner optimizer with "
            "`gradient_accumulation_steps`. Received: "
            "gradient_accumulation_steps="
            f"{inner_optimizer.gradient_accumulation_steps!r}"
        )
    if inner_optimizer.built:
        raise ValueError(
            "`inner_optimizer` must not be built yet: the wrapper builds it "
            "on float32 views of low-precision weights. "
            f"Received: inner_optimizer={inner_optimizer!r} (built)"
        )


def _check_update(update):
    if not isinstance(update, str):
        raise TypeError(
            f"`update` must be one of {', '.join(map(repr, UPDATES))}. "
            f"Received: update={update!r} (of type {type(update).__name__})"
        )
    if update not in UPDATES:
        raise ValueError(
            f"`update` must be one of {', '.join(map(repr, UPDATES))}. "
            f"Received: update={update!r}"
        )
    return update


def _check_state_dtype(state_dtype):
    if state_dtype is None:
        return None
    expected = "None, 'float32', 'bfloat16' or 'float16'"
    if not isinstance(state_dtype, str):
        raise TypeError(
            f"`state_dtype` must be {expected}. "
            f"Received: state_dtype={state_dtype!r} "
            f"(of type {type(state_dtype).__name__})"
        )
    try:
        standard = keras.backend.standardize_dtype(state_dtype)
    except (TypeError, ValueError, AttributeError):
        standard = None
    if standard not in STATE_DTYPES:
        raise ValueError(
            f"`state_dtype` must be {expected}. "
            f"Received: state_dtype={state_dtype!r} "
            f"(of type {type(state_dtype).__name__})"
        )
    return standard


def _check_seed(seed):
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(
            "`seed` must be an int or None. "
            f"Received: seed={seed!r} (of type {type(seed).__name__})"
        )
    return seed
