"""Which variables' gradients overflowed at a skipped step.

The model: a float32 `Dense` named "wide" whose kernel is 1e-36, then a
`Dense` named "head". A batch of 1e36 passes forward finitely (1e36 times
1e-36), but the gradient of "wide"'s kernel is the input times the
backpropagated error times the loss scale: beyond float32, Inf. Every
other gradient stays finite. So the skipped step names `wide/kernel` and
nothing else. Finite steps feed zeros, so that kernel (whose gradient is
then zero) keeps its value. Paths are `variable.path`, which holds the
model's name: `sequential/wide/kernel`. The step runs as Keras' trainer
compiles it on each backend: `jax.jit` on JAX, `tf.function` on
TensorFlow (and XLA with `jit_compile=True`), eagerly on PyTorch.
"""

import keras
import numpy as np
import pytest
from testing import BACKEND

from keras_dtype_policy import LossScaleMonitor
from keras_dtype_policy import LossScaleOptimizer
from keras_dtype_policy.loss_scaling import gradient_check

HUGE = 1e36


def make_model(jit_compile="auto"):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(
                3,
                name="wide",
                kernel_initializer=keras.initializers.Constant(1.0 / HUGE),
            ),
            keras.layers.Dense(1, name="head"),
        ]
    )
    model.compile(
        LossScaleOptimizer(keras.optimizers.SGD(1e-3)),
        "mse",
        jit_compile=jit_compile,
    )
    return model


def batch(overflows):
    x = np.full((8, 4), HUGE if overflows else 0.0, "float32")
    return x, np.ones((8, 1), "float32")


def paths(model, *names):
    """The paths of the variables named "layer/weight", as Keras gives
    them (`variable.path`)."""
    found = []
    for name in names:
        layer, weight = name.split("/")
        found.append(getattr(model.get_layer(layer), weight).path)
    return found


def jit_settings():
    # XLA on TensorFlow is asked for explicitly; JAX compiles by default
    # and PyTorch runs eagerly (its jit_compile=True means torch.compile,
    # not what Keras' trainer does by default).
    if BACKEND == "tensorflow":
        return ["auto", True]
    return ["auto"]


@pytest.mark.parametrize("jit_compile", jit_settings())
def test_skipped_step_names_exactly_the_overflowing_variables(jit_compile):
    model = make_model(jit_compile)
    optimizer = model.optimizer
    for overflows in (False, False):
        model.train_on_batch(*batch(overflows))
    # Finite steps leave the attribution empty.
    assert optimizer.skipped_steps == 0
    assert optimizer.nonfinite_gradients == []
    assert optimizer.nonfinite_gradient_counts == {}

    model.train_on_batch(*batch(True))
    assert optimizer.skipped_steps == 1
    (kernel,) = paths(model, "wide/kernel")
    assert kernel.endswith("wide/kernel")
    assert optimizer.nonfinite_gradients == [kernel]
    assert optimizer.nonfinite_gradient_counts == {kernel: 1}
    for weight in model.weights:
        assert np.all(np.isfinite(keras.ops.convert_to_numpy(weight)))

    # A finite step keeps the last skipped step's names and the counts.
    model.train_on_batch(*batch(False))
    model.train_on_batch(*batch(True))
    assert optimizer.skipped_steps == 2
    assert optimizer.nonfinite_gradients == [kernel]
    assert optimizer.nonfinite_gradient_counts == {kernel: 2}


def test_each_skipped_step_names_its_own_variables():
    model = make_model()
    optimizer = model.optimizer
    model.train_on_batch(*batch(True))
    assert optimizer.nonfinite_gradients == paths(model, "wide/kernel")
    # NaN labels make every gradient NaN: all four variables are named.
    x, y = batch(False)
    model.train_on_batch(x, np.full_like(y, np.nan))
    everything = paths(
        model, "wide/kernel", "wide/bias", "head/kernel", "head/bias"
    )
    assert optimizer.nonfinite_gradients == everything
    assert optimizer.nonfinite_gradient_counts == dict(
        zip(everything, [2, 1, 1, 1], strict=True)
    )


