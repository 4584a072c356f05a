"""Which attributes of a wrapped optimizer its wrapper passes through.

tf.keras 2's `LossScaleOptimizer` passed reads and writes of the inner
optimizer's hyperparameters through (`opt.beta_1`, `opt.learning_rate`),
and nothing else: `opt.nesterov` raised AttributeError. Keras 3 optimizers
have no hyperparameter registry, so a hyperparameter here is a setting the
optimizer's constructor takes (in its class or a base class) that the
optimizer keeps under the same name, unless the setting is a flag (a bool,
such as `nesterov` or `amsgrad`, which tf.keras 2 also kept out) or a name.
"""

import functools
import inspect

import keras

# Constructor arguments that are no hyperparameters.
_NOT_HYPERPARAMETERS = frozenset(("self", "name", "kwargs", "args"))


def hyperparameter_names(optimizer):
    """Returns the names of `optimizer`'s hyperparameters, sorted.

    Args:
        optimizer: A `keras.optimizers.Optimizer`.

    Returns:
        A tuple of attribute names, such as `("beta_1", "beta_2", ...)`.
    """
    state = vars(optimizer)
    names = []
    for name in _constructor_arguments(type(optimizer)):
        if name not in state:
            continue
        value = state[name]
        if isinstance(value, (bool, str)):
            continue
        names.append(name)
    return tuple(sorted(names))


def is_hyperparameter(optimizer, name):
    """Returns True if `name` is a hyperparameter of `optimizer`."""
    return name in hyperparameter_names(optimizer)


@functools.cache
def _constructor_arguments(optimizer_class):
    """The keyword arguments of every optimizer constructor in the MRO."""
    names = set()
    for klass in optimizer_class.__mro__:
        if not issubclass(klass, keras.optimizers.Optimizer):
            continue
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            parameters = inspect.signature(init).parameters
        except (TypeError, ValueError):
            continue
        for parameter in parameters.values():
            if parameter.kind in (
                parameter.VAR_POSITIONAL,
                parameter.VAR_KEYWORD,
            ):
                continue
            names.add(parameter.name)
    return frozenset(names - _NOT_HYPERPARAMETERS)
