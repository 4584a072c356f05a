"""Optimizer-state sharding on eight forced host devices, checked in one go.

    KERAS_BACKEND=jax python state_sharding_worker.py OUT_DIR CASE...

The device count must be set before JAX starts, hence a process of its
own. For each CASE of Adam, `LossScaleOptimizer(Adam)`, `"kahan_bfloat16"`,
`"kahan_bfloat16_8bit"` and a `MultiOptimizer` it trains the same batches
under `DataParallel` with and without `shard_optimizer_state`; for three
it saves the sharded run, loads it on one device and on two (sharded
again) and continues. The CASEs `model_parallel`, `uninstall` and
`wrapped_by_compile` check a `ModelParallel` layout, `uninstall()` and a
wrapper that `compile` puts around a sharded optimizer. Prints one JSON
line of findings.
"""

import json
import os
import pathlib
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dtype_policy as kdp  # noqa: E402
from keras_dtype_policy.low_precision.state_sharding import SHARDING_METHODS  # noqa: E402

OPTIMIZERS = {
    "adam": (None, lambda: keras.optimizers.Adam(1e-2)),
    "lso_adam": (
        None,
        lambda: kdp.LossScaleOptimizer(keras.optimizers.Adam(1e-2)),
    ),
    "kahan_bfloat16": ("kahan_bfloat16", lambda: keras.optimizers.Adam(1e-2)),
    "kahan_bfloat16_8bit": (
        "kahan_bfloat16_8bit",
        lambda: keras.optimizers.Adam(1e-2),
    ),
    # Keras 3.15's MultiOptimizer: the compile hook wraps its plain Adam
    # (the second layer's); the first layer's 8-bit one is the user's.
    "multi_optimizer": (
        "kahan_bfloat16",
        lambda: keras.optimizers.MultiOptimizer(
            keras.optimizers.OptimizerMap(
                keras.optimizers.Adam(1e-2),
                {
                    ".*dense/.*": kdp.LowPrecisionOptimizer(
                        keras.optimizers.Adam(1e-2), "kahan", "8bit", seed=1
                    )
                },
            )
        ),
    ),
}
# Saved, then loaded on one device and on two.
RESUMED = ("adam", "kahan_bfloat16_8bit", "multi_optimizer")
rng = np.random.RandomState(0)
X = rng.randn(64, 64).astype("float32")
Y = np.tanh(X @ rng.randn(64, 8)).astype("float32")


def build(policy, make_optimizer):
    keras.utils.set_random_seed(0)
    with kdp.policy_scope(policy or "float32"):
        model = keras.Sequential(
            [
                keras.Input((64,)),
                keras.layers.Dense(128, activation="tanh"),
                keras.layers.Dense(8),
            ]
        )
    model.compile(make_optimizer(), "mse")
    return model


def fit(model, epochs=2):
    model.fit(X, Y, batch_size=32, epochs=epochs, verbose=0, shuffle=False)


def weights(model):
    return [
        keras.ops.convert_to_numpy(keras.ops.cast(w, "float32"))
        for w in model.weights
    ]


def state(model):
    return [keras.ops.convert_to_numpy(v) for v in model.optimizer.variables]


def largest_difference(a, b):
    return max(
        float(np.max(np.abs(x.astype("float64") - y)))
        for x, y in zip(a, b, strict=True)
    )


def device_share(optimizer):
    """Bytes of optimizer state on the first device over its whole bytes."""
    local = whole = 0
    for variable in optimizer.variables:
        value = variable.value
        whole += value.nbytes
        local += value.addressable_shards[0].data.nbytes
    return local / whole


def specs(optimizer):
    return {
        v.path: [str(a) for a in v.value.sharding.spec]
        for v in optimizer.variables
    }


