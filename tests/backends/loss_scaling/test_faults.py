"""Injected faults: NaN and Inf gradients on chosen steps, inside fit.

Faults are injected through the data: a batch holding NaN or Inf makes every
gradient of the step non-finite, on every backend and in every dtype. After
every step the loss scale, the counters and the weights are checked against
the documented rule (testing.reference_trajectory).
"""

import keras
import numpy as np
import pytest
from testing import FINITE
from testing import INF
from testing import NAN
from testing import reference_trajectory
from testing import to_numpy

import keras_dtype_policy as kdp

BATCH = 8
SCHEDULES = {
    "first_step": [NAN] + [FINITE] * 7,
    "several_in_a_row": [FINITE, INF, NAN, INF, FINITE, FINITE, FINITE, FINITE],
    "every_step_then_clean": [NAN, INF] * 4 + [FINITE] * 8,
}
RULE = dict(
    initial_scale=64.0,
    dynamic_growth_steps=2,
    growth_factor=2.0,
    backoff_factor=0.5,
    min_scale=4.0,
    max_scale=256.0,
)


class StepRecorder(keras.callbacks.Callback):
    """Records the optimizer state and checks the weights after each step."""

    def __init__(self):
        super().__init__()
        self.states = []

    def on_train_batch_end(self, batch, logs=None):
        optimizer = self.model.optimizer
        self.states.append(
            (
                optimizer.loss_scale,
                # The variable: a fixed scale's dynamic_counter is None.
                int(to_numpy(optimizer.step_counter)),
                optimizer.skipped_steps,
            )
        )
        for weight in self.model.weights:
            assert np.all(np.isfinite(to_numpy(weight))), weight.path


def data_for(schedule, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(len(schedule) * BATCH, 5)).astype("float32")
    y = (x[:, :1] - x[:, 1:2]).astype("float32")
    for step, kind in enumerate(schedule):
        if kind != FINITE:
            x[step * BATCH] = np.nan if kind == NAN else np.inf
    return x, y


def make_model(policy):
    keras.utils.set_random_seed(0)
    with kdp.policy_scope(policy):
        return keras.Sequential(
            [
                keras.Input((5,)),
                keras.layers.Dense(8, activation="relu"),
                keras.layers.Dense(1, dtype="float32"),
            ]
        )


def fault_cases():
    """`(schedule_name, dynamic, policy)`: every combination, half of them
    marked slow. The default runs keep the six whose index sum is even,
    which still pair every value of each argument with every value of
    each other one; `tox -e full-<backend>` runs all twelve."""
    cases = []
    for s, schedule_name in enumerate(sorted(SCHEDULES)):
        for d, dynamic in enumerate((True, False)):
            for p, policy in enumerate(("mixed_float16", "float32")):
                marks = (pytest.mark.slow,) if (s + d + p) % 2 else ()
                cases.append(
                    pytest.param(schedule_name, dynamic, policy, marks=marks)
                )
    return cases


@pytest.mark.parametrize(("schedule_name", "dynamic", "policy"), fault_cases())
def test_fit_follows_the_rule_under_injected_faults(
    schedule_name, dynamic, policy
):
    schedule = SCHEDULES[schedule_name]
    model = make_model(policy)
    rule = dict(RULE)
    if not dynamic:  # tf.keras' rule: a fixed scale takes no growth steps.
        rule["dynamic_growth_steps"] = None
    optimizer = kdp.LossScaleOptimizer(
        keras.optimizers.Adam(1e-2), dynamic=dynamic, **rule
    )
    model.compile(optimizer, "mse")
    recorder = StepRecorder()
    x, y = data_for(schedule)
    model.fit(
        x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[recorder]
    )
    expected = reference_trajectory(
        schedule,
        RULE["initial_scale"],
        dynamic=dynamic,
        growth_steps=RULE["dynamic_growth_steps"],
        growth_factor=RULE["growth_factor"],
        backoff_factor=RULE["backoff_factor"],
        min_scale=RULE["min_scale"],
        max_scale=RULE["max_scale"],
    )
    assert recorder.states == expected
    assert int(to_numpy(optimizer.iterations)) == schedule.count(FINITE)
    # Recovery: clean data trains on.
    clean_x, clean_y = data_for([FINITE] * 8, seed=1)
    before = model.evaluate(clean_x, clean_y, verbose=0)
    model.fit(clean_x, clean_y, batch_size=BATCH, epochs=4, verbose=0)
    assert model.evaluate(clean_x, clean_y, verbose=0) < before
    assert optimizer.skipped_steps == len(schedule) - schedule.count(FINITE)


def test_a_scale_stuck_at_its_floor_is_visible():
    schedule = [NAN] * 20
    model = make_model("mixed_float16")
    model.compile(
        kdp.LossScaleOptimizer(keras.optimizers.SGD(0.1), **RULE), "mse"
    )
    recorder = StepRecorder()
    x, y = data_for(schedule)
    model.fit(
        x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[recorder]
    )
    assert model.optimizer.loss_scale == RULE["min_scale"]
    assert model.optimizer.skipped_steps == 20
    assert [skipped for _, _, skipped in recorder.states] == list(range(1, 21))
    assert int(to_numpy(model.optimizer.iterations)) == 0
