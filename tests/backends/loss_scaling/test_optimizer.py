"""LossScaleOptimizer: the scale rule, skipped steps, state and configs."""

import math

import keras
import numpy as np
import pytest
from testing import BACKEND
from testing import FINITE
from testing import INF
from testing import NAN
from testing import reference_trajectory
from testing import to_numpy

from keras_dtype_policy import LossScaleOptimizer


def gradient(kind, scale):
    values = np.full((3,), scale, dtype="float32")
    if kind == NAN:
        values[1] = np.nan
    elif kind == INF:
        values[2] = -np.inf
    return keras.ops.convert_to_tensor(values)


def make_variables():
    return [keras.Variable(np.ones((3,), "float32"), name="w")]


def state_of(optimizer):
    # A fixed scale's dynamic_counter is None, as in tf.keras: its count of
    # finite steps is read from the variable.
    return (
        optimizer.loss_scale,
        int(to_numpy(optimizer.step_counter)) if optimizer.built else 0,
        optimizer.skipped_steps,
    )


def run_stateful(optimizer, variables, kinds):
    states = []
    for kind in kinds:
        grads = [gradient(kind, optimizer.loss_scale)]
        # Keras' trainers scale the loss before every step.
        optimizer.scale_loss(1.0)
        optimizer.apply(grads, variables)
        states.append(state_of(optimizer))
        assert np.all(np.isfinite(to_numpy(variables[0])))
    return states


def run_stateless(optimizer, variables, kinds):
    """Drives stateless_apply, then writes the values back."""
    if BACKEND == "tensorflow":
        pytest.skip(
            "Keras refuses stateless_apply on TensorFlow (tf.distribute); "
            "test_stateless_apply_is_refused_on_tensorflow checks that."
        )
    trainable = [v.value for v in variables]
    optimizer_values = [v.value for v in optimizer.variables]
    states = []
    for kind in kinds:
        scale = float(to_numpy(optimizer_values[_index(optimizer)]))
        optimizer.scale_loss(1.0)
        trainable, optimizer_values = optimizer.stateless_apply(
            optimizer_values, [gradient(kind, scale)], trainable
        )
        for variable, value in zip(
            optimizer.variables, optimizer_values, strict=True
        ):
            variable.assign(value)
        states.append(state_of(optimizer))
        assert np.all(np.isfinite(to_numpy(trainable[0])))
    for variable, value in zip(variables, trainable, strict=True):
        variable.assign(value)
    return states


def _index(optimizer):
    return [id(v) for v in optimizer.variables].index(
        id(optimizer.dynamic_scale)
    )


KINDS = [FINITE, FINITE, NAN, FINITE, INF, INF, FINITE, FINITE, FINITE, NAN]
RULE = dict(
    initial_scale=8.0,
    dynamic_growth_steps=2,
    growth_factor=4.0,
    backoff_factor=0.25,
    min_scale=1.0,
    max_scale=32.0,
)


@pytest.mark.parametrize("run", [run_stateful, run_stateless])
def test_dynamic_scale_follows_the_documented_rule(run):
    variables = make_variables()
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1), **RULE)
    optimizer.build(variables)
    expected = reference_trajectory(
        KINDS,
        8.0,
        growth_steps=2,
        growth_factor=4.0,
        backoff_factor=0.25,
        min_scale=1.0,
        max_scale=32.0,
    )
    assert run(optimizer, variables, KINDS) == expected
    # Ceiling and floor were both reached.
    assert max(s for s, _, _ in expected) == 32.0
    assert min(s for s, _, _ in expected) == 1.0
    assert int(to_numpy(optimizer.iterations)) == KINDS.count(FINITE)


