"""One side of a cross-backend round trip, run in its own process.

    KERAS_BACKEND=torch python worker.py save MODEL.keras STATE.json
    KERAS_BACKEND=jax python worker.py load MODEL.keras STATE.json

`save` trains a mixed-precision model with the plugin's optimizer (one step
overflows, so the loss scale moves) and saves it; `load` loads it. Both
write what they see to STATE.json: every layer's policy, the loss-scale
state, every optimizer value, the predictions on fixed inputs, and which
backend libraries the process imported beyond those `import keras` did.
Beside it, each side saves (or loads) a `kahan_bfloat16` model trained by
the `LowPrecisionOptimizer` the compile hook installs: its bfloat16
weights, compensation buffers and bfloat16 optimizer state go under
"low_precision" in STATE.json. A float32 model trained with 8-bit Adam state
(`state_dtype="8bit"`) goes the same way: its codes, scales and every other
optimizer value under "quantized".
"""

import json
import sys

import keras
import numpy as np

import keras_dtype_policy as kdp

BACKEND_LIBRARIES = ("tensorflow", "jax", "torch")
# Keras itself imports some backend libraries when they are installed.
IMPORTED_BEFORE = {name for name in BACKEND_LIBRARIES if name in sys.modules}
INPUTS = np.linspace(-1.0, 1.0, 48, dtype="float32").reshape(8, 6)


def build_and_train():
    keras.utils.set_random_seed(0)
    with kdp.policy_scope("mixed_float16"):
        inputs = keras.Input((6,))
        x = keras.layers.Dense(16, activation="relu", name="hidden")(inputs)
        x = keras.layers.Dense(
            8, dtype=kdp.DTypePolicy("mixed_bfloat16"), name="bf16"
        )(x)
        outputs = keras.layers.Dense(1, dtype="float32", name="head")(x)
        model = keras.Model(inputs, outputs)
    model.compile(
        kdp.LossScaleOptimizer(
            keras.optimizers.Adam(1e-2), initial_scale=2.0**10
        ),
        "mse",
    )
    targets = np.ones((8, 1), "float32")
    for batch in [INPUTS, INPUTS * 1e6, INPUTS, INPUTS]:
        model.train_on_batch(batch, targets)
    return model


def build_and_train_low_precision():
    keras.utils.set_random_seed(0)
    with kdp.policy_scope("kahan_bfloat16"):
        model = keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(16, activation="relu", name="hidden"),
                keras.layers.Dense(1, name="head"),
            ]
        )
    model.compile(keras.optimizers.Adam(1e-3), "mse")
    targets = np.ones((8, 1), "float32")
    for _ in range(3):
        model.train_on_batch(INPUTS, targets)
    return model


def build_and_train_quantized():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(1024, activation="relu", name="wide"),
            keras.layers.Dense(1, name="head"),
        ],
        name="quantized",
    )
    model.compile(
        kdp.LowPrecisionOptimizer(
            keras.optimizers.Adam(1e-3), state_dtype="8bit", seed=0
        ),
        "mse",
    )
    targets = np.ones((8, 1), "float32")
    for _ in range(3):
        model.train_on_batch(INPUTS, targets)
    return model


def describe_quantized(model):
    optimizer = model.optimizer
    return {
        "optimizer": type(optimizer).__name__,
        "state_dtype": optimizer.state_dtype,
        "names": [v.name for v in optimizer.variables],
        "dtypes": [str(v.dtype) for v in optimizer.variables],
        "optimizer_values": [
            np.asarray(keras.ops.convert_to_numpy(v), "float64").tolist()
            for v in optimizer.variables
        ],
    }


def describe_low_precision(model):
    optimizer = model.optimizer
    return {
        "optimizer": type(optimizer).__name__,
        "update": optimizer.update,
        "weight_dtypes": [str(w.dtype) for w in model.weights],
        "weights": [
            np.asarray(keras.ops.convert_to_numpy(w), "float64").tolist()
            for w in model.weights
        ],
        "optimizer_values": [
            np.asarray(keras.ops.convert_to_numpy(v), "float64").tolist()
            for v in optimizer.variables
        ],
    }


def describe(model):
    optimizer = model.optimizer
    return {
        "backend": keras.backend.backend(),
        "policies": [
            [
                layer.name,
                type(layer.dtype_policy).__name__,
                layer.dtype_policy.name,
                layer.compute_dtype,
                layer.variable_dtype,
            ]
            for layer in model.layers
            # An InputLayer computes nothing; its policy is the global one
            # at the time it is rebuilt.
            if not isinstance(layer, keras.layers.InputLayer)
        ],
        "optimizer": type(optimizer).__name__,
        "loss_scale": optimizer.loss_scale,
        "dynamic_counter": optimizer.dynamic_counter,
        "skipped_steps": optimizer.skipped_steps,
        "optimizer_values": [
            np.asarray(keras.ops.convert_to_numpy(v), "float64").tolist()
            for v in optimizer.variables
        ],
        "predictions": np.asarray(
            model.predict(INPUTS, verbose=0), "float64"
        ).tolist(),
        "newly_imported": sorted(
            name
            for name in BACKEND_LIBRARIES
            if name in sys.modules and name not in IMPORTED_BEFORE
        ),
    }


def main(mode, model_path, state_path):
    low_precision_path = model_path.replace(".keras", "_low_precision.keras")
    quantized_path = model_path.replace(".keras", "_quantized.keras")
    if mode == "save":
        model = build_and_train()
        model.save(model_path)
        low_precision = build_and_train_low_precision()
        low_precision.save(low_precision_path)
        quantized = build_and_train_quantized()
        quantized.save(quantized_path)
    else:
        model = keras.saving.load_model(model_path)
        low_precision = keras.saving.load_model(low_precision_path)
        quantized = keras.saving.load_model(quantized_path)
    state = describe(model)
    state["low_precision"] = describe_low_precision(low_precision)
    state["quantized"] = describe_quantized(quantized)
    with open(state_path, "w") as f:
        json.dump(state, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
