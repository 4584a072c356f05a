"""Trains a model with 8-bit Adam state on one device, then on two.

    KERAS_BACKEND=jax|tensorflow python quantized_state_worker.py FOLDER

`keras.distribution.DataParallel` over two forced host devices on JAX,
`tf.distribute.MirroredStrategy` over two logical CPUs on TensorFlow (both
set before the backend starts, hence a process of its own). The two-device
model is saved to FOLDER and loaded back. Prints one JSON line: each run's
losses and weights, how many codes variables the optimizer has, and
whether the reloaded optimizer state equals the saved one bit for bit.
"""

import json
import os
import sys

backend = os.environ["KERAS_BACKEND"]
if backend == "jax":
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dtype_policy as kdp  # noqa: E402

if backend == "tensorflow":
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2
    )


def values(optimizer):
    return [keras.ops.convert_to_numpy(v) for v in optimizer.variables]


def run(distributed, folder):
    keras.utils.set_random_seed(0)
    rng = np.random.RandomState(0)
    x = rng.randn(128, 64).astype("float32")
    y = (x @ rng.randn(64, 1) * 0.1).astype("float32")

    def build():
        model = keras.Sequential(
            [
                keras.Input((64,)),
                keras.layers.Dense(64, activation="tanh"),
                keras.layers.Dense(1),
            ]
        )
        model.compile(
            kdp.LowPrecisionOptimizer(
                keras.optimizers.Adam(0.01), state_dtype="8bit", seed=2
            ),
            "mse",
        )
        return model

    if distributed and backend == "tensorflow":
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        with strategy.scope():
            model = build()
    else:
        if distributed:
            keras.distribution.set_distribution(
                keras.distribution.DataParallel()
            )
        model = build()
    losses = model.fit(
        x, y, batch_size=32, epochs=3, verbose=0, shuffle=False
    ).history["loss"]
    reloaded_exactly = None
    if distributed:
        path = os.path.join(folder, "distributed.keras")
        model.save(path)
        restored = keras.saving.load_model(path)
        saved, loaded = values(model.optimizer), values(restored.optimizer)
        reloaded_exactly = len(saved) == len(loaded) and all(
            np.array_equal(a, b) for a, b in zip(saved, loaded, strict=True)
        )
    keras.distribution.set_distribution(None)
    return {
        "losses": losses,
        "weights": [
            keras.ops.convert_to_numpy(w).tolist() for w in model.weights
        ],
        "codes": sum(
            v.path.endswith("_codes") for v in model.optimizer.variables
        ),
        "reloaded_exactly": reloaded_exactly,
    }


folder = sys.argv[1]
result = {"single": run(False, folder), "distributed": run(True, folder)}
print(json.dumps(result))