def test_per_variable_check_is_not_run_on_finite_steps(monkeypatch):
    calls = []
    original = gradient_check.nonfinite_flags

    def counting(grads):
        calls.append(len(grads))
        return original(grads)

    monkeypatch.setattr(gradient_check, "nonfinite_flags", counting)
    model = make_model()
    for _ in range(4):
        model.train_on_batch(*batch(False))
    if BACKEND == "torch":
        # Eager steps: the skip branch is Python, never entered.
        assert calls == []
    else:
        # A compiled step traces both branches of its conditional once;
        # only the skip branch, at run time, executes the check. Four
        # steps trace the train function at most twice.
        assert len(calls) <= 2
    model.train_on_batch(*batch(True))
    assert model.optimizer.nonfinite_gradients == paths(model, "wide/kernel")


def training_data(overflow_at, steps):
    x = np.concatenate(
        [batch(i in overflow_at)[0] for i in range(steps)], axis=0
    )
    return x, np.ones((len(x), 1), "float32")


@pytest.mark.parametrize("record_steps", [True, False])
def test_monitor_logs_and_summarizes_where_steps_overflowed(
    record_steps, capsys
):
    model = make_model()
    # Four steps an epoch, the third overflows: steps 3 and 7 of the fit.
    x, y = training_data(overflow_at={2}, steps=4)
    monitor = LossScaleMonitor(record_steps=record_steps)
    history = model.fit(
        x, y, batch_size=8, epochs=2, shuffle=False, callbacks=[monitor]
    )
    (kernel,) = paths(model, "wide/kernel")
    # Logs hold numbers: how many variables overflowed in each epoch.
    assert history.history["nonfinite_gradient_variables"] == [1, 1]
    assert history.history["skipped_steps"] == [1, 2]
    if record_steps:
        assert monitor.skip_report == [
            {
                "epoch": 1,
                "step": 3,
                "skipped": 1,
                "gradients": {kernel: 1},
            },
            {
                "epoch": 2,
                "step": 7,
                "skipped": 1,
                "gradients": {kernel: 1},
            },
        ]
        expected = f"step 3 (epoch 1) skipped: non-finite gradients in {kernel}"
    else:
        assert monitor.skip_report == [
            {
                "epoch": epoch,
                "step": None,
                "skipped": 1,
                "gradients": {kernel: 1},
            }
            for epoch in (1, 2)
        ]
        expected = "epoch 1: 1 step(s) skipped"
    assert expected in monitor.summary()
    # Printed at the end of fit.
    assert expected in capsys.readouterr().out


def test_monitor_on_a_clean_run_logs_zero_and_prints_nothing(capsys):
    model = make_model()
    x, y = training_data(overflow_at=set(), steps=4)
    monitor = LossScaleMonitor()
    history = model.fit(x, y, batch_size=8, epochs=2, callbacks=[monitor])
    assert history.history["nonfinite_gradient_variables"] == [0, 0]
    assert monitor.skip_report == []
    assert monitor.summary() == "LossScaleMonitor: no step was skipped."
    assert "LossScaleMonitor" not in capsys.readouterr().out


def test_nonfinite_flags_one_per_gradient_none_for_none():
    finite = keras.ops.ones((3,))
    nan = keras.ops.convert_to_tensor(np.array([1.0, np.nan], "float32"))
    inf = keras.ops.convert_to_tensor(np.array([-np.inf], "float16"))
    flags = gradient_check.nonfinite_flags([finite, None, nan, inf])
    assert flags[1] is None
    assert [bool(flags[i]) for i in (0, 2, 3)] == [False, True, True]


def test_one_public_accessor_per_fact():
    optimizer = LossScaleOptimizer(keras.optimizers.SGD())
    optimizer.build([keras.Variable(np.ones((2,), "float32"))])
    public = {
        name
        for name in vars(optimizer)
        if not name.startswith("_")
        and ("nonfinite" in name or "skipped" in name or "record" in name)
    }
    assert public == set()
    accessors = {
        name
        for name in dir(type(optimizer))
        if not name.startswith("_") and ("nonfinite" in name or "skip" in name)
    }
    assert accessors == {
        "skipped_steps",
        "nonfinite_steps_in_a_row",
        "nonfinite_gradients",
        "nonfinite_gradient_counts",
    }
