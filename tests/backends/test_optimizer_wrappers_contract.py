"""One contract for every optimizer wrapper of the package.

Each wrapper, reached only through its public spelling, is built on
variables, applies gradients, survives a `.keras` and a `.weights.h5`
round trip (state equal, next step identical), survives a config round
trip through JSON, forwards `learning_rate` to the optimizer it wraps, and
trains in a compiled `fit` step. A new wrapper joins `WRAPPERS` the day it
exists; so does each kind of state a wrapper keeps (8-bit and 4-bit
block-coded state, float16 weights, state sharded over the data-parallel
devices), in the style of optax's alias_test.py.
"""

import dataclasses
import json
import warnings
from collections.abc import Callable

import keras
import numpy as np
import pytest
from testing import BACKEND
from testing import dtype_of
from testing import inner_optimizers
from testing import to_numpy

import keras_dtype_policy as kdp
from keras_dtype_policy.low_precision import state_sharding

pytestmark = pytest.mark.filterwarnings(
    "ignore::keras_dtype_policy.SlowFloat16Warning"
)


@dataclasses.dataclass(frozen=True)
class Wrapper:
    """One row of the contract.

    Attributes:
        policy: The policy its model trains under.
        make: Makes the wrapper (of an inner optimizer of the shared
            table, tests/backends/testing.py).
        width: The model's hidden units: 1024 gives a kernel of 4096
            elements, the least that gets 8-bit or 4-bit state.
        quantized: True if some of its state must be block-coded.
        sharded: True to run under a `keras.distribution.DataParallel`,
            with `shard_optimizer_state` (JAX only).
    """

    policy: str
    make: Callable
    width: int = 8
    quantized: bool = False
    sharded: bool = False


ADAM = inner_optimizers("adam")["adam"]
# At the rate of every row (test_learning_rate_reaches_the_inner_optimizer).
SGD_MOMENTUM = inner_optimizers(
    "sgd_momentum", learning_rates={"sgd_momentum": 0.01}
)["sgd_momentum"]


def low_precision(**options):
    return lambda: kdp.LowPrecisionOptimizer(ADAM(), **options)


def loss_scaled_low_precision(**options):
    # Float16 weights: `compile` puts a loss-scale optimizer around a
    # low-precision one; given as such, it keeps it.
    return lambda: kdp.LossScaleOptimizer(low_precision(**options)())


WRAPPERS = {
    "loss_scale_dynamic": Wrapper(
        "mixed_float16",
        lambda: kdp.LossScaleOptimizer(ADAM(), dynamic_growth_steps=2),
    ),
    "loss_scale_fixed": Wrapper(
        "mixed_float16",
        lambda: kdp.LossScaleOptimizer(
            SGD_MOMENTUM(), dynamic=False, initial_scale=128
        ),
    ),
    "low_precision_kahan": Wrapper("bfloat16", low_precision(update="kahan")),
    "low_precision_stochastic": Wrapper(
        "bfloat16", low_precision(update="stochastic_rounding", seed=3)
    ),
    "low_precision_nearest": Wrapper(
        "bfloat16", low_precision(update="nearest")
    ),
    "low_precision_8bit": Wrapper(
        "bfloat16",
        low_precision(state_dtype="8bit", seed=3),
        width=1024,
        quantized=True,
    ),
    "low_precision_4bit": Wrapper(
        "bfloat16",
        low_precision(update="kahan", state_dtype="4bit", seed=3),
        width=1024,
        quantized=True,
    ),
    "low_precision_sharded": Wrapper(
        "bfloat16",
        lambda: kdp.shard_optimizer_state(
            kdp.LowPrecisionOptimizer(ADAM(), state_dtype="8bit", seed=3)
        ),
        width=1024,
        quantized=True,
        sharded=True,
    ),
    "kahan_float16": Wrapper(
        "float16", loss_scaled_low_precision(update="kahan")
    ),
    "stochastic_float16": Wrapper(
        "float16",
        loss_scaled_low_precision(update="stochastic_rounding", seed=3),
    ),
    "experimental_loss_scale": Wrapper(
        "mixed_float16",
        lambda: kdp.experimental.LossScaleOptimizer(
            ADAM(), loss_scale="dynamic"
        ),
    ),
    "mixed_precision_loss_scale": Wrapper(
        "mixed_float16",
        lambda: kdp.mixed_precision.LossScaleOptimizer(
            ADAM(), initial_scale=256
        ),
    ),
    "loss_scale_of_low_precision": Wrapper(
        "float16", loss_scaled_low_precision()
    ),
}
# `keras.distribution` is JAX's only: on TensorFlow and torch
# `shard_optimizer_state` raises NotImplementedError (TensorFlow keeps
# state per replica in tf.distribute, torch shards with its own FSDP).
NOT_HERE = {
    name: "keras.distribution, and so shard_optimizer_state, is the JAX "
    f"backend's only; this run is on {BACKEND}"
    for name, row in WRAPPERS.items()
    if row.sharded and BACKEND != "jax"
}
NAMES = [
    pytest.param(name, marks=pytest.mark.skip(reason=NOT_HERE[name]))
    if name in NOT_HERE
    else name
    for name in sorted(WRAPPERS)
]
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