@pytest.mark.parametrize("run", [run_stateful, run_stateless])
def test_fixed_scale_never_changes_and_skips_non_finite_steps(run):
    variables = make_variables()
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.1), dynamic=False, initial_scale=1024
    )
    optimizer.build(variables)
    states = run(optimizer, variables, KINDS)
    assert states == reference_trajectory(KINDS, 1024.0, dynamic=False)
    assert {scale for scale, _, _ in states} == {1024.0}
    assert optimizer.skipped_steps == 4


def test_stateless_apply_is_refused_on_tensorflow_only():
    variables = make_variables()
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.5), initial_scale=2)
    optimizer.build(variables)
    values = [v.value for v in optimizer.variables]
    grads = [gradient(FINITE, 2.0)]
    if BACKEND == "tensorflow":
        with pytest.raises(ValueError, match="TensorFlow backend"):
            optimizer.stateless_apply(values, grads, [variables[0].value])
        return
    optimizer.scale_loss(1.0)
    new_trainable, new_values = optimizer.stateless_apply(
        values, grads, [variables[0].value]
    )
    np.testing.assert_allclose(to_numpy(new_trainable[0]), [0.5] * 3)
    assert len(new_values) == len(values)


def test_gradients_are_unscaled_before_the_inner_optimizer():
    variables = make_variables()
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(1.0), dynamic=False, initial_scale=64
    )
    grads = [keras.ops.convert_to_tensor(np.array([64.0, 128.0, -32.0]))]
    optimizer.scale_loss(1.0)
    optimizer.apply(grads, variables)
    np.testing.assert_allclose(to_numpy(variables[0]), [0.0, -1.0, 1.5])
    assert optimizer.scale_loss(2.0) is not None
    assert float(to_numpy(optimizer.scale_loss(2.0))) == 128.0


@pytest.mark.parametrize("dynamic", [True, False])
@pytest.mark.parametrize("run", [run_stateful, run_stateless])
def test_skipped_step_leaves_weights_and_inner_state(dynamic, run):
    variables = make_variables()
    optimizer = LossScaleOptimizer(
        keras.optimizers.Adam(0.1), dynamic=dynamic, initial_scale=4
    )
    optimizer.build(variables)
    run(optimizer, variables, [FINITE, FINITE])
    before = [to_numpy(v).copy() for v in variables]
    inner_before = [
        to_numpy(v).copy() for v in optimizer.inner_optimizer.variables
    ]
    run(optimizer, variables, [NAN, INF])
    for old, variable in zip(before, variables, strict=True):
        np.testing.assert_array_equal(to_numpy(variable), old)
    for old, variable in zip(
        inner_before, optimizer.inner_optimizer.variables, strict=True
    ):
        np.testing.assert_array_equal(to_numpy(variable), old)
    assert int(to_numpy(optimizer.iterations)) == 2
    assert optimizer.skipped_steps == 2


def test_properties_before_build():
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(), initial_scale=128)
    assert state_of(optimizer) == (128.0, 0, 0)
    assert optimizer.dynamic is True


def test_state_lives_in_optimizer_variables():
    optimizer = LossScaleOptimizer(keras.optimizers.Adam(), name="lso")
    optimizer.build(make_variables())
    names = [v.name for v in optimizer.variables]
    assert {"dynamic_scale", "step_counter", "skipped_steps"} <= set(names)
    own = [v for v in optimizer.variables if v.name == "skipped_steps"]
    assert own[0].path.startswith("lso/")


def test_a_second_build_keeps_the_state():
    # Keras' own wrapper adds its counters again on a second `build` (a
    # user's `optimizer.build(...)` after `load_model`), fresh ones in
    # front of those the file loaded; the package's builds once.
    optimizer = LossScaleOptimizer(keras.optimizers.Adam(), initial_scale=8)
    variables = make_variables()
    optimizer.build(variables)
    optimizer.dynamic_scale.assign(2.0)
    before = [v.path for v in optimizer.variables]
    optimizer.build(variables)
    assert [v.path for v in optimizer.variables] == before
    assert optimizer.loss_scale == 2.0