def sharded_against_unsharded(name, out):
    policy, make_optimizer = OPTIMIZERS[name]
    runs = {}
    for shard in (False, True):
        keras.utils.clear_session()
        keras.distribution.set_distribution(keras.distribution.DataParallel())
        model = build(policy, make_optimizer)
        if shard:
            kdp.shard_optimizer_state(model.optimizer)
        fit(model)
        runs[shard] = model, weights(model), device_share(model.optimizer)
    sharded, trained, share = runs[True]
    found = {
        "optimizer": type(sharded.optimizer).__name__,
        "share_unsharded": runs[False][2],
        "share_sharded": share,
        "weight_difference": largest_difference(trained, runs[False][1]),
        "specs": specs(sharded.optimizer),
        "weight_specs": [
            [str(a) for a in w.value.sharding.spec] for w in sharded.weights
        ],
    }
    if name in RESUMED:
        saved_state = state(sharded)
        sharded.save(out / f"{name}.keras")
        fit(sharded, epochs=1)
        found["resumed"] = resumed(name, out, saved_state, weights(sharded))
    return found


def resumed(name, out, saved_state, continued):
    """Loads the saved run on 1 and on 2 devices; continues one epoch."""
    found = {}
    for devices in (1, 2):
        keras.utils.clear_session()
        if devices > 1:
            keras.distribution.set_distribution(
                keras.distribution.DataParallel(
                    devices=keras.distribution.list_devices()[:devices]
                )
            )
        model = keras.saving.load_model(out / f"{name}.keras")
        if devices > 1:
            kdp.shard_optimizer_state(model.optimizer)
        loaded_state = state(model)
        share = device_share(model.optimizer)
        fit(model, epochs=1)
        found[devices] = {
            "state_equal": all(
                np.array_equal(a, b)
                for a, b in zip(loaded_state, saved_state, strict=True)
            ),
            "share": share,
            "weight_difference": largest_difference(weights(model), continued),
        }
    keras.distribution.set_distribution(None)
    return found


def model_parallel():
    """Slots split along the data axis on top of the weights' model axis."""
    runs = {}
    for shard in (False, True):
        keras.utils.clear_session()
        mesh = keras.distribution.DeviceMesh(
            (4, 2), ("batch", "model"), keras.distribution.list_devices()
        )
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map[".*dense.*kernel"] = (None, "model")
        keras.distribution.set_distribution(
            keras.distribution.ModelParallel(
                layout_map=layout_map, batch_dim_name="batch"
            )
        )
        model = build(None, OPTIMIZERS["adam"][1])
        if shard:
            kdp.shard_optimizer_state(model.optimizer)
        fit(model)
        runs[shard] = model
    keras.distribution.set_distribution(None)
    return {
        "specs": specs(runs[True].optimizer),
        "kernel_spec": [
            str(a) for a in runs[True].layers[0].kernel.value.sharding.spec
        ],
        "share_unsharded": device_share(runs[False].optimizer),
        "share_sharded": device_share(runs[True].optimizer),
        "weight_difference": largest_difference(
            weights(runs[True]), weights(runs[False])
        ),
    }


def uninstalled():
    """`uninstall()` takes the instance method off; install() keeps it off."""
    keras.utils.clear_session()
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    optimizer = kdp.shard_optimizer_state(keras.optimizers.Adam())

    def holds():
        return {name: name in vars(optimizer) for name in SHARDING_METHODS}

    before = holds()
    kdp.uninstall()
    try:
        after = holds()
        slot = optimizer.add_variable((16, 4))
    finally:
        kdp.install()
    keras.distribution.set_distribution(None)
    return {
        "before": before,
        "after": after,
        "after_install": holds(),
        "slot_spec": [str(a) for a in slot.value.sharding.spec],
    }


def wrapped_by_compile():
    """A sharded Adam that `compile` wraps: the wrapper's state splits too."""
    keras.utils.clear_session()
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    model = build(
        "kahan_bfloat16_8bit",
        lambda: kdp.shard_optimizer_state(keras.optimizers.Adam()),
    )
    model.optimizer.build(model.trainable_variables)
    keras.distribution.set_distribution(None)
    return {"specs": specs(model.optimizer)}


out = pathlib.Path(sys.argv[1])
findings = {}
for case in sys.argv[2:]:
    if case == "model_parallel":
        findings[case] = model_parallel()
    elif case == "uninstall":
        findings[case] = uninstalled()
    elif case == "wrapped_by_compile":
        findings[case] = wrapped_by_compile()
    else:
        findings[case] = sharded_against_unsharded(case, out)
findings["devices"] = len(keras.distribution.list_devices())
print(json.dumps(findings))