def innermost_wrapper(optimizer):
    """The wrapper at the bottom of a stack of wrappers."""
    while hasattr(optimizer.inner_optimizer, "inner_optimizer"):
        optimizer = optimizer.inner_optimizer
    return optimizer


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


@pytest.fixture(autouse=True)
def distribution(request):
    """Runs a sharded row under a `DataParallel` distribution of the
    devices JAX has here (one CPU device in this process: the layouts are
    made along a data axis of one device; test_state_sharding.py splits
    state over eight in a process of its own)."""
    callspec = getattr(request.node, "callspec", None)
    name = callspec.params.get("name") if callspec else None
    if name is None or not WRAPPERS[name].sharded:
        yield None
        return
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    try:
        yield keras.distribution.distribution()
    finally:
        keras.distribution.set_distribution(None)


def compiled_model(name, jit_compile=False):
    """A small Dense model under the wrapper's policy, compiled with it."""
    row = WRAPPERS[name]
    keras.utils.set_random_seed(0)
    with kdp.policy_scope(row.policy):
        model = keras.Sequential(
            [
                keras.Input((4,)),
                keras.layers.Dense(row.width, activation="tanh"),
                keras.layers.Dense(1),
            ]
        )
    optimizer = row.make()
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
    if WRAPPERS[name].sharded:
        assert state_sharding.shards_state(optimizer)
    if WRAPPERS[name].quantized:
        assert innermost_wrapper(optimizer).quantized_slots
        codes = [v for v in optimizer.variables if v.path.endswith("_codes")]
        assert codes and all(dtype_of(v) == "int8" for v in codes)


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


# Rows whose `.weights.h5` round trip runs only in the full runs (`tox -e
# full-jax`, ...), to keep the default run within CI's time: the same
# code paths as their `.keras` round trip, which every run covers, and
# other rows cover `.weights.h5` with each wrapper class (dynamic loss
# scaling, stochastic rounding, 8-bit state, and the two nested).
SECOND_FORMAT_IN_FULL_RUNS = {
    "low_precision_nearest",
    "low_precision_4bit",
    "low_precision_kahan",
    "kahan_float16",
    "stochastic_float16",
    "loss_scale_fixed",
    "experimental_loss_scale",
    "mixed_precision_loss_scale",
}


def save_cases():
    """`(name, file_format)` cases of the save-and-load test."""
    cases = []
    for name in sorted(WRAPPERS):
        for file_format in (".keras", ".weights.h5"):
            marks = []
            if name in NOT_HERE:
                marks.append(pytest.mark.skip(reason=NOT_HERE[name]))
            if (
                file_format == ".weights.h5"
                and name in SECOND_FORMAT_IN_FULL_RUNS
            ):
                marks.append(pytest.mark.slow)
            cases.append(
                pytest.param(
                    name, file_format, marks=marks, id=f"{name}-{file_format}"
                )
            )
    return cases


@pytest.mark.parametrize(("name", "file_format"), save_cases())
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
    optimizer = WRAPPERS[name].make()
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
