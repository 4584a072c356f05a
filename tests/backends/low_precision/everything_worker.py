"""Everything of the low-precision wing at once, across device counts.

    KERAS_BACKEND=jax python everything_worker.py OUT_DIR DEVICES PHASE

A model under `"float8_from_mixed_float16"` (float8 Dense layers, the
compile hook's dynamic `LossScaleOptimizer`) trains with a
`MultiOptimizer` whose first layer's Adam keeps 8-bit state, the whole
optimizer sharded (`shard_optimizer_state`) under `DataParallel`. PHASE
`train` trains it on DEVICES forced host devices through a batch that
overflows, saves it, and continues one epoch; PHASE `resume` loads the
file on DEVICES devices (sharded again where there are several),
compares the loaded state with the saved one and continues the same
epoch. The device count must be set before JAX starts, hence a process of
its own. Prints one JSON line of findings.
"""

import json
import os
import pathlib
import sys

os.environ["XLA_FLAGS"] = (
    f"--xla_force_host_platform_device_count={int(sys.argv[2])}"
)
import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dtype_policy as kdp  # noqa: E402

POLICY = "float8_from_mixed_float16"
rng = np.random.RandomState(0)
X = rng.randn(64, 64).astype("float32")
Y = np.tanh(X @ rng.randn(64, 8)).astype("float32")
# The third batch of the first epoch overflows float16: the loss scale
# halves and the step is skipped, the float8 scales left as they were.
X_OVERFLOW = X.copy()
X_OVERFLOW[40] = 1e6


def build():
    keras.utils.set_random_seed(0)
    with kdp.policy_scope(POLICY):
        model = keras.Sequential(
            [
                keras.Input((64,)),
                keras.layers.Dense(128, activation="tanh", name="hidden"),
                keras.layers.Dense(8, name="head"),
            ]
        )
    eight_bit = kdp.LowPrecisionOptimizer(
        keras.optimizers.Adam(1e-2), "nearest", "8bit", seed=1
    )
    optimizer = keras.optimizers.MultiOptimizer(
        keras.optimizers.OptimizerMap(
            keras.optimizers.Adam(1e-2), {".*hidden/.*": eight_bit}
        )
    )
    model.compile(optimizer, "mse")
    return model


def fit(model, x, epochs=1):
    model.fit(x, Y, batch_size=16, epochs=epochs, verbose=0, shuffle=False)


def arrays(variables):
    """The variables' values by position (a loaded model's paths differ)."""
    return {
        f"{i}": keras.ops.convert_to_numpy(keras.ops.cast(v, "float32"))
        if "float" in str(v.dtype)
        else keras.ops.convert_to_numpy(v)
        for i, v in enumerate(variables)
    }


def device_share(optimizer):
    """Bytes of optimizer state on the first device over its whole bytes."""
    local = whole = 0
    for variable in optimizer.variables:
        whole += variable.value.nbytes
        local += variable.value.addressable_shards[0].data.nbytes
    return local / whole


def distribute(devices):
    if devices > 1:
        keras.distribution.set_distribution(keras.distribution.DataParallel())


def describe(model):
    optimizer = model.optimizer
    multi = optimizer.inner_optimizer
    return {
        "optimizer": type(optimizer).__name__,
        "inner": type(multi).__name__,
        "policies": [layer.dtype_policy.name for layer in model.layers],
        "state_dtypes": {
            v.path: str(v.dtype) for v in optimizer.variables if v.ndim
        },
        "share": device_share(optimizer),
        "dynamic_scale": float(
            keras.ops.convert_to_numpy(optimizer.dynamic_scale)
        ),
        "iterations": int(keras.ops.convert_to_numpy(optimizer.iterations)),
        "all_finite": all(
            np.all(np.isfinite(a))
            for a in arrays(model.weights).values()
            if a.dtype.kind == "f"
        ),
    }


def train(out, devices):
    distribute(devices)
    model = build()
    kdp.shard_optimizer_state(model.optimizer)
    before = arrays(model.weights)
    fit(model, X_OVERFLOW)
    fit(model, X)
    found = describe(model)
    found["weights_changed"] = any(
        not np.array_equal(before[k], a)
        for k, a in arrays(model.trainable_weights).items()
    )
    model.save(out / "everything.keras")
    np.savez(out / "saved_state.npz", **arrays(model.optimizer.variables))
    np.savez(out / "saved_weights.npz", **arrays(model.weights))
    fit(model, X)
    np.savez(out / "continued.npz", **arrays(model.weights))
    return found


def largest_difference(found, expected):
    return max(
        float(np.max(np.abs(found[k].astype("float64") - expected[k])))
        for k in expected
    )


def resume(out, devices):
    distribute(devices)
    model = keras.saving.load_model(out / "everything.keras")
    if devices > 1:
        kdp.shard_optimizer_state(model.optimizer)
    model.optimizer.build(model.trainable_variables)
    saved_state = dict(np.load(out / "saved_state.npz"))
    saved_weights = dict(np.load(out / "saved_weights.npz"))
    loaded_state = arrays(model.optimizer.variables)
    found = {
        "state_paths_equal": sorted(loaded_state) == sorted(saved_state),
        "state_equal": all(
            np.array_equal(loaded_state[k], saved_state[k]) for k in saved_state
        ),
        "weights_equal": all(
            np.array_equal(a, saved_weights[k])
            for k, a in arrays(model.weights).items()
        ),
    }
    fit(model, X)
    found.update(describe(model))
    continued = dict(np.load(out / "continued.npz"))
    trained = arrays(model.weights)
    # Keras overwrites the float8 scaling variables with their "gradient".
    trainable = {
        i for i, v in enumerate(model.weights) if not v.overwrite_with_gradient
    }
    found["difference_from_continued"] = largest_difference(
        trained, {k: a for k, a in continued.items() if int(k) in trainable}
    )
    # The float8 scales and amax histories: a scaled gradient's amax in
    # float16 may round the other way when summed in another order.
    found["scaling_difference_from_continued"] = max(
        float(np.max(np.abs(trained[k] - a) / np.maximum(np.abs(a), 1.0)))
        for k, a in continued.items()
        if int(k) not in trainable
    )
    return found


out, devices, phase = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
findings = train(out, devices) if phase == "train" else resume(out, devices)
findings["devices"] = len(keras.distribution.list_devices())
print(json.dumps(findings))