def _small_optimizer(dynamic):
    return LossScaleOptimizer(
        keras.optimizers.Adam(0.01),
        dynamic=dynamic,
        initial_scale=256,
        # tf.keras' rule: no growth steps for a fixed scale.
        dynamic_growth_steps=2 if dynamic else None,
    )


def _trained_model(dynamic):
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(2, dtype="mixed_float16")]
    )
    model.compile(_small_optimizer(dynamic), "mse")
    x = np.ones((4, 3), "float32")
    y = np.zeros((4, 2), "float32")
    for batch in [x, x, x * 1e6, x, x]:  # the third step overflows
        model.train_on_batch(batch, y)
    return model


def _optimizer_snapshot(optimizer):
    return [to_numpy(v).copy() for v in optimizer.variables]


@pytest.mark.parametrize("dynamic", [True, False])
def test_state_saved_in_weights_files_and_restored_exactly(dynamic, tmp_path):
    model = _trained_model(dynamic)
    optimizer = model.optimizer
    assert optimizer.skipped_steps == 1
    expected_scale = 256.0 if not dynamic else 256.0 * 2 * 0.5 * 2
    assert optimizer.loss_scale == expected_scale
    saved = _optimizer_snapshot(optimizer)
    path = tmp_path / "model.weights.h5"
    model.save_weights(path)
    fresh = keras.models.clone_model(model)
    fresh.compile(_small_optimizer(dynamic), "mse")
    fresh.optimizer.build(fresh.trainable_variables)
    fresh.load_weights(path)
    assert state_of(fresh.optimizer) == state_of(optimizer)
    for old, new in zip(
        saved, _optimizer_snapshot(fresh.optimizer), strict=True
    ):
        np.testing.assert_array_equal(old, new)

    keras_path = tmp_path / "model.keras"
    model.save(keras_path)
    loaded = keras.saving.load_model(keras_path)
    assert isinstance(loaded.optimizer, LossScaleOptimizer)
    assert state_of(loaded.optimizer) == state_of(optimizer)
    for old, new in zip(
        saved, _optimizer_snapshot(loaded.optimizer), strict=True
    ):
        np.testing.assert_array_equal(old, new)


def test_config_round_trip():
    optimizer = LossScaleOptimizer(
        keras.optimizers.Adam(0.003),
        initial_scale=512,
        dynamic_growth_steps=10,
        growth_factor=3.0,
        backoff_factor=0.2,
        min_scale=2.0,
        max_scale=4096.0,
        name="scaled",
    )
    config = optimizer.get_config()
    assert "dynamic" not in config  # the default is left out, as Keras does
    assert config["growth_factor"] == 3.0
    assert config["max_scale"] == 4096.0
    revived = LossScaleOptimizer.from_config(config)
    assert revived.get_config() == config
    revived = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(optimizer)
    )
    assert type(revived) is LossScaleOptimizer
    assert revived.get_config() == config
    assert float(to_numpy(revived.inner_optimizer.learning_rate)) == (
        pytest.approx(0.003)
    )


def test_default_config_has_keras_own_keys_and_loads_in_keras():
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.5), initial_scale=3.0, dynamic_growth_steps=2
    )
    config = optimizer.get_config()
    assert set(config) == {
        "name",
        "inner_optimizer",
        "initial_scale",
        "dynamic_growth_steps",
    }
    keras_optimizer = keras.optimizers.LossScaleOptimizer.from_config(
        dict(config)
    )
    assert keras_optimizer.initial_scale == 3.0
    fixed = LossScaleOptimizer(
        keras.optimizers.SGD(), dynamic=False, initial_scale=8.0
    ).get_config()
    assert fixed["dynamic"] is False
    assert LossScaleOptimizer.from_config(fixed).dynamic is False


