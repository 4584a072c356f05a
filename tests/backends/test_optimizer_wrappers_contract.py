"""One contract for every optimizer wrapper of the package.

Each wrapper, reached only through its public spelling, is built on
variables, applies gradients, survives a `.keras` and a `.weights.h5`
round trip (state equal, next step identical), survives a config round
trip through JSON, forwards `learning_rate` to the optimizer it wraps, and
trains in a compiled `fit` step. A new wrapper joins `WRAPPERS` the day it
exists.
"""

import json
import warnings

import keras
import numpy as np
import pytest
from testing import BACKEND
from testing import to_numpy

import keras_dtype_policy as kdp

pytestmark = pytest.mark.filterwarnings(
    "ignore::keras_dtype_policy.SlowFloat16Warning"
)

# name: (the policy its model trains under, a function making the wrapper).
WRAPPERS = {
    "loss_scale_dynamic": (
        "mixed_float16",
        lambda: kdp.LossScaleOptimizer(
            keras.optimizers.Adam(0.01), dynamic_growth_steps=2
        ),
    ),
    "loss_scale_fixed": (
        "mixed_float16",
        lambda: kdp.LossScaleOptimizer(
            keras.optimizers.SGD(0.01, momentum=0.9),
            dynamic=False,
            initial_scale=128,
        ),
    ),
    "low_precision_kahan": (
        "bfloat16",
        lambda: kdp.LowPrecisionOptimizer(
            keras.optimizers.Adam(0.01), update="kahan"
        ),
    ),
    "low_precision_stochastic": (
        "bfloat16",
        lambda: kdp.LowPrecisionOptimizer(
            keras.optimizers.Adam(0.01), update="stochastic_rounding", seed=3
        ),
    ),
    "experimental_loss_scale": (
        "mixed_float16",
        lambda: kdp.experimental.LossScaleOptimizer(
            keras.optimizers.Adam(0.01), loss_scale="dynamic"
        ),
    ),
    "mixed_precision_loss_scale": (
        "mixed_float16",
        lambda: kdp.mixed_precision.LossScaleOptimizer(
            keras.optimizers.Adam(0.01), initial_scale=256
        ),
    ),
    "loss_scale_of_low_precision": (
        "float16",
        lambda: kdp.LossScaleOptimizer(
            kdp.LowPrecisionOptimizer(keras.optimizers.Adam(0.01))
        ),
    ),
}
NAMES = sorted(WRAPPERS)
# Wrappers that Keras' deserialization (and so `load_model`) revives as
# another class: TensorFlow 2.3's optimizer as the 2.4+ one, as tf.keras
# 2.4+ did. Their own `from_config` keeps the class.
REVIVED_AS = {"experimental_loss_scale": kdp.LossScaleOptimizer}


def revived_type(name, optimizer):
    """The class Keras' deserialization gives back for wrapper `name`."""
    return REVIVED_AS.get(name, type(optimizer))


# Keras compiles jax and TensorFlow steps with XLA when asked; its torch
# backend would hand the step to torch.compile, so on torch the step runs
# eagerly.
JIT_COMPILE = False if BACKEND == "torch" else True


def as_float32(x):
    return to_numpy(keras.ops.cast(x, "float32"))


def innermost(optimizer):
    """The optimizer at the bottom of a stack of wrappers."""
    while hasattr(optimizer, "inner_optimizer"):
        optimizer = optimizer.inner_optimizer
    return optimizer


def data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(16, 4)).astype("float32")
    y = (x @ np.array([[0.5], [-1.0], [2.0], [0.25]])).astype("float32")
    return x, y


def compiled_model(name, jit_compile=False):
    """A tiny Dense model under the wrapper's policy, compiled with it."""
    policy, factory = WRAPPERS[name]
    keras.utils.set_random_seed(0)
    with kdp.policy_scope(policy):
        model = keras.Sequential(
            [
                keras.Input((4,)),
                keras.layers.Dense(8, activation="tanh"),
                keras.layers.Dense(1),
            ]
        )
    optimizer = factory()
    model.compile(optimizer, "mse", jit_compile=jit_compile)
    assert model.optimizer is optimizer
    return model


def fit(model, seed=0, epochs=1):
    x, y = data(seed)
    history = model.fit(
        x, y, batch_size=8, epochs=epochs, verbose=0, shuffle=False
    )
    return history.history["loss"]


