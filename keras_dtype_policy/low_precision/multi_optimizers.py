"""Keras' `MultiOptimizer` under the package's policies and wrappers.

Keras 3.15's `MultiOptimizer` hands each variable to the sub-optimizer
that its `OptimizerMap` (a regex on the variable's path) or its callable
picks. The package's wrappers go on the sub-optimizers, never around the
whole: a `LowPrecisionOptimizer` runs one inner optimizer's step on
float32 views, and a MultiOptimizer has no one step (nor one learning
rate). Loss scaling is the other way round: one scale for the one loss of
a step, so a `LossScaleOptimizer` goes around the MultiOptimizer.

`route` is what the compile hook does with a MultiOptimizer under a
low-precision update policy: it wraps each sub-optimizer as the policy
would wrap a lone one, and keeps those already wrapped.
"""

from collections.abc import Callable
from collections.abc import Iterable

import keras


def multi_optimizer_class() -> type | None:
    """Keras' `MultiOptimizer` class, or None before Keras 3.15."""
    return getattr(keras.optimizers, "MultiOptimizer", None)


def is_multi_optimizer(optimizer: object) -> bool:
    """True if `optimizer` is a Keras `MultiOptimizer`."""
    cls = multi_optimizer_class()
    return cls is not None and isinstance(optimizer, cls)


def sub_optimizers(optimizer: object) -> list:
    """The sub-optimizers of a MultiOptimizer known so far (those of its
    `OptimizerMap`, or those its callable returned while building), or
    an empty list for any other optimizer."""
    if not is_multi_optimizer(optimizer):
        return []
    return list(getattr(optimizer, "optimizers", ()))


def check_sub_optimizers(
    optimizer: keras.optimizers.Optimizer, variables: Iterable | None = None
) -> None:
    """Raises where a MultiOptimizer holds a `LossScaleOptimizer`.

    Keras refuses one too, but only once the step builds, and without
    saying where loss scaling goes instead.

    Args:
        optimizer: A Keras `MultiOptimizer`.
        variables: None to check every sub-optimizer its `OptimizerMap`
            names; else only those it gives these variables (those Keras
            would refuse at `build`).
    """
    subs = _mapped(optimizer) if variables is None else []
    selector = getattr(optimizer, "_optimizer_map", None)
    if variables is not None and isinstance(
        selector, keras.optimizers.OptimizerMap
    ):
        subs = [selector(variable) for variable in variables]
    for sub in subs:
        if isinstance(sub, keras.optimizers.LossScaleOptimizer):
            raise ValueError(
                "A LossScaleOptimizer goes around a MultiOptimizer, not "
                "inside it: the loss of a step has one scale. Put the plain "
                "(or LowPrecisionOptimizer) sub-optimizers in the "
                "OptimizerMap and compile under a float16 policy, which "
                "wraps the MultiOptimizer, or wrap it yourself: "
                "LossScaleOptimizer(MultiOptimizer(...)). "
                f"Received: a MultiOptimizer holding {sub!r}"
            )


def route(
    multi: keras.optimizers.Optimizer,
    wrap: Callable[[keras.optimizers.Optimizer], keras.optimizers.Optimizer],
    variables: Iterable = (),
) -> keras.optimizers.Optimizer:
    """Returns `multi` with `wrap` applied to each sub-optimizer.

    Args:
        multi: A Keras `MultiOptimizer`, not built.
        wrap: A function from a sub-optimizer to the optimizer to train it
            with (the sub-optimizer itself where nothing changes). Called
            once per sub-optimizer, however many keys map to it.
        variables: The variables the optimizer will train, where known:
            a callable picks their sub-optimizers now, so that they are
            wrapped outside the compiled step (TensorFlow builds the
            optimizer inside it).

    Returns:
        `multi` itself where `wrap` changes nothing; else a new
        MultiOptimizer of the same class, name and `loss_scale_factor`,
        whose map sends each variable to the wrapped sub-optimizer.

    Raises:
        ValueError: If `multi` holds a `LossScaleOptimizer`, or is built
            already (its sub-optimizers cannot be wrapped then).
    """
    check_sub_optimizers(multi)
    if multi.built:
        raise ValueError(
            "A MultiOptimizer that has already trained cannot get the "
            "wrappers the policy asks for around its sub-optimizers: "
            "compile with a new MultiOptimizer, or wrap each sub-optimizer "
            "in a LowPrecisionOptimizer before training. "
            f"Received: optimizer={multi.name!r} (built)"
        )
    wrapped: dict[int, keras.optimizers.Optimizer] = {}
    routed = _once_each(wrap, wrapped)
    selector = multi._optimizer_map
    if isinstance(selector, keras.optimizers.OptimizerMap):
        new_selector = _mapped_with(selector, routed)
        if all(wrapped[key] is sub for key, sub in _by_id(selector)):
            return multi
    else:
        new_selector = _RoutedSelector(selector, routed)
        for variable in variables:
            new_selector(variable)
    return type(multi)(
        new_selector, loss_scale_factor=multi.loss_scale_factor, name=multi.name
    )


def with_sub_optimizers(
    multi: keras.optimizers.Optimizer,
    make: Callable[[keras.optimizers.Optimizer], keras.optimizers.Optimizer],
) -> keras.optimizers.Optimizer:
    """Returns a new MultiOptimizer whose map sends each key to `make`
    of its sub-optimizer (called once per sub-optimizer), in the same
    order, with `multi`'s class, name and `loss_scale_factor`.

    Raises:
        ValueError: If `multi` picks its sub-optimizers with a callable
            instead of an `OptimizerMap` (a callable cannot be rewritten).
    """
    selector = multi._optimizer_map
    if not isinstance(selector, keras.optimizers.OptimizerMap):
        raise ValueError(
            "Only a MultiOptimizer with a keras.optimizers.OptimizerMap can "
            "have its sub-optimizers replaced; this one picks them with "
            f"{selector!r}. Received: optimizer={multi.name!r}"
        )
    return type(multi)(
        _mapped_with(selector, _once_each(make, {})),
        loss_scale_factor=multi.loss_scale_factor,
        name=multi.name,
    )


def _once_each(make, made):
    """`make`, called once per optimizer (by identity), kept in `made`."""

    def once(sub):
        if id(sub) not in made:
            made[id(sub)] = make(sub)
        return made[id(sub)]

    return once


def _mapped_with(selector, make):
    return keras.optimizers.OptimizerMap(
        make(selector.default_optimizer),
        {key: make(selector[key]) for key in selector},
    )


class _RoutedSelector:
    """A MultiOptimizer's callable with each optimizer it picks wrapped,
    once per optimizer; one answer per variable path, even from a callable
    that makes a new optimizer at each call."""

    def __init__(self, selector, routed):
        self._selector = selector
        self._routed = routed
        self._picked = {}

    def __call__(self, variable):
        path = variable.path
        if path not in self._picked:
            self._picked[path] = self._routed(self._selector(variable))
        return self._picked[path]


def _mapped(optimizer):
    """The sub-optimizers a MultiOptimizer's map names, and those it
    found while building."""
    found = list(sub_optimizers(optimizer))
    selector = getattr(optimizer, "_optimizer_map", None)
    if isinstance(selector, keras.optimizers.OptimizerMap):
        found += [selector.default_optimizer, *selector.values()]
    return found


def _by_id(selector):
    subs = [selector.default_optimizer, *selector.values()]
    return [(id(sub), sub) for sub in subs]
