"""Putting precision rules to work: a scope, and rebuilding a model.

`precision_scope` gives the layers created inside it their policy from the
rules (through the `Layer.__init__` patch in `patches.py`, which calls
`on_layer_created`). `apply_rules` and `rebuild` make a new model from a
built one, every layer's policy chosen anew and the weights copied (cast
where a variable's dtype changes).

Rules that match on a layer's path (`PrecisionRule(paths=...)`) need the
path of a layer while it is created, before it has a place in the model:
`rebuild` then builds the copy twice, and the first copy tells, for each
layer in the order they are created, its path.
"""

import contextlib
import copy
import inspect
import threading
from collections.abc import Iterator
from typing import NamedTuple

import keras
import numpy as np

from keras_dtype_policy.policies import float8
from keras_dtype_policy.policies import layer_walk
from keras_dtype_policy.policies import precision_rules

_state = threading.local()


def _choosers():
    if not hasattr(_state, "choosers"):
        _state.choosers = []
    return _state.choosers


# Keras' `Layer.__init__` arguments; Keras reads the signature of
# `__init__` to record a layer's config, so the replacement keeps it.
_LAYER_INIT_ARGUMENTS = (
    "self",
    "activity_regularizer",
    "trainable",
    "dtype",
    "autocast",
    "name",
    "kwargs",
)


def make_layer_init(original):
    """Returns `Layer.__init__` that lets an active scope pick the policy,
    and gives a layer that cannot train in float8 the source policy of the
    float8 policy it was given (`float8.settle_layer_policy`)."""
    found = tuple(inspect.signature(original).parameters)
    if found != _LAYER_INIT_ARGUMENTS:
        raise RuntimeError(
            "keras_dtype_policy cannot patch Layer.__init__: its arguments "
            f"are now {found}, not {_LAYER_INIT_ARGUMENTS}. Please report "
            "this."
        )

    def __init__(
        self,
        *,
        activity_regularizer=None,
        trainable=True,
        dtype=None,
        autocast=True,
        name=None,
        **kwargs,
    ):
        original(
            self,
            activity_regularizer=activity_regularizer,
            trainable=trainable,
            dtype=dtype,
            autocast=autocast,
            name=name,
            **kwargs,
        )
        choosers = _choosers()
        if choosers:
            on_layer_created(self, dtype, choosers[-1])
        float8.settle_layer_policy(self)

    __init__.__doc__ = original.__doc__
    return __init__


def on_layer_created(layer, requested_dtype, chooser):
    """Gives a new layer the policy that the active chooser picks."""
    if isinstance(layer, keras.layers.InputLayer):
        return
    policy = chooser(layer, requested_dtype)
    if policy is not None:
        layer._dtype_policy = policy


@contextlib.contextmanager
def _choosing(chooser):
    choosers = _choosers()
    choosers.append(chooser)
    try:
        yield
    finally:
        choosers.pop()


@contextlib.contextmanager
def precision_scope(
    rules: precision_rules.PrecisionRules | str | keras.DTypePolicy,
) -> Iterator[precision_rules.PrecisionRules]:
    """Layers created in this block get their policy from `rules`.

    Layers given a `dtype` explicitly keep it (except the policy a model
    under a float8 policy hands to the layers it makes). Outside the block,
    layers get the global policy again.

    Args:
        rules: A `PrecisionRules`, or a policy name for rules with no
            exceptions.

    Example:

    >>> with keras_dtype_policy.precision_scope(
    ...     keras_dtype_policy.float16_rules()
    ... ):
    ...     model = keras.Sequential(
    ...         [keras.Input((4,)), keras.layers.Dense(3, name="logits")]
    ...     )
    >>> model.layers[-1].dtype_policy.name
    'float32'
    """
    rules = _as_rules(rules)

    def chooser(layer, requested_dtype):
        # A float8 policy's source passed down is a model handing its own
        # policy to the layers it makes (keras-hub does), not a choice.
        if requested_dtype is not None and not isinstance(
            requested_dtype, float8.Float8SourcePolicy
        ):
            return None
        return rules.policy_for(layer)

    with _choosing(chooser):
        yield rules


