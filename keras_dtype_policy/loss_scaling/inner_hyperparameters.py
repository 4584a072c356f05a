"""Which attributes of a wrapped optimizer its wrapper passes through, and how.

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
    """Returns the names of the hyperparameters of the optimizer
    `optimizer`, sorted: a tuple such as `("beta_1", "beta_2", ...)`."""
    state = vars(optimizer)
    return tuple(
        sorted(
            name
            for name in _constructor_arguments(type(optimizer))
            if name in state and not isinstance(state[name], (bool, str))
        )
    )


@functools.cache
def _constructor_arguments(optimizer_class):
    """The keyword arguments of every optimizer constructor in the MRO."""
    names = set()
    for klass in optimizer_class.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or not issubclass(klass, keras.optimizers.Optimizer):
            continue
        try:
            parameters = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):
            continue
        names.update(
            p.name
            for p in parameters
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        )
    return frozenset(names - _NOT_HYPERPARAMETERS)


class InnerSetting:
    """A setting of Keras' base optimizer that a wrapper keeps on its inner
    optimizer (`clipnorm`, `use_ema`, ...), so that reading or setting it
    through the wrapper reaches the optimizer that applies the step."""

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


class ForwardsHyperparameters:
    """Passes a wrapper's hyperparameters through to `inner_optimizer`.

    Both ways, as tf.keras 2's wrapper did: `opt.beta_1 = 0.7` sets the
    inner optimizer's `beta_1`, the value its next step uses. A mixin; the
    class names the attributes it keeps for itself in `_wrapper_names`.
    """

    _wrapper_names: frozenset[str] = frozenset()

    use_ema = InnerSetting()
    ema_momentum = InnerSetting()
    ema_overwrite_frequency = InnerSetting()
    weight_decay = InnerSetting()
    clipnorm = InnerSetting()
    global_clipnorm = InnerSetting()
    clipvalue = InnerSetting()

    def _settings_owner(self):
        """The inner optimizer, or None while the wrapper reads its own
        (Keras' base class does in `__init__`, before there is an inner
        optimizer, and in `build`)."""
        state = self.__dict__
        if state.get("_reading_own_settings"):
            return None
        return state.get("inner_optimizer")

    def _forwarded_to(self, name):
        """Returns the inner optimizer if `name` is its hyperparameter and
        not the wrapper's own attribute, else None."""
        if name.startswith("_") or name in self._wrapper_names:
            return None
        inner = self._settings_owner()
        if inner is None or name in self.__dict__:
            return None
        if any(name in klass.__dict__ for klass in type(self).__mro__):
            return None
        if name not in hyperparameter_names(inner):
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
            names.update(hyperparameter_names(inner))
        return sorted(names)
