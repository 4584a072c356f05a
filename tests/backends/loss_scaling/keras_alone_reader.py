"""Reads files the package saved, with Keras alone, in its own process.

    python keras_alone_reader.py WORK_DIR

Never imports keras_dtype_policy (and fails if anything did). Loads
WORK_DIR/model.keras and WORK_DIR/model.h5 (uncompiled) with
`keras.saving.load_model`,
and WORK_DIR/model.weights.h5 into the same model built and compiled by
Keras alone (under a global mixed_float16 policy, which Keras alone needs
to wrap a loaded model's optimizer again, for its own files too), then
writes each one's state to WORK_DIR/alone_<format>.npz:
weights, optimizer variables, the optimizer's class name, loss scale,
counter and step count.
"""

import sys
import warnings

import keras
import numpy as np


def new_model():
    keras.config.set_dtype_policy("mixed_float16")
    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(4, activation="relu"),
            keras.layers.Dense(1, dtype="float32"),
        ]
    )
    keras.config.set_dtype_policy("float32")
    model.compile(keras.optimizers.Adam(0.01), "mse")
    return model


def save_state(model, path, caught):
    arrays = {
        f"weight_{i}": keras.ops.convert_to_numpy(w)
        for i, w in enumerate(model.weights)
    }
    arrays["warnings"] = np.array([str(w.message) for w in caught] or [""])
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        np.savez(path, **arrays)
        return
    arrays.update(
        {
            f"optimizer_{i}": keras.ops.convert_to_numpy(v)
            for i, v in enumerate(optimizer.variables)
        }
    )
    arrays["class_name"] = np.array(type(optimizer).__name__)
    arrays["iterations"] = keras.ops.convert_to_numpy(optimizer.iterations)
    arrays["loss_scale"] = keras.ops.convert_to_numpy(optimizer.dynamic_scale)
    arrays["step_counter"] = keras.ops.convert_to_numpy(optimizer.step_counter)
    np.savez(path, **arrays)


def main(work_dir):
    for file_format in ("keras", "h5", "weights_h5"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if file_format == "weights_h5":
                model = new_model()
                model.optimizer.build(model.trainable_variables)
                model.load_weights(f"{work_dir}/model.weights.h5")
            else:
                # Keras re-wraps the optimizer of a loaded model only under
                # a global mixed_float16 policy, its own files included.
                keras.config.set_dtype_policy("mixed_float16")
                # An .h5 file names the package's optimizer class, which
                # Keras alone cannot compile: its weights load uncompiled.
                model = keras.saving.load_model(
                    f"{work_dir}/model.{file_format}",
                    compile=file_format == "keras",
                )
                keras.config.set_dtype_policy("float32")
        save_state(model, f"{work_dir}/alone_{file_format}.npz", caught)
    if "keras_dtype_policy" in sys.modules:
        raise RuntimeError("keras_dtype_policy was imported")


if __name__ == "__main__":
    main(sys.argv[1])