def apply_rules(
    model: keras.Model,
    rules: precision_rules.PrecisionRules | str | keras.DTypePolicy,
    keep_float32: bool = True,
) -> keras.Model:
    """Returns a copy of `model` whose layers carry the rules' policies.

    The copy has the same architecture and weights (cast where a
    variable's dtype changes). Functional and Sequential models are
    rebuilt from their configs; a subclassed model needs `get_config`
    (Keras writes one when its constructor's arguments are plain values)
    and gets its sublayers' policies as they are created again. A compiled
    model is compiled again from its compile config, with a new optimizer.
    A subclassed model's per-layer policies live in its code, not in its
    config: after saving, load it with `keras_dtype_policy.load_model(path,
    rules=...)` (or inside `precision_scope`) to have them again.

    Args:
        model: A built `keras.Model`.
        rules: A `PrecisionRules`, or a policy name for every layer.
        keep_float32: Keep the layers that `model` pins to float32 (those
            computing in float32 while others do not) in float32.

    Returns:
        A new `keras.Model`.
    """
    rules = _as_rules(rules)
    _check_model(model)
    return rebuild(
        model,
        rules_chooser(model, rules, keep_float32),
        with_paths=rules.uses_paths,
    )


def rules_chooser(model, rules, keep_float32=True):
    """Returns the chooser that `rebuild` needs to apply `rules`."""
    pinned = keep_float32 and float32_is_pinned(model)

    def chooser(layer, requested_dtype, path=None):
        current = layer.dtype_policy
        if pinned and current.compute_dtype == "float32":
            return None
        return rules.policy_for(layer, path)

    return chooser


def float32_is_pinned(model):
    """True if some of `model`'s layers compute in a dtype other than
    float32: its float32 layers are then pinned there on purpose."""
    return any(
        layer.dtype_policy.compute_dtype != "float32"
        for layer in layer_walk.leaf_layers(model)
    )


def rebuild(model, chooser, with_paths=False, compile_again=True):
    """Returns a copy of `model` with each layer's policy from `chooser`.

    A functional model in the copy (a keras-hub backbone or task too)
    casts no input with its own policy, and keras-hub's set theirs from
    their config after their layers are made: each ends with the policy
    `chooser` gives it, or where that is None the one most of its leaf
    layers have, so that it reports what its layers compute in.

    Args:
        model: A built `keras.Model`.
        chooser: `chooser(layer, requested_dtype, path)` returns the policy
            of a newly created layer (its policy is still the one the
            config gives), or None to keep that. `path` is the layer's
            path in the copy (see `layer_walk.layer_paths`) with
            `with_paths`, else None.
        with_paths: Whether `chooser` needs paths (the copy is then built
            twice).
        compile_again: Whether a compiled `model`'s copy is compiled from
            its compile config (else it is left uncompiled).

    Returns:
        A new `keras.Model`, with `model`'s weights.
    """
    _check_model(model)
    config = keras.saving.serialize_keras_object(model)
    config.pop("compile_config", None)
    paths = _creation_paths(model, config) if with_paths else None
    created = []
    choices = {}

    def choose(layer, dtype):
        path = None
        if paths is not None:
            path = _path_of_created(model, paths, len(created), layer)
        created.append(layer)
        choices[id(layer)] = chooser(layer, dtype, path)
        return choices[id(layer)]

    with _choosing(choose):
        new = _deserialize(model, config)
    _copy_weights(model, new)
    _set_container_policies(new, choices)
    compiled = model.compiled and compile_again
    compile_config = model.get_compile_config() if compiled else None
    if compile_config:
        new.compile_from_config(_without_needless_scaling(compile_config, new))
    return new


def _deserialize(model, config):
    # Some from_config methods (keras-hub's tasks) write into the config.
    new = keras.saving.deserialize_keras_object(copy.deepcopy(config))
    if not new.built:
        raise ValueError(
            f"The copy of model {model.name!r} could not be built from its "
            "config; build it with known input shapes first"
        )
    return new


