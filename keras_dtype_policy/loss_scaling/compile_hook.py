"""The compile hook: which loss-scale optimizer a model's policy asks for."""

import functools
import inspect
import warnings

import keras

from keras_dtype_policy.loss_scaling import state_arrival
from keras_dtype_policy.loss_scaling import tf_replicas
from keras_dtype_policy.loss_scaling.loss_scale import DynamicLossScale
from keras_dtype_policy.loss_scaling.loss_scale import FixedLossScale
from keras_dtype_policy.loss_scaling.optimizer import LossScaleOptimizer
from keras_dtype_policy.loss_scaling.optimizer import release_inner_optimizer
from keras_dtype_policy.low_precision import multi_optimizers
from keras_dtype_policy.low_precision import state_sharding
from keras_dtype_policy.low_precision.optimizer import LowPrecisionOptimizer
from keras_dtype_policy.policies import layer_walk
from keras_dtype_policy.policies import names as policy_names

# Returned by `loss_scale_for_model` when the policy does not say.
_UNSPECIFIED = object()


def loss_scale_for_model(model):
    """Returns the loss scale that compiling `model` should install.

    A policy that carries its own `loss_scale` (the tf.keras `Policy`) gets
    that scale, which may be None. Otherwise a model whose policy, or any of
    whose layers' policies (layers inside custom layers included, see
    `layer_walk`), computes in float16 gets a `DynamicLossScale` with
    Keras' defaults; any other model gets None.

    Args:
        model: A Keras model.

    Returns:
        A loss-scale value, or None for no loss scaling.
    """
    loss_scale = _policy_loss_scale(model)
    if loss_scale is not _UNSPECIFIED:
        return loss_scale
    if any(_computes_float16(p) for p in _policies_in(model)):
        return DynamicLossScale()
    return None


def wrap_optimizer(optimizer, loss_scale):
    """Wraps `optimizer` in the `LossScaleOptimizer` that `loss_scale` asks.

    Args:
        optimizer: A `keras.optimizers.Optimizer`.
        loss_scale: A loss-scale value, or None.

    Returns:
        The wrapped optimizer, or `optimizer` itself for no loss scale.
    """
    if loss_scale is None:
        return optimizer
    release_inner_optimizer(optimizer)
    if loss_scale.dynamic:
        return LossScaleOptimizer(
            optimizer,
            initial_scale=loss_scale.initial_scale,
            dynamic_growth_steps=loss_scale.increment_period,
            growth_factor=loss_scale.multiplier,
            backoff_factor=1.0 / loss_scale.multiplier,
            min_scale=min(1.0, loss_scale.initial_scale),
            # A policy may start above the default ceiling (tf.keras had
            # none): the ceiling rises to fit.
            max_scale=max(2.0**24, loss_scale.initial_scale),
            hysteresis=getattr(loss_scale, "hysteresis", 1),
            name="loss_scale_optimizer",
        )
    return LossScaleOptimizer(
        optimizer,
        dynamic=False,
        initial_scale=loss_scale.initial_scale,
        name="loss_scale_optimizer",
    )


def choose_optimizers(model, optimizer):
    """Returns the optimizer to use, and the one the compile config names.

    An optimizer's own `loss_scale_factor` is the user's choice of a fixed
    scale: where the model asks for loss scaling it becomes the fixed scale
    of the `LossScaleOptimizer` (with its finiteness check), instead of
    being dropped for a dynamic scale. A policy's own loss scale that
    differs from it gives way, with a warning.

    Where the wrapping follows from the model alone (the float16 rule, or
    the optimizer's own `loss_scale_factor`), the compile config names the
    user's optimizer, as with Keras' own wrapping: loading the model wraps
    it again, and Keras alone can read the file (see `README.md`).

    A Keras `MultiOptimizer` is wrapped per sub-optimizer under a
    low-precision update policy (see `multi_optimizers.route`), and whole
    in a `LossScaleOptimizer` where the model asks for loss scaling.

    Args:
        model: The model being compiled.
        optimizer: What was passed to `compile` as `optimizer`.

    Returns:
        A pair: the optimizer to train with, and the optimizer to record
        in the model's compile config.
    """
    if optimizer is None:
        return None, None
    optimizer = keras.optimizers.get(optimizer)
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer, optimizer
    multi = multi_optimizers.is_multi_optimizer(optimizer)
    if multi:
        # Those Keras would refuse at the first step, refused now.
        multi_optimizers.check_sub_optimizers(
            optimizer, model.trainable_variables if model.built else ()
        )
    update = low_precision_update_for_model(model)
    if update is None or isinstance(optimizer, LowPrecisionOptimizer):
        return _choose_loss_scaling(model, optimizer)
    if multi:
        wrapped = _route_low_precision(model, optimizer, update)
    else:
        wrapped = wrap_low_precision(optimizer, *update)
    training, recorded = _choose_loss_scaling(model, wrapped)
    # The policy is saved with the model, and wraps again on loading.
    return training, optimizer if recorded is wrapped else recorded


def low_precision_update_for_model(model):
    """Returns what `LowPrecisionOptimizer` a model's policies ask for.

    A model whose policy, or any of whose layers' policies, is one of the
    low-precision update policies (such as `"kahan_bfloat16"`) asks for one;
    a plain `"bfloat16"` or `"float16"` policy does not.

    Args:
        model: A Keras model.

    Returns:
        A triple `(update, weight_dtype, state_dtype)`, such as
        `("kahan", "bfloat16", None)` or
        `("stochastic_rounding", "bfloat16", "8bit")`, or None.
    """
    for policy in _policies_in(model):
        policies = [policy]
        if isinstance(policy, keras.dtype_policies.DTypePolicyMap):
            policies = [policy.default_policy, *policy.values()]
        for each in policies:
            entry = policy_names.LOW_PRECISION_UPDATE_POLICIES.get(each.name)
            if entry is not None:
                weight_dtype, update, state_dtype = entry
                return update, weight_dtype, state_dtype
    return None