def state(model):
    return [as_float32(v) for v in model.weights + model.optimizer.variables]


@pytest.mark.parametrize("name", NAMES)
def test_builds_on_variables(name):
    model = compiled_model(name)
    optimizer = model.optimizer
    optimizer.build(model.trainable_variables)
    assert optimizer.built
    assert int(to_numpy(optimizer.iterations)) == 0
    assert len(optimizer.variables) > 1
    for variable in optimizer.variables:
        assert np.all(np.isfinite(as_float32(variable)))


@pytest.mark.parametrize("name", NAMES)
def test_applies_gradients(name):
    model = compiled_model(name)
    optimizer = model.optimizer
    variables = model.trainable_variables
    before = [as_float32(v) for v in variables]
    gradients = [keras.ops.full(v.shape, 0.5, dtype=v.dtype) for v in variables]
    with warnings.catch_warnings():
        # A loop that never scales its loss gets its gradients as given,
        # with a warning from the loss-scale wrappers.
        warnings.filterwarnings("ignore", "You forgot to call")
        optimizer.apply(gradients, variables)
    after = [as_float32(v) for v in variables]
    for old, new in zip(before, after, strict=True):
        assert np.all(np.isfinite(new))
        assert not np.array_equal(old, new)
    assert int(to_numpy(innermost(optimizer).iterations)) == 1


@pytest.mark.parametrize("file_format", [".keras", ".weights.h5"])
@pytest.mark.parametrize("name", NAMES)
def test_save_and_load_then_the_next_step_is_identical(
    name, file_format, tmp_path
):
    model = compiled_model(name)
    fit(model)
    path = str(tmp_path / f"model{file_format}")
    if file_format == ".keras":
        model.save(path)
        restored = keras.saving.load_model(path)
    else:
        model.save_weights(path)
        restored = compiled_model(name)
        restored.optimizer.build(restored.trainable_variables)
        restored.load_weights(path)
    expected = type(model.optimizer)
    if file_format == ".keras":
        expected = revived_type(name, model.optimizer)
    assert type(restored.optimizer) is expected
    saved = [as_float32(v) for v in model.optimizer.variables]
    loaded = [as_float32(v) for v in restored.optimizer.variables]
    assert len(saved) == len(loaded)
    for a, b in zip(saved, loaded, strict=True):
        np.testing.assert_array_equal(a, b)
    fit(model, seed=1)
    fit(restored, seed=1)
    for a, b in zip(state(model), state(restored), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", NAMES)
def test_config_round_trip_through_json(name):
    optimizer = WRAPPERS[name][1]()
    config = json.loads(json.dumps(optimizer.get_config()))
    revived = type(optimizer).from_config(config)
    assert type(revived) is type(optimizer)
    assert json.loads(json.dumps(revived.get_config())) == config
    serialized = keras.saving.serialize_keras_object(optimizer)
    deserialized = keras.saving.deserialize_keras_object(
        json.loads(json.dumps(serialized))
    )
    assert type(deserialized) is revived_type(name, optimizer)
    assert deserialized.get_config() == optimizer.get_config()


@pytest.mark.parametrize("name", NAMES)
def test_learning_rate_reaches_the_inner_optimizer(name):
    model = compiled_model(name)
    optimizer = model.optimizer
    inner = innermost(optimizer)
    assert float(to_numpy(optimizer.learning_rate)) == pytest.approx(0.01)
    optimizer.learning_rate = 0.05
    assert float(to_numpy(inner.learning_rate)) == pytest.approx(0.05)
    assert float(to_numpy(optimizer.learning_rate)) == pytest.approx(0.05)
    fit(model)
    assert float(to_numpy(inner.learning_rate)) == pytest.approx(0.05)


@pytest.mark.parametrize("name", NAMES)
def test_compiled_fit_trains(name):
    model = compiled_model(name, jit_compile=JIT_COMPILE)
    before = [as_float32(v) for v in model.trainable_variables]
    losses = fit(model, epochs=3)
    assert np.all(np.isfinite(losses))
    assert losses[-1] < losses[0]
    after = [as_float32(v) for v in model.trainable_variables]
    for old, new in zip(before, after, strict=True):
        assert np.all(np.isfinite(new))
        assert not np.array_equal(old, new)
    assert int(to_numpy(innermost(model.optimizer).iterations)) > 0
