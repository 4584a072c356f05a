"""`LossScaleMonitor` in `fit`, on the backend of this run.

Overflow is injected: a batch of 1e6 overflows float16 (whose largest
value is 65504) as the first layer casts it, so its gradients are not
finite and the step is skipped; the other batches are small. Every
expectation here holds on all three backends; on JAX the per-step reads go
through Keras' own state sync.
"""

import glob
import pathlib
import warnings

import keras
import numpy as np
import pytest
from testing import BACKEND
from testing import to_numpy

import keras_dtype_policy as kdp
from keras_dtype_policy import LossScaleMonitor
from keras_dtype_policy import LossScaleOptimizer

BATCH = 4
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def float16_model():
    keras.utils.set_random_seed(0)
    with kdp.policy_scope("mixed_float16"):
        return keras.Sequential(
            [
                keras.Input((3,)),
                keras.layers.Dense(8, activation="relu"),
                keras.layers.Dense(1, dtype="float32"),
            ]
        )


def data_with_overflow(batches, overflowing):
    """`batches` batches of BATCH rows; those in `overflowing` overflow.

    The other batches are small, and so are their scaled gradients: only
    the injected batches overflow, whatever the initial weights.
    """
    rng = np.random.default_rng(0)
    x = 0.1 * rng.normal(size=(batches * BATCH, 3)).astype("float32")
    for batch in overflowing:
        x[batch * BATCH : (batch + 1) * BATCH] = 1e6  # inf in float16
    y = np.zeros((batches * BATCH, 1), "float32")
    return x, y


def fit(model, x, y, callbacks, epochs=1):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # NaN losses
        return model.fit(
            x,
            y,
            batch_size=BATCH,
            epochs=epochs,
            shuffle=False,
            verbose=0,
            callbacks=callbacks,
        )


class LogSpy(keras.callbacks.Callback):
    """Records the epoch logs that the callbacks after the monitor see."""

    def __init__(self):
        super().__init__()
        self.logs = []

    def on_epoch_end(self, epoch, logs=None):
        self.logs.append(dict(logs))


def test_epoch_logs_reach_history_and_later_callbacks():
    model = float16_model()
    model.compile(keras.optimizers.SGD(1e-3), "mse")
    x, y = data_with_overflow(6, overflowing=[1, 4])
    spy = LogSpy()
    history = fit(model, x, y, [LossScaleMonitor(), spy], epochs=2)
    # Two skipped steps per epoch, each halving the scale from 2**15.
    assert history.history["loss_scale"] == [2.0**13, 2.0**11]
    assert history.history["skipped_steps"] == [2, 4]
    assert [logs["loss_scale"] for logs in spy.logs] == [2.0**13, 2.0**11]
    assert model.optimizer.loss_scale == 2.0**11
    assert model.optimizer.skipped_steps == 4
    assert int(to_numpy(model.optimizer.iterations)) == 8


def test_trajectory_marks_the_skipped_steps():
    model = float16_model()
    model.compile(keras.optimizers.SGD(1e-3), "mse")
    x, y = data_with_overflow(5, overflowing=[1, 3])
    monitor = LossScaleMonitor(record_steps=True)
    fit(model, x, y, [monitor], epochs=2)
    trajectory = monitor.trajectory
    assert trajectory["step"] == list(range(1, 11))
    assert trajectory["epoch"] == [1] * 5 + [2] * 5
    assert trajectory["skipped"] == [False, True, False, True, False] * 2
    scales = [2.0**15, 2.0**14, 2.0**14, 2.0**13, 2.0**13]
    assert trajectory["loss_scale"] == scales + [s / 4 for s in scales]
    assert trajectory["loss"][0] is not None


def test_stops_after_consecutive_skips_and_says_why(capsys):
    model = float16_model()
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(1e-3), initial_scale=4.0
    )
    model.compile(optimizer, "mse")
    x, y = data_with_overflow(10, overflowing=range(10))
    monitor = LossScaleMonitor(max_consecutive_skips=3)
    history = fit(model, x, y, [monitor], epochs=5)
    # 4 -> 2 -> 1 -> 1: the floor is reached and every step is skipped.
    assert model.optimizer.skipped_steps == 3
    assert model.optimizer.loss_scale == 1.0
    assert len(history.history["loss"]) == 1  # no second epoch
    assert model.stop_training
    reason = monitor.stop_reason
    assert "3 steps in a row were skipped" in reason
    assert "its floor (min_scale=1)" in reason
    assert reason in capsys.readouterr().out