def wrap_low_precision(optimizer, update, weight_dtype, state_dtype=None):
    """Wraps `optimizer` in the `LowPrecisionOptimizer` a policy asks for.

    A policy's own state dtype (`"8bit"` or `"4bit"`) is used as it is.
    Otherwise, under float16 weights the optimizer state is kept in
    float32: a float16 second moment underflows for small gradients (see
    `LowPrecisionOptimizer`). Under bfloat16 weights the state is bfloat16,
    as Keras keeps it.
    """
    if state_dtype is None and weight_dtype == "float16":
        state_dtype = "float32"
    return LowPrecisionOptimizer(
        optimizer, update=update, state_dtype=state_dtype
    )


def _route_low_precision(model, multi, update):
    """A MultiOptimizer's sub-optimizers wrapped as a lone optimizer would
    be under the policy (see `wrap_low_precision`); those already in a
    `LowPrecisionOptimizer` stay as they are."""

    def wrap(sub):
        if isinstance(sub, LowPrecisionOptimizer):
            return sub
        return wrap_low_precision(sub, *update)

    if multi.built and all(
        isinstance(sub, LowPrecisionOptimizer) for sub in multi.optimizers
    ):
        return multi  # trained, and wrapped already: compiled again
    variables = model.trainable_variables if model.built else ()
    routed = multi_optimizers.route(multi, wrap, variables)
    if routed is not multi and state_sharding.shards_state(multi):
        state_sharding.shard_optimizer_state(routed)
    return routed


def _choose_loss_scaling(model, optimizer):
    """`choose_optimizers` for an optimizer that is not loss-scaled yet."""
    if state_arrival.state_may_arrive():
        state_arrival.teach_tf_keras_layout(optimizer)
    loss_scale = loss_scale_for_model(model)
    from_policy = _policy_loss_scale(model) is not _UNSPECIFIED
    factor = getattr(optimizer, "loss_scale_factor", None)
    if loss_scale is None or factor is None:
        wrapped = wrap_optimizer(optimizer, loss_scale)
        # A policy's loss scale is not saved with the policy: the file
        # names the wrapper then, to come back with the same scale.
        return wrapped, wrapped if from_policy else optimizer
    if from_policy and loss_scale != FixedLossScale(factor):
        warnings.warn(
            f"The optimizer's loss_scale_factor={factor!r} is used as a "
            f"fixed loss scale; the policy's loss_scale={loss_scale!r} is "
            "not. Pass an optimizer without loss_scale_factor to use the "
            "policy's.",
            stacklevel=3,
        )
    recorded = _copy_optimizer(optimizer)
    wrapped = wrap_optimizer(optimizer, FixedLossScale(factor))
    return wrapped, recorded or wrapped


def make_hooked_compile(original_compile):
    """Returns Keras' `Trainer.compile` with the loss-scale decision ours.

    Args:
        original_compile: Keras' own `Trainer.compile`.

    Returns:
        A function with the same signature. With `auto_scale_loss=True` (the
        default) it wraps the optimizer as `choose_optimizers` says, then
        calls Keras' compile with `auto_scale_loss=False`, so Keras' own rule
        (the exact name "mixed_float16") never wraps a second time. Under a
        `tf.distribute` strategy with several replicas, a loss-scaled model
        asked for `jit_compile=True` compiles without XLA, with a warning,
        since Keras' XLA step crashes there.
    """
    signature = inspect.signature(original_compile)
    default_optimizer = signature.parameters["optimizer"].default

    @functools.wraps(original_compile)
    def compile(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        arguments = bound.arguments
        recorded = None
        if arguments.get("auto_scale_loss", True):
            arguments["optimizer"], recorded = choose_optimizers(
                self, arguments.get("optimizer", default_optimizer)
            )
        arguments["auto_scale_loss"] = False
        if (
            arguments.get("jit_compile") is True
            and isinstance(
                arguments.get("optimizer"),
                keras.optimizers.LossScaleOptimizer,
            )
            and tf_replicas.spans_replicas(self)
        ):
            tf_replicas.warn_xla_unsupported(self)
            arguments["jit_compile"] = False
        result = original_compile(*bound.args, **bound.kwargs)
        if recorded is not None and recorded is not arguments["optimizer"]:
            self._compile_config.config["optimizer"] = recorded
        return result

    return compile


def _policy_loss_scale(model):
    return getattr(model.dtype_policy, "loss_scale", _UNSPECIFIED)


def _copy_optimizer(optimizer):
    """A new optimizer with `optimizer`'s config, or None if none can be
    made (the compile config then names the wrapper)."""
    try:
        return type(optimizer).from_config(optimizer.get_config())
    except Exception:
        return None


def _policies_in(model):
    yield model.dtype_policy
    # `dtype_policy` resolves a DTypePolicyMap to the model's own entry; the
    # map itself may hold float16 entries for the layers.
    raw_policy = getattr(model, "_dtype_policy", None)
    if isinstance(raw_policy, keras.dtype_policies.DTypePolicyMap):
        yield raw_policy
    for layer in layer_walk.all_layers(model, include_inputs=True):
        yield layer.dtype_policy


def _computes_float16(policy):
    if isinstance(policy, keras.dtype_policies.DTypePolicyMap):
        policies = [policy.default_policy, *policy.values()]
        return any(_computes_float16(p) for p in policies)
    return policy.compute_dtype == "float16"
