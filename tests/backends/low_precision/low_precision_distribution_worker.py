"""Trains a bfloat16 model under a low-precision update policy twice.

    KERAS_BACKEND=jax|tensorflow python low_precision_distribution_worker.py \
        POLICY

Once on one device, once on two: `keras.distribution.DataParallel` over two
forced host devices on JAX, `tf.distribute.MirroredStrategy` over two
logical CPUs on TensorFlow (both set before the backend starts, hence a
process of its own). Prints one JSON line: each run's optimizer class,
losses and weights.
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


def run(policy, distributed):
    keras.utils.set_random_seed(0)
    rng = np.random.RandomState(0)
    x = rng.randn(128, 8).astype("float32")
    y = (x @ rng.randn(8, 1)).astype("float32")

    def build():
        with kdp.policy_scope(policy):
            model = keras.Sequential(
                [
                    keras.Input((8,)),
                    keras.layers.Dense(16, activation="tanh"),
                    keras.layers.Dense(1),
                ]
            )
        model.compile(keras.optimizers.Adam(0.01), "mse")
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
    keras.distribution.set_distribution(None)
    weights = [
        keras.ops.convert_to_numpy(keras.ops.cast(w, "float32")).tolist()
        for w in model.weights
    ]
    return {
        "optimizer": type(model.optimizer).__name__,
        "losses": losses,
        "weights": weights,
    }


policy = sys.argv[1]
result = {"single": run(policy, False), "distributed": run(policy, True)}
print(json.dumps(result))