def test_finite_steps_in_between_restart_the_count():
    model = float16_model()
    model.compile(keras.optimizers.SGD(1e-3), "mse")
    x, y = data_with_overflow(9, overflowing=[0, 1, 3, 4, 6, 7])
    monitor = LossScaleMonitor(max_consecutive_skips=3, verbose=0)
    fit(model, x, y, [monitor])
    assert monitor.stop_reason is None
    assert model.optimizer.skipped_steps == 6


def test_keras_own_loss_scale_optimizer_logs_its_scale():
    model = float16_model()
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1e-3))
    model.compile(optimizer, "mse")
    x, y = data_with_overflow(4, overflowing=[2])
    monitor = LossScaleMonitor(record_steps=True)
    history = fit(model, x, y, [monitor])
    assert history.history["loss_scale"] == [2.0**14]
    # Keras' optimizer keeps no count of skipped steps.
    assert "skipped_steps" not in history.history
    # A step is taken as skipped when `iterations` did not advance.
    assert monitor.trajectory["skipped"] == [False, False, True, False]


def test_an_optimizer_without_loss_scaling_warns_and_logs_nothing():
    model = float16_model()
    model.compile(keras.optimizers.SGD(1e-3), "mse", auto_scale_loss=False)
    x, y = data_with_overflow(2, overflowing=[])
    with pytest.warns(UserWarning, match="nothing to monitor"):
        history = fit(model, x, y, [LossScaleMonitor()])
    assert "loss_scale" not in history.history


def test_epoch_only_monitor_leaves_batch_end_to_keras():
    # Keras dispatches batch callbacks asynchronously only when no
    # callback overrides on_train_batch_end.
    assert "on_train_batch_end" not in vars(LossScaleMonitor())
    assert "on_train_batch_end" in vars(LossScaleMonitor(record_steps=True))
    assert "on_train_batch_end" in vars(
        LossScaleMonitor(max_consecutive_skips=5)
    )


def test_writes_a_png_plot(tmp_path):
    pytest.importorskip("matplotlib")
    model = float16_model()
    model.compile(keras.optimizers.SGD(1e-3), "mse")
    x, y = data_with_overflow(6, overflowing=[2])
    path = tmp_path / "scale.png"
    monitor = LossScaleMonitor(plot_path=path)
    assert monitor.record_steps
    fit(model, x, y, [monitor])
    assert path.read_bytes().startswith(PNG_SIGNATURE)
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(path).shape
    assert width > 600 and height > 400


def test_values_reach_tensorboard(tmp_path):
    if BACKEND != "tensorflow":
        pytest.skip(
            "keras.callbacks.TensorBoard writes through TensorFlow, which "
            "only the tensorflow test env installs; it runs there"
        )
    import tensorflow as tf

    model = float16_model()
    model.compile(keras.optimizers.SGD(1e-3), "mse")
    x, y = data_with_overflow(4, overflowing=[1])
    board = keras.callbacks.TensorBoard(str(tmp_path))
    fit(model, x, y, [LossScaleMonitor(), board], epochs=2)
    found = {}
    for path in glob.glob(str(tmp_path / "train" / "*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.tag.startswith("epoch_"):
                    found[(value.tag, event.step)] = float(
                        tf.make_ndarray(value.tensor)
                    )
    assert found[("epoch_loss_scale", 0)] == 2.0**14
    assert found[("epoch_loss_scale", 1)] == 2.0**13
    assert found[("epoch_skipped_steps", 1)] == 2


@pytest.mark.parametrize(
    "kwargs, error, fragment",
    [
        ({"record_steps": "yes"}, TypeError, "record_steps='yes'"),
        ({"max_consecutive_skips": 0}, ValueError, "max_consecutive_skips=0"),
        ({"max_consecutive_skips": 2.5}, TypeError, "max_consecutive_skips"),
        ({"max_consecutive_skips": True}, TypeError, "max_consecutive_skips"),
        ({"plot_path": 5}, TypeError, "plot_path=5"),
        ({"plot_path": "scale.jpg"}, ValueError, "plot_path='scale.jpg'"),
        ({"verbose": 2}, ValueError, "verbose=2"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, fragment):
    with pytest.raises(error, match=fragment.replace(".", r"\.")):
        LossScaleMonitor(**kwargs)


def test_a_plot_without_matplotlib_says_which_extra(monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args):
        return None if name == "matplotlib" else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ImportError, match=r"keras_dtype_policy\[plot\]"):
        LossScaleMonitor(plot_path=pathlib.Path("scale.png"))
