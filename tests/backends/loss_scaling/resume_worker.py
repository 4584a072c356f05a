"""A training run that can be interrupted and resumed, in its own process.

    python resume_worker.py MODE WORK_DIR

MODE is `full` (5 epochs straight), `interrupted` (stops with an error at
the start of epoch 3, with BackupAndRestore and a full-model ModelCheckpoint
in WORK_DIR), `resume_backup` (reruns with BackupAndRestore, which picks up
from its backup) or `resume_checkpoint` (loads the ModelCheckpoint file and
fits from epoch 3). Each finished run writes its final state to
WORK_DIR/MODE.npz.
"""

import sys

import keras
import numpy as np

import keras_dtype_policy as kdp

EPOCHS, STOP_AT, BATCH = 5, 3, 8


class Interrupt(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == STOP_AT:
            raise RuntimeError("simulated interruption")


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6 * BATCH, 5)).astype("float32")
    y = (x[:, :1] * 2 - x[:, 2:3]).astype("float32")
    x[2 * BATCH] = np.inf  # one overflowing step per epoch
    return x, y


def new_model():
    keras.utils.set_random_seed(0)
    with kdp.policy_scope("mixed_float16"):
        model = keras.Sequential(
            [
                keras.Input((5,)),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(1, dtype="float32"),
            ]
        )
    model.compile(
        kdp.LossScaleOptimizer(
            keras.optimizers.Adam(1e-2),
            initial_scale=2.0**10,
            dynamic_growth_steps=3,
        ),
        "mse",
    )
    return model


def save_state(model, path):
    optimizer = model.optimizer
    arrays = {
        f"weight_{i}": keras.ops.convert_to_numpy(w)
        for i, w in enumerate(model.weights)
    }
    arrays.update(
        {
            f"optimizer_{i}": keras.ops.convert_to_numpy(v)
            for i, v in enumerate(optimizer.variables)
        }
    )
    arrays["loss_scale"] = np.array(optimizer.loss_scale)
    arrays["dynamic_counter"] = np.array(optimizer.dynamic_counter)
    arrays["skipped_steps"] = np.array(optimizer.skipped_steps)
    np.savez(path, **arrays)


def main(mode, work_dir):
    x, y = data()
    fit = dict(batch_size=BATCH, shuffle=False, verbose=0, epochs=EPOCHS)
    backup = keras.callbacks.BackupAndRestore(f"{work_dir}/backup")
    checkpoint_path = f"{work_dir}/checkpoint.keras"
    if mode == "full":
        model = new_model()
        model.fit(x, y, **fit)
    elif mode == "interrupted":
        model = new_model()
        checkpoint = keras.callbacks.ModelCheckpoint(checkpoint_path)
        model.fit(x, y, callbacks=[backup, checkpoint, Interrupt()], **fit)
    elif mode == "resume_backup":
        model = new_model()
        model.fit(x, y, callbacks=[backup], **fit)
    elif mode == "resume_checkpoint":
        model = keras.saving.load_model(checkpoint_path)
        model.fit(x, y, initial_epoch=STOP_AT, **fit)
    save_state(model, f"{work_dir}/{mode}.npz")


if __name__ == "__main__":
    main(*sys.argv[1:])
