"""Saving mid-training, loading and training on equals never stopping.

For every way Keras saves a training run (.keras, .h5, .weights.h5 with
the optimizer state it holds, BackupAndRestore, and tf.train.Checkpoint on
TensorFlow), with no loss scaling, the dynamic scale the compile hook
installs, an explicit dynamic and a fixed scale: a run of
three steps, saved, loaded and trained three more steps, ends with the
weights, step count, loss scale, counters and every optimizer slot of a
straight run of six steps, bitwise, on every backend (the tiny model's
steps are deterministic on the CPU backends).
"""

import warnings

import keras
import numpy as np
import pytest
from testing import BACKEND
from testing import to_numpy

import keras_dtype_policy as kdp

# One xdist worker takes the whole module (`--dist loadgroup`), so its
# module fixture, which trains and saves for a while, runs once a run.
pytestmark = pytest.mark.xdist_group("resume_formats")

BATCH, BATCHES = 4, 3
MODES = ("float32", "auto", "dynamic", "fixed")
FORMATS = ("keras", "h5", "weights_h5", "backup", "tf_checkpoint")


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * BATCHES, 3)).astype("float32")
    y = (x[:, :1] * 2 - x[:, 1:2]).astype("float32")
    return x, y


def overflowing_data():
    x, y = data()
    x[BATCH] = np.inf  # the second step overflows: it is skipped
    return x, y


def new_model(mode):
    keras.utils.set_random_seed(0)
    policy = "float32" if mode == "float32" else "mixed_float16"
    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(4, activation="relu", dtype=policy),
            keras.layers.Dense(1, dtype="float32"),
        ]
    )
    # "auto": the compile hook wraps Adam in the dynamic wrapper with its
    # defaults, and the compile config names Adam.
    optimizer = keras.optimizers.Adam(0.01)
    if mode == "dynamic":
        optimizer = kdp.LossScaleOptimizer(
            optimizer, initial_scale=2.0**10, dynamic_growth_steps=2
        )
    elif mode == "fixed":
        optimizer = kdp.LossScaleOptimizer(
            optimizer, dynamic=False, initial_scale=128.0
        )
    model.compile(optimizer, "mse")
    return model


def fit(model, mode, epochs=1, **kwargs):
    x, y = data() if mode == "float32" else overflowing_data()
    model.fit(
        x,
        y,
        batch_size=BATCH,
        shuffle=False,
        verbose=0,
        epochs=epochs,
        **kwargs,
    )


def state(model):
    optimizer = model.optimizer
    arrays = {f"weight {i}": to_numpy(w) for i, w in enumerate(model.weights)}
    arrays.update(
        {
            f"optimizer {i}": to_numpy(v)
            for i, v in enumerate(optimizer.variables)
        }
    )
    arrays["iterations"] = to_numpy(optimizer.iterations)
    if isinstance(optimizer, kdp.LossScaleOptimizer):
        arrays["loss scale"] = np.array(optimizer.loss_scale)
        arrays["dynamic counter"] = np.array(optimizer.dynamic_counter)
        arrays["skipped steps"] = np.array(optimizer.skipped_steps)
    return arrays


class Interrupt(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 1:
            raise RuntimeError("simulated interruption")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per mode, a straight run of six steps, saved in every format after
    the third; returns its final state and the directory of its files.

    Saving reads the state and changes nothing, so the run that saved
    stands for the uninterrupted one (`test_saving_changes_no_state`).
    """
    runs = {}
    for mode in MODES:
        directory = tmp_path_factory.mktemp(f"saved_{mode}")
        model = new_model(mode)
        fit(model, mode)
        model.save(directory / "model.keras")
        with warnings.catch_warnings():
            # Keras warns that .h5 is a legacy format.
            warnings.simplefilter("ignore", UserWarning)
            model.save(directory / "model.h5")
        model.save_weights(directory / "model.weights.h5")
        if BACKEND == "tensorflow":
            import tensorflow as tf

            checkpoint = tf.train.Checkpoint(
                model=model, optimizer=model.optimizer
            )
            checkpoint.write(str(directory / "checkpoint"))
        fit(model, mode)
        runs[mode] = state(model), directory
    return runs


def resumed_run(mode, file_format, directory, tmp_path):
    if file_format == "backup":
        backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
        with pytest.raises(RuntimeError, match="simulated interruption"):
            fit(new_model(mode), mode, 2, callbacks=[backup, Interrupt()])
        model = new_model(mode)
        fit(model, mode, 2, callbacks=[backup])
        return model
    if file_format in ("keras", "h5"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            model = keras.saving.load_model(directory / f"model.{file_format}")
    elif file_format == "weights_h5":
        model = new_model(mode)
        model.load_weights(directory / "model.weights.h5")
    elif file_format == "tf_checkpoint":
        import tensorflow as tf

        model = new_model(mode)
        # Slots are restored into a built optimizer, as in Keras alone.
        model.optimizer.build(model.trainable_variables)
        checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
        checkpoint.read(str(directory / "checkpoint")).assert_consumed()
    fit(model, mode)
    return model


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("file_format", FORMATS)
def test_resumed_run_equals_the_straight_run(runs, mode, file_format, tmp_path):
    if file_format == "tf_checkpoint" and BACKEND != "tensorflow":
        pytest.skip("tf.train.Checkpoint exists on TensorFlow only")
    straight, directory = runs[mode]
    resumed = state(resumed_run(mode, file_format, directory, tmp_path))
    assert sorted(resumed) == sorted(straight)
    if mode == "float32":
        assert int(straight["iterations"]) == 2 * BATCHES
    else:
        # One overflowing step per epoch, skipped: not counted as an
        # iteration. A dynamic scale halves at each (growing after two
        # finite steps with dynamic_growth_steps=2, never with 2000).
        assert int(straight["skipped steps"]) == 2
        assert int(straight["iterations"]) == 2 * BATCHES - 2
        expected_scale = {"auto": 2.0**13, "dynamic": 2.0**9, "fixed": 128.0}
        assert float(straight["loss scale"]) == expected_scale[mode]
    for key, value in straight.items():
        np.testing.assert_array_equal(resumed[key], value, err_msg=key)


def test_saving_changes_no_state(runs):
    # A run that never saved ends as the run that saved in every format.
    model = new_model("dynamic")
    fit(model, "dynamic", epochs=2)
    never_saved, straight = state(model), runs["dynamic"][0]
    for key, value in straight.items():
        np.testing.assert_array_equal(never_saved[key], value, err_msg=key)
