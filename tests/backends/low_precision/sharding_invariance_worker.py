"""One device count's runs for test_sharding_invariance.py.

    KERAS_BACKEND=jax python sharding_invariance_worker.py OUT_DIR DEVICES \
        CONFIGURATION...

The device count must be set before JAX starts, hence a process of its
own. For each CONFIGURATION (a policy name) it trains the same model on
the same batches with no distribution, under `DataParallel` with and without
`shard_optimizer_state`, and under `ModelParallel` (a `LayoutMap` splitting
the first kernel along a "model" axis) with and without it; it writes each
run's weights to `OUT_DIR/<devices>-<configuration>-<layout>.npz` and
prints one JSON line: each run's optimizer state as `{path: [dtype, global
shape]}` and its bytes.
"""

import json
import os
import pathlib
import sys

DEVICES = int(sys.argv[2])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES}"
import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dtype_policy as kdp  # noqa: E402

LAYOUTS = ("none", "data", "data_sharded", "model", "model_sharded")
rng = np.random.RandomState(0)
X = rng.randn(64, 64).astype("float32")
Y = np.tanh(X @ rng.randn(64, 8)).astype("float32")


def distribution(layout):
    devices = keras.distribution.list_devices()
    if layout.startswith("data"):
        return keras.distribution.DataParallel(devices=devices)
    model_axis = 2 if DEVICES > 1 else 1
    mesh = keras.distribution.DeviceMesh(
        (DEVICES // model_axis, model_axis), ("batch", "model"), devices
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["dense/kernel"] = (None, "model")
    return keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )


def train(configuration, layout):
    keras.utils.clear_session()
    keras.distribution.set_distribution(
        None if layout == "none" else distribution(layout)
    )
    keras.utils.set_random_seed(0)
    with kdp.policy_scope(configuration):
        model = keras.Sequential(
            [
                keras.Input((64,)),
                # 8192 elements: quantized state; the second kernel's 1024
                # keep float32 state (under MIN_QUANTIZED_SIZE).
                keras.layers.Dense(128, activation="tanh", name="dense"),
                keras.layers.Dense(8, name="head"),
            ]
        )
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    if layout.endswith("sharded"):
        kdp.shard_optimizer_state(model.optimizer)
    model.fit(X, Y, batch_size=32, epochs=2, verbose=0, shuffle=False)
    state = {
        v.path: [keras.backend.standardize_dtype(v.dtype), list(v.shape)]
        for v in model.optimizer.variables
    }
    state_bytes = sum(v.value.nbytes for v in model.optimizer.variables)
    weights = {
        w.path: keras.ops.convert_to_numpy(keras.ops.cast(w, "float32"))
        for w in model.weights
    }
    keras.distribution.set_distribution(None)
    return state, state_bytes, weights


def main():
    out = pathlib.Path(sys.argv[1])
    assert len(keras.distribution.list_devices()) == DEVICES
    found = {}
    for configuration in sys.argv[3:]:
        for layout in LAYOUTS:
            state, state_bytes, weights = train(configuration, layout)
            name = f"{DEVICES}-{configuration}-{layout}"
            np.savez(out / f"{name}.npz", **weights)
            found[name] = {"state": state, "state_bytes": state_bytes}
    print(json.dumps(found))


if __name__ == "__main__":
    main()