class CreatedLayer(NamedTuple):
    """A layer a copy of a model creates: its class, and its path.

    Attributes:
        layer_class: The layer's class.
        path: The path of its counterpart in the model, or None for a
            layer the copy does not hold.
    """

    layer_class: type
    path: str | None


def _creation_paths(model, config):
    """Returns a `CreatedLayer` per layer, in the order a copy of `model`
    creates them.

    The path is the one the layer's counterpart has in `model` (a layer
    that Keras names as it creates it gets another name in each copy), or
    None for a layer the copy does not hold.
    """
    created = []

    def record(layer, dtype):
        created.append(layer)

    with _choosing(record):
        copy = _deserialize(model, config)
    paths = {
        id(layer): path
        for layer, path in zip_layer_paths(copy, model, "rules with `paths`")
    }
    return [
        CreatedLayer(type(layer), paths.get(id(layer))) for layer in created
    ]


def zip_layer_paths(copy, model, purpose):
    """Returns `(layer of copy, path in model)` for each layer of a copy.

    Args:
        copy: A copy of `model` built from its config.
        model: The model whose paths name the layers.
        purpose: What needs the pairs, for the error.

    Raises:
        RuntimeError: if the copy holds other layers than `model`.
    """
    ours = layer_walk.layer_paths(model)
    theirs = layer_walk.layer_paths(copy)
    classes = [type(layer) for _, layer in ours]
    if classes != [type(layer) for _, layer in theirs]:
        raise RuntimeError(
            f"A copy of model {model.name!r} built from its config holds "
            f"other layers than the model ({len(theirs)} instead of "
            f"{len(ours)}, or in another order): {purpose} cannot be "
            "matched to its layers"
        )
    return [
        (layer, path)
        for (_, layer), (path, _) in zip(theirs, ours, strict=True)
    ]


def _path_of_created(model, paths, index, layer):
    if index >= len(paths) or paths[index].layer_class is not type(layer):
        raise RuntimeError(
            f"Model {model.name!r} creates its layers in another order each "
            "time it is built from its config, so rules with `paths` cannot "
            f"be applied to it (layer {index} is {layer.name!r})"
        )
    return paths[index].path


def _set_container_policies(model, choices):
    """Gives each functional model in `model` (itself included) the policy
    chosen for it, or where none was the one most of its leaves have.

    A functional model converts its inputs to its `Input`s' dtypes, not
    with its own policy, so its policy changes no computation; keras-hub
    backbones and tasks set theirs from their config after their layers
    are made, and would keep reporting the old one.
    """
    containers = [model] + [layer for _, layer in layer_walk.layer_paths(model)]
    for container in containers:
        if not _is_functional(container):
            continue
        chosen = choices.get(id(container))
        if chosen is not None:
            container._dtype_policy = float8.policy_for_layer(chosen, container)
            continue
        leaves = [
            layer
            for path, layer in layer_walk.layer_paths(container)
            if layer_walk.is_leaf(layer)
        ]
        if not leaves:
            continue
        counts = {}
        for leaf in leaves:
            # A model cannot train in float8: float8 leaves count as their
            # source policy.
            policy = float8.policy_for_layer(leaf.dtype_policy, container)
            count = counts.setdefault(policy.name, [0, policy])
            count[0] += 1
            if isinstance(policy, float8.Float8SourcePolicy):
                count[1] = policy  # the source that remembers float8
        _, (_, policy) = max(counts.items(), key=lambda item: item[1][0])
        container._dtype_policy = policy


def _is_functional(layer):
    """True for a functional model (Keras' own class, or a subclass such
    as keras-hub's): one that does not cast its inputs with its policy."""
    return isinstance(layer, keras.Model) and not getattr(
        layer, "_convert_input_args", True
    )


def _without_needless_scaling(compile_config, model):
    """Drops a saved loss-scale wrapper where no layer computes in float16
    any more; the compile hook adds one again where one does."""
    optimizer = compile_config.get("optimizer")
    if not isinstance(optimizer, dict):
        return compile_config
    inner = (optimizer.get("config") or {}).get("inner_optimizer")
    if optimizer.get("class_name") != "LossScaleOptimizer" or not inner:
        return compile_config
    if any(
        layer.compute_dtype == "float16"
        for layer in layer_walk.leaf_layers(model)
    ):
        return compile_config
    return {**compile_config, "optimizer": inner}


