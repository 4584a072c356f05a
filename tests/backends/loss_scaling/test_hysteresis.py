"""Hysteresis of the dynamic loss scale, against a pure-Python reference.

The rule (DeepSpeed's `hysteresis` with `consecutive_hysteresis=True`):
every step with a non-finite gradient is skipped and restarts the count of
finite steps; the `hysteresis`-th skipped step in a row, and each one after
it, lowers the scale; a finite step restarts the count of skipped steps in
a row. Checked eagerly on every backend, and compiled where the backend
compiles a step: `jax.jit` of `stateless_apply` on JAX, `tf.function` of
`apply` on TensorFlow. PyTorch runs its steps eagerly (Keras' torch
trainer does), so its compiled case is skipped.
"""

import json
import warnings

import keras
import numpy as np
import pytest
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from testing import BACKEND
from testing import to_numpy

import keras_dtype_policy as kdp
from keras_dtype_policy import DynamicLossScale
from keras_dtype_policy import LossScaleOptimizer
from keras_dtype_policy.loss_scaling.scale_rule import next_scale_state

INITIAL, FLOOR, CEILING = 2.0**10, 1.0, 2.0**13


def reference(finite_steps, hysteresis, growth_steps):
    """The states (scale, finite in a row, skipped, skipped in a row)."""
    scale, counter, skipped, in_a_row = INITIAL, 0, 0, 0
    states = []
    for finite in finite_steps:
        if finite:
            in_a_row = 0
            counter += 1
            if counter >= growth_steps:
                scale, counter = min(scale * 2.0, CEILING), 0
        else:
            skipped += 1
            in_a_row += 1
            counter = 0
            if in_a_row >= hysteresis:
                scale = max(scale * 0.5, FLOOR)
        states.append((scale, counter, skipped, in_a_row))
    return states


def make_optimizer(hysteresis, growth_steps):
    return LossScaleOptimizer(
        keras.optimizers.SGD(0.01),
        initial_scale=INITIAL,
        dynamic_growth_steps=growth_steps,
        min_scale=FLOOR,
        max_scale=CEILING,
        hysteresis=hysteresis,
    )


def state_of(optimizer):
    return (
        optimizer.loss_scale,
        int(to_numpy(optimizer.step_counter)),
        optimizer.skipped_steps,
        optimizer.nonfinite_steps_in_a_row,
    )


def gradient(finite):
    return np.full((2,), 1.0 if finite else np.inf, "float32")


def run_eager(optimizer, variable, steps):
    states = []
    for finite in steps:
        optimizer.scale_loss(1.0)
        optimizer.apply([keras.ops.convert_to_tensor(gradient(finite))])
        states.append(state_of(optimizer))
    return states


def run_compiled(optimizer, variable, steps):
    if BACKEND == "jax":
        import jax

        @jax.jit
        def step(optimizer_values, grads, trainable):
            optimizer.scale_loss(1.0)
            return optimizer.stateless_apply(optimizer_values, grads, trainable)

        trainable = [variable.value]
        values = [v.value for v in optimizer.variables]
        states = []
        for finite in steps:
            trainable, values = step(values, [gradient(finite)], trainable)
            for target, value in zip(optimizer.variables, values, strict=True):
                target.assign(value)
            states.append(state_of(optimizer))
        return states
    if BACKEND == "tensorflow":
        import tensorflow as tf

        @tf.function
        def step(grads):
            optimizer.scale_loss(1.0)
            optimizer.apply(grads)

        states = []
        for finite in steps:
            step([tf.constant(gradient(finite))])
            states.append(state_of(optimizer))
        return states
    pytest.skip("Keras trains PyTorch eagerly: no compiled step to test")


@pytest.mark.parametrize("run", [run_eager, run_compiled])
@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    steps=st.lists(st.booleans(), min_size=1, max_size=24),
    hysteresis=st.integers(1, 4),
    growth_steps=st.integers(1, 3),
)
def test_state_machine_matches_the_reference(
    run, steps, hysteresis, growth_steps
):
    optimizer = make_optimizer(hysteresis, growth_steps)
    variable = keras.Variable(np.ones((2,), "float32"), name="w")
    optimizer.build([variable])
    states = run(optimizer, variable, steps)
    assert states == reference(steps, hysteresis, growth_steps)
    # No skipped step ever reached the weights.
    assert np.all(np.isfinite(to_numpy(variable)))


