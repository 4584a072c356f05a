"""One side of a cross-backend round trip, run in its own process.

    KERAS_BACKEND=torch python worker.py save MODEL.keras STATE.json
    KERAS_BACKEND=jax python worker.py load MODEL.keras STATE.json

`save` trains a mixed-precision model with the plugin's optimizer (one step
overflows, so the loss scale moves) and saves it; `load` loads it. Both
write what they see to STATE.json: every layer's policy, the loss-scale
state, every optimizer value, the predictions on fixed inputs, and which
backend libraries the process imported beyond those `import keras` did.
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
    if mode == "save":
        model = build_and_train()
        model.save(model_path)
    else:
        model = keras.saving.load_model(model_path)
    with open(state_path, "w") as f:
        json.dump(describe(model), f)


if __name__ == "__main__":
    main(*sys.argv[1:])