def _check_model(model):
    if not isinstance(model, keras.Model):
        raise TypeError(
            "`model` must be a keras.Model. "
            f"Received: model={model!r} (of type {type(model).__name__})"
        )
    if not model.built:
        raise ValueError(
            f"`model` must be built, to have weights to keep. Received: "
            f"model={model.name!r}, not built"
        )


def _copy_weights(old, new):
    old_weights = old.weights
    new_weights = new.weights
    if len(old_weights) == len(new_weights):
        pairs = zip(old_weights, new_weights, strict=True)
    else:
        pairs = _pairs_by_layer(old, new)
    for source, target in pairs:
        value = keras.ops.convert_to_numpy(source.value)
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(
                f"The copy of model {old.name!r} differs from it: weight "
                f"{target.path} has shape {tuple(target.shape)}, the "
                f"original's {source.path} {tuple(value.shape)}"
            )
        if target.dtype != source.dtype:
            value = _cast_checked(value, target)
        target.assign(value)


def _pairs_by_layer(old, new):
    """Pairs the weights of two copies layer by layer, by name.

    Where a layer trains in float8 in one copy only, it has float8 scaling
    state there (variables overwritten with their gradient, such as
    `inputs_scale`): the new copy's starts at Keras' initial values, the
    old copy's is left behind. Any other difference is an error.
    """
    old_layers = layer_walk.layer_paths(old)
    new_layers = layer_walk.layer_paths(new)
    if [type(layer) for _, layer in old_layers] != [
        type(layer) for _, layer in new_layers
    ]:
        raise ValueError(
            f"The copy of model {old.name!r} holds other layers than the "
            "model; it cannot take its weights"
        )
    layers = [(old, new)] + [
        (old_layer, new_layer)
        for (_, old_layer), (_, new_layer) in zip(
            old_layers, new_layers, strict=True
        )
    ]
    pairs = []
    for old_layer, new_layer in layers:
        old_own = {v.name: v for v in layer_walk.own_weights(old_layer)}
        new_own = {v.name: v for v in layer_walk.own_weights(new_layer)}
        for name, target in new_own.items():
            if name in old_own:
                pairs.append((old_own[name], target))
            elif not _is_float8_scaling_state(target):
                raise ValueError(
                    f"The copy of model {old.name!r} has weight "
                    f"{target.path}, which the original lacks; it cannot "
                    "take its weights"
                )
        for name, source in old_own.items():
            if name not in new_own and not _is_float8_scaling_state(source):
                raise ValueError(
                    f"The copy of model {old.name!r} lacks the original's "
                    f"weight {source.path}; it cannot take its weights"
                )
    return pairs


def _is_float8_scaling_state(variable):
    return bool(getattr(variable, "overwrite_with_gradient", False))


def _cast_checked(value, variable):
    """Casts a weight's value, refusing values the new dtype cannot hold."""
    dtype = keras.backend.standardize_dtype(variable.dtype)
    if not keras.backend.is_float_dtype(dtype):
        return value
    with np.errstate(over="ignore"):
        cast = value.astype(_numpy_dtype(dtype))
    finite = np.isfinite(value)
    if np.any(finite & ~np.isfinite(cast.astype("float32"))):
        raise ValueError(
            f"Weight {variable.path} has values beyond the range of "
            f"{dtype} (largest |value| {np.max(np.abs(value)):.4g}); keep "
            "its layer's variables in float32 (a mixed policy)"
        )
    return cast


def _numpy_dtype(dtype):
    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(dtype)


def _as_rules(rules):
    if isinstance(rules, precision_rules.PrecisionRules):
        return rules
    if isinstance(rules, (str, keras.DTypePolicy)):
        return precision_rules.PrecisionRules(rules)
    raise TypeError(
        "`rules` must be a PrecisionRules or a policy name. "
        f"Received: rules={rules!r} (of type {type(rules).__name__})"
    )