def rule_states(steps, hysteresis, growth_steps, jit=False):
    """`scale_rule.next_scale_state` driven over `steps`, as `reference`
    reports them (the skipped count kept by hand, as the callers do)."""

    def rule(scale, counter, streak, finite):
        return next_scale_state(
            scale,
            counter,
            streak,
            finite,
            growth_steps=growth_steps,
            hysteresis=hysteresis,
            min_scale=FLOOR,
            max_scale=CEILING,
        )

    if jit:
        import jax

        rule = jax.jit(rule)
    scale = np.float32(INITIAL)
    counter, streak = np.int32(0), np.int32(0)
    skipped = 0
    states = []
    for finite in steps:
        scale, counter, streak = rule(scale, counter, streak, np.bool_(finite))
        skipped += not finite
        states.append(
            (float(to_numpy(scale)), int(to_numpy(counter)), skipped)
            + (int(to_numpy(streak)),)
        )
    return states


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@settings(max_examples=40, deadline=None)
@given(
    steps=st.lists(st.booleans(), min_size=1, max_size=24),
    hysteresis=st.integers(1, 4),
    growth_steps=st.integers(1, 3),
)
def test_the_pure_rule_matches_the_reference(
    jit, steps, hysteresis, growth_steps
):
    if jit and BACKEND != "jax":
        pytest.skip("jax.jit of the pure rule: on JAX only")
    states = rule_states(steps, hysteresis, growth_steps, jit=jit)
    assert states == reference(steps, hysteresis, growth_steps)


@settings(max_examples=40, deadline=None)
@given(
    steps=st.lists(st.booleans(), min_size=1, max_size=30),
    hysteresis=st.integers(1, 4),
)
def test_dynamic_loss_scale_update_matches_the_reference(steps, hysteresis):
    # tf.keras' DynamicLossScale: factor 2 both ways, floor 1, no ceiling.
    loss_scale = DynamicLossScale(
        initial_loss_scale=INITIAL, increment_period=2, hysteresis=hysteresis
    )
    expected = []
    scale, counter, in_a_row = INITIAL, 0, 0
    for finite in steps:
        if finite:
            in_a_row, counter = 0, counter + 1
            if counter >= 2:
                scale, counter = scale * 2.0, 0
        else:
            in_a_row, counter = in_a_row + 1, 0
            if in_a_row >= hysteresis:
                scale = max(scale / 2.0, 1.0)
        expected.append(scale)
    seen = []
    for finite in steps:
        loss_scale.update([keras.ops.convert_to_tensor(gradient(finite))])
        seen.append(float(to_numpy(loss_scale())))
    assert seen == expected


def test_default_is_todays_rule_and_tf_keras_configs_unchanged():
    optimizer = LossScaleOptimizer(keras.optimizers.SGD())
    assert optimizer.hysteresis == 1
    assert "hysteresis" not in optimizer.get_config()
    # tf.keras' DynamicLossScale config keeps its three keys.
    assert DynamicLossScale().get_config() == {
        "initial_loss_scale": 2.0**15,
        "increment_period": 2000,
        "multiplier": 2.0,
    }
    assert DynamicLossScale.from_config(
        DynamicLossScale().get_config()
    ) == DynamicLossScale(hysteresis=1)


def test_config_round_trips_with_hysteresis():
    optimizer = make_optimizer(hysteresis=3, growth_steps=2)
    config = json.loads(
        json.dumps(keras.saving.serialize_keras_object(optimizer))
    )
    revived = keras.saving.deserialize_keras_object(config)
    assert type(revived) is LossScaleOptimizer
    assert revived.hysteresis == 3
    assert revived.get_config() == optimizer.get_config()
    loss_scale = DynamicLossScale(hysteresis=2)
    assert loss_scale.get_config()["hysteresis"] == 2
    assert DynamicLossScale.from_config(loss_scale.get_config()) == loss_scale
    serialized = {"class_name": "DynamicLossScale", "config": {"hysteresis": 2}}
    assert kdp.get_loss_scale(serialized).hysteresis == 2
    # tf.keras 2.3's optimizer built from a loss scale passes it on.
    legacy = kdp.experimental.LossScaleOptimizer(
        keras.optimizers.SGD(), loss_scale=loss_scale
    )
    assert legacy.hysteresis == 2


