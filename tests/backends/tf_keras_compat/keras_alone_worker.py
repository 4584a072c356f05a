"""Keras alone, in a process of its own, on the files of `save_for_keras`.

    python keras_alone_worker.py WORK_DIR

Never imports keras_dtype_policy (and fails if anything did). For each
WORK_DIR/exported_*.keras it loads the file (`safe_mode` on), predicts
WORK_DIR/x.npy, then trains one epoch on (x.npy, y.npy), and writes
WORK_DIR/read_<name>.npz: the predictions, the layers' policies, the
optimizer's class, step count, `loss_scale_factor` and variables (by
path) as loaded, the loss
and step count after training. Then it trains, under Keras' "bfloat16" and
"mixed_bfloat16" policies, a model of its own, saved as
WORK_DIR/alone_<policy>.keras with its predictions in
WORK_DIR/alone_<policy>.npz. Prints one JSON line.
"""

import json
import pathlib
import sys

import keras
import numpy as np


def layer_policies(model):
    return {layer.name: layer.dtype_policy.name for layer in model.layers}


def read(path, x, y):
    model = keras.saving.load_model(path)
    predictions = keras.ops.convert_to_numpy(model.predict(x, verbose=0))
    optimizer = model.optimizer
    arrays = {
        "predictions": predictions,
        "policies": np.array(json.dumps(layer_policies(model))),
        "optimizer": np.array(type(optimizer).__name__),
        "iterations": keras.ops.convert_to_numpy(optimizer.iterations),
        "loss_scale_factor": np.array(optimizer.loss_scale_factor or 0.0),
    }
    for variable in optimizer.variables:
        value = keras.ops.convert_to_numpy(
            keras.ops.cast(variable.value, "float32")
        )
        arrays[f"slot:{variable.path}"] = value
        arrays[f"dtype:{variable.path}"] = np.array(str(variable.dtype))
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    arrays["loss"] = np.array(history.history["loss"][-1])
    arrays["trained_iterations"] = keras.ops.convert_to_numpy(
        optimizer.iterations
    )
    return arrays


def train_alone(policy, x, y):
    model = keras.Sequential(
        [
            keras.Input((x.shape[1],)),
            keras.layers.Dense(
                128, activation="relu", dtype=policy, name="dense"
            ),
            keras.layers.Dense(4, dtype="float32", name="head"),
        ],
        name=f"alone_{policy}",
    )
    model.compile(keras.optimizers.Adam(0.01), "mse")
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    return model


def main(work_dir):
    work_dir = pathlib.Path(work_dir)
    x = np.load(work_dir / "x.npy")
    y = np.load(work_dir / "y.npy")
    read_files = []
    for path in sorted(work_dir.glob("exported_*.keras")):
        arrays = read(path, x, y)
        name = path.stem[len("exported_") :]
        np.savez(work_dir / f"read_{name}.npz", **arrays)
        read_files.append(name)
    for policy in ("bfloat16", "mixed_bfloat16"):
        model = train_alone(policy, x, y)
        model.save(work_dir / f"alone_{policy}.keras")
        predictions = keras.ops.convert_to_numpy(model.predict(x, verbose=0))
        np.savez(work_dir / f"alone_{policy}.npz", predictions=predictions)
    leaked = sorted(m for m in sys.modules if m.startswith("keras_dtype"))
    if leaked:
        raise SystemExit(f"the package was imported: {leaked}")
    print(json.dumps({"read": read_files, "package_imported": False}))


if __name__ == "__main__":
    main(sys.argv[1])