TF_KERAS_ADAM = {
    "module": "keras.optimizers",
    "class_name": "Adam",
    "config": {
        "name": "Adam",
        "weight_decay": None,
        "clipnorm": None,
        "global_clipnorm": None,
        "clipvalue": None,
        "use_ema": False,
        "ema_momentum": 0.99,
        "ema_overwrite_frequency": None,
        "jit_compile": True,
        "is_legacy_optimizer": False,
        "learning_rate": 0.0010000000474974513,
        "beta_1": 0.9,
        "beta_2": 0.999,
        "epsilon": 1e-07,
        "amsgrad": False,
    },
    "registered_name": None,
}


@pytest.mark.parametrize(
    "inner",
    [TF_KERAS_ADAM, {k: v for k, v in TF_KERAS_ADAM.items() if k != "module"}],
    ids=["tf_keras_2_13", "tf_keras_2_11"],
)
@pytest.mark.parametrize(
    "saved, expected",
    [
        (
            {
                "dynamic": True,
                "initial_scale": 32768.0,
                "dynamic_growth_steps": 2000,
            },
            (True, 32768.0, 2000),
        ),
        (
            {
                "dynamic": False,
                "initial_scale": 1024.0,
                "dynamic_growth_steps": None,
            },
            (False, 1024.0, None),
        ),
    ],
)
def test_loads_tf_keras_2_configs(inner, saved, expected):
    optimizer = LossScaleOptimizer.from_config(
        {"inner_optimizer": inner, **saved}
    )
    assert (
        optimizer.dynamic,
        optimizer.initial_scale,
        optimizer.dynamic_growth_steps,
    ) == expected
    assert isinstance(optimizer.inner_optimizer, keras.optimizers.Adam)
    assert float(to_numpy(optimizer.learning_rate)) == pytest.approx(1e-3)


@pytest.mark.parametrize(
    "kwargs, error, argument",
    [
        ({"initial_scale": 0}, ValueError, "initial_scale"),
        ({"initial_scale": -1.0}, ValueError, "initial_scale"),
        ({"initial_scale": math.inf}, ValueError, "initial_scale"),
        ({"initial_scale": math.nan}, ValueError, "initial_scale"),
        ({"initial_scale": "big"}, TypeError, "initial_scale"),
        ({"dynamic_growth_steps": 0}, ValueError, "dynamic_growth_steps"),
        ({"dynamic_growth_steps": 1.5}, TypeError, "dynamic_growth_steps"),
        ({"growth_factor": 1.0}, ValueError, "growth_factor"),
        ({"growth_factor": math.inf}, ValueError, "growth_factor"),
        ({"backoff_factor": 1.0}, ValueError, "backoff_factor"),
        ({"backoff_factor": 0}, ValueError, "backoff_factor"),
        ({"min_scale": 0}, ValueError, "min_scale"),
        ({"max_scale": math.inf}, ValueError, "max_scale"),
        ({"min_scale": 4.0, "initial_scale": 2.0}, ValueError, "min_scale"),
        ({"dynamic": "yes"}, TypeError, "dynamic"),
    ],
)
def test_bad_arguments_name_the_argument_and_value(kwargs, error, argument):
    inner = keras.optimizers.SGD()
    with pytest.raises(error, match=f"{argument}="):
        LossScaleOptimizer(inner, **kwargs)
    assert inner.loss_scale_factor is None


def test_inner_optimizer_must_be_a_plain_keras_optimizer():
    with pytest.raises(TypeError, match="Received: inner_optimizer="):
        LossScaleOptimizer("adam")
    with pytest.raises(TypeError, match="already a loss-scale optimizer"):
        LossScaleOptimizer(LossScaleOptimizer(keras.optimizers.SGD()))
    with pytest.raises(TypeError, match="already a loss-scale optimizer"):
        LossScaleOptimizer(
            keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
        )


def test_fixed_mode_ignores_the_dynamic_bounds():
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(), dynamic=False, initial_scale=2.0**30
    )
    assert optimizer.loss_scale == 2.0**30