@pytest.mark.parametrize(
    "value, error, fragment",
    [
        (0, ValueError, "hysteresis=0"),
        (-2, ValueError, "hysteresis=-2"),
        (1.5, TypeError, "hysteresis=1.5"),
        ("2", TypeError, "hysteresis='2'"),
        (True, TypeError, "hysteresis=True"),
    ],
)
def test_bad_hysteresis_names_the_argument_and_value(value, error, fragment):
    with pytest.raises(error, match=fragment):
        LossScaleOptimizer(keras.optimizers.SGD(), hysteresis=value)
    with pytest.raises(error, match=fragment):
        DynamicLossScale(hysteresis=value)


def _model(hysteresis):
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(2, name="dense")]
    )
    model.compile(
        LossScaleOptimizer(
            keras.optimizers.SGD(0.01),
            initial_scale=INITIAL,
            hysteresis=hysteresis,
        ),
        "mse",
    )
    return model


@pytest.mark.parametrize("file_format", ["keras", "h5"])
def test_streak_and_setting_saved_and_restored(file_format, tmp_path):
    model = _model(hysteresis=3)
    x = np.ones((4, 3), "float32")
    y = np.zeros((4, 2), "float32")
    model.train_on_batch(x, y)
    for _ in range(2):  # two non-finite steps in a row: not yet lowered
        model.train_on_batch(np.full_like(x, np.inf), y)
    optimizer = model.optimizer
    assert optimizer.nonfinite_steps_in_a_row == 2
    assert optimizer.loss_scale == INITIAL
    path = tmp_path / f"model.{file_format}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # .h5 is legacy
        model.save(path)
        loaded = keras.saving.load_model(path)
    restored = loaded.optimizer
    if not restored.built:
        # An .h5 file's optimizer state waits for the build, as in Keras.
        assert file_format == "h5"
        restored.build(loaded.trainable_variables)
    assert restored.hysteresis == 3
    assert restored.nonfinite_steps_in_a_row == 2
    assert restored.skipped_steps == 2
    # The counts per variable too (a loaded model may name its variables'
    # paths without the model's name).
    counts = optimizer.nonfinite_gradient_counts
    assert list(counts.values()) == [2, 2]  # kernel and bias, both steps
    assert list(restored.nonfinite_gradient_counts.values()) == [2, 2]
    # The third in a row lowers the scale, after the reload as before it.
    loaded.train_on_batch(np.full_like(x, np.inf), y)
    assert restored.loss_scale == INITIAL / 2
    assert restored.nonfinite_steps_in_a_row == 3


def test_file_without_the_streak_loads_with_a_fresh_streak(tmp_path):
    # A weights file of Keras' own LossScaleOptimizer has no such store.
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(2, name="dense")]
    )
    model.compile(
        keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()), "mse"
    )
    model.train_on_batch(
        np.ones((4, 3), "float32"), np.zeros((4, 2), "float32")
    )
    path = tmp_path / "model.weights.h5"
    model.save_weights(path)
    fresh = _model(hysteresis=2)
    fresh.optimizer.build(fresh.trainable_variables)
    fresh.load_weights(path)
    assert fresh.optimizer.nonfinite_steps_in_a_row == 0
    assert to_numpy(fresh.optimizer.iterations) == 1


def test_compile_hook_keeps_the_policys_hysteresis():
    # A tf.keras-style policy carrying its own dynamic loss scale: the
    # optimizer the compile hook installs lowers the scale by its rule.
    policy = kdp.Policy(
        "mixed_float16", loss_scale=DynamicLossScale(hysteresis=3)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with kdp.policy_scope(policy):
            model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(), "mse")
    assert isinstance(model.optimizer, LossScaleOptimizer)
    assert model.optimizer.hysteresis == 3


def test_inspect_shows_the_hysteresis_and_the_streak(tmp_path):
    from keras_dtype_policy.tools import model_report

    model = _model(hysteresis=3)
    x = np.ones((4, 3), "float32")
    y = np.zeros((4, 2), "float32")
    model.train_on_batch(np.full_like(x, np.inf), y)
    path = tmp_path / "model.keras"
    model.save(path)
    report = model_report.build_report(str(path))
    scaling = report["optimizer"]["loss_scaling"]
    assert scaling["settings"]["hysteresis"] == 3
    assert scaling["state"]["nonfinite_steps_in_a_row"] == 1
    text = "\n".join(model_report.format_report(report))
    assert "hysteresis" in text
    assert "nonfinite_steps_in_a_row" in text
