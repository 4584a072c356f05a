"""`shard_optimizer_state(model, reduce_scatter=True)` on four forced host
devices, checked in one go.

    KERAS_BACKEND=jax python reduce_scatter_worker.py OUT_DIR CASE...

For each optimizer CASE it trains the same batches under `DataParallel`
with the state split, once with Keras' train step and once with the
reduce-scatter step, and reads the collectives of both compiled steps.
The CASEs `overflow`, `dropout`, `refusals`, `resume` and `uninstall`
check a float16 overflow, per-device random bits, what the step refuses,
a saved run reloaded on one device, and `uninstall()`. Prints one JSON
line of findings.
"""

import collections
import json
import os
import pathlib
import re
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dtype_policy as kdp  # noqa: E402

OPTIMIZERS = {
    "adam": (None, lambda: keras.optimizers.Adam(1e-2)),
    "lso_adam": (
        None,
        lambda: kdp.LossScaleOptimizer(keras.optimizers.Adam(1e-2)),
    ),
    "kahan_bfloat16_8bit": (
        "kahan_bfloat16_8bit",
        lambda: keras.optimizers.Adam(1e-2),
    ),
    "stochastic_bfloat16_4bit": (
        "stochastic_bfloat16_4bit",
        lambda: keras.optimizers.Adam(1e-2),
    ),
}
rng = np.random.RandomState(0)
X = rng.randn(64, 64).astype("float32")
Y = np.tanh(X @ rng.randn(64, 8)).astype("float32")
# `%name = SHAPE kind(` in HLO text, `kind-start(` for an async one.
_COLLECTIVE = re.compile(
    r"= (.+?) (all-reduce|reduce-scatter|all-gather|all-to-all)(?:-start)?\("
)


def build(policy, make_optimizer, layers=None):
    keras.utils.set_random_seed(0)
    with kdp.policy_scope(policy or "float32"):
        model = keras.Sequential(
            [keras.Input((64,))]
            + (
                layers
                or [
                    keras.layers.Dense(128, activation="tanh"),
                    keras.layers.Dense(8),
                ]
            )
        )
    model.compile(make_optimizer(), "mse")
    return model


def distribute(devices=None):
    keras.utils.clear_session()
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(
            devices=keras.distribution.list_devices()[:devices]
            if devices
            else None
        )
    )


def weights(model):
    return [
        keras.ops.convert_to_numpy(keras.ops.cast(w, "float32"))
        for w in model.weights
    ]


def largest_difference(a, b):
    return max(
        float(np.max(np.abs(x.astype("float64") - y)))
        for x, y in zip(a, b, strict=True)
    )


def collectives(model):
    """`{kind: [count, count of non-scalar ones]}` of the compiled step."""
    mesh = keras.distribution.distribution().device_mesh.backend_mesh
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("batch"))
    data = tuple(jax.device_put(a[:32], rows) for a in (X, Y))
    state = model._get_jax_state(
        trainable_variables=True,
        non_trainable_variables=True,
        optimizer_variables=True,
        metrics_variables=True,
    )
    step = jax.jit(
        model.train_step, out_shardings=(None, model._get_state_sharding_spec())
    )
    text = step.lower(tuple(state), data).compile().as_text()
    found = collections.defaultdict(lambda: [0, 0])
    for shape, kind in _COLLECTIVE.findall(text):
        found[kind][0] += 1
        found[kind][1] += bool(re.search(r"\[\d", shape))
    return dict(found)


def against_keras_step(name):
    policy, make_optimizer = OPTIMIZERS[name]
    runs = {}
    for scatter in (False, True):
        distribute()
        model = build(policy, make_optimizer)
        kdp.shard_optimizer_state(model, reduce_scatter=scatter)
        history = model.fit(X, Y, batch_size=32, epochs=2, verbose=0)
        runs[scatter] = (model, history.history["loss"])
    model, losses = runs[True]
    return {
        "weight_difference": largest_difference(
            weights(model), weights(runs[False][0])
        ),
        "losses": losses,
        "keras_losses": runs[False][1],
        "collectives": collectives(model),
        "keras_collectives": collectives(runs[False][0]),
        "state_dtypes": sorted(
            {str(v.dtype) for v in model.optimizer.variables}
        ),
    }


def overflow():
    """A float16 overflow under the compile hook's loss-scale optimizer."""
    distribute()
    model = build("mixed_float16", lambda: keras.optimizers.Adam(1e-2))
    kdp.shard_optimizer_state(model, reduce_scatter=True)
    model.fit(X, Y, batch_size=32, epochs=1, verbose=0)
    before = weights(model)
    scale = float(model.optimizer.loss_scale)
    bad = X[:32].copy()
    bad[5] = 1e30  # one device's part of the batch overflows
    model.fit(bad, Y[:32], batch_size=32, epochs=1, verbose=0)
    after = weights(model)
    return {
        "unchanged": all(
            np.array_equal(a, b) for a, b in zip(before, after, strict=True)
        ),
        "finite": all(np.isfinite(w).all() for w in after),
        "scale_ratio": float(model.optimizer.loss_scale) / scale,
    }


def dropout():
    """Each device draws its own dropout mask; the seed advances as
    Keras advances it."""
    # Four equal parts: rows 0-7 repeated, so the devices' outputs differ
    # only where their masks do.
    tiled = np.tile(X[:8], (4, 1))

    def shard_gap(y_true, y_pred):
        return keras.ops.mean(keras.ops.abs(y_pred[:8] - y_pred[8:16]))

    distribute()
    model = build(
        None,
        lambda: keras.optimizers.Adam(1e-2),
        [keras.layers.Dropout(0.5), keras.layers.Dense(8)],
    )
    model.compile(keras.optimizers.Adam(1e-2), "mse", metrics=[shard_gap])
    kdp.shard_optimizer_state(model, reduce_scatter=True)
    (seed,) = model.non_trainable_variables
    initial = keras.ops.convert_to_numpy(seed).tolist()
    history = model.fit(tiled, Y[:32], batch_size=32, epochs=3, verbose=0)
    return {
        "gap": history.history["shard_gap"],
        "seed": keras.ops.convert_to_numpy(seed).tolist(),
        "initial_seed": initial,
    }


def refusals():
    """What the reduce-scatter step refuses, each with its message."""
    messages = {}

    def attempt(key, function):
        try:
            function()
        except (ValueError, TypeError, NotImplementedError) as error:
            messages[key] = f"{type(error).__name__}: {error}"

    distribute()
    normalized = build(
        None,
        lambda: keras.optimizers.Adam(),
        [keras.layers.Dense(8), keras.layers.BatchNormalization()],
    )
    kdp.shard_optimizer_state(normalized, reduce_scatter=True)
    attempt(
        "batch_norm", lambda: normalized.fit(X, Y, batch_size=32, verbose=0)
    )
    plain = build(None, lambda: keras.optimizers.Adam())
    attempt(
        "optimizer",
        lambda: kdp.shard_optimizer_state(plain.optimizer, reduce_scatter=True),
    )

    class OwnStep(keras.Sequential):
        def train_step(self, state, data):
            return super().train_step(state, data)

    own = OwnStep([keras.Input((64,)), keras.layers.Dense(8)])
    own.compile(keras.optimizers.Adam(), "mse")
    attempt(
        "own_step",
        lambda: kdp.shard_optimizer_state(own, reduce_scatter=True),
    )
    messages["own_step_installed"] = "train_step" in vars(own)

    keras.utils.clear_session()
    mesh = keras.distribution.DeviceMesh(
        (2, 2), ("batch", "model"), keras.distribution.list_devices()
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*dense.*kernel"] = (None, "model")
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map)
    )
    split = build(None, lambda: keras.optimizers.Adam())
    kdp.shard_optimizer_state(split, reduce_scatter=True)
    attempt("model_parallel", lambda: split.fit(X, Y, batch_size=32, verbose=0))
    return messages


def resume(out):
    """A reduce-scatter run saved, reloaded on one device, trained on."""
    distribute()
    model = build(*OPTIMIZERS["kahan_bfloat16_8bit"])
    kdp.shard_optimizer_state(model, reduce_scatter=True)
    model.fit(X, Y, batch_size=32, epochs=2, verbose=0)
    saved = [keras.ops.convert_to_numpy(v) for v in model.optimizer.variables]
    model.save(out / "scattered.keras")
    model.fit(X, Y, batch_size=32, epochs=1, verbose=0, shuffle=False)
    continued = weights(model)
    keras.utils.clear_session()
    keras.distribution.set_distribution(None)
    loaded = keras.saving.load_model(out / "scattered.keras")
    state_equal = all(
        np.array_equal(keras.ops.convert_to_numpy(v), s)
        for v, s in zip(loaded.optimizer.variables, saved, strict=True)
    )
    loaded.fit(X, Y, batch_size=32, epochs=1, verbose=0, shuffle=False)
    return {
        "state_equal": state_equal,
        "weight_difference": largest_difference(weights(loaded), continued),
        "loaded_has_step": "train_step" in vars(loaded),
    }


def uninstalled():
    distribute()
    model = build(None, lambda: keras.optimizers.Adam())
    kdp.shard_optimizer_state(model, reduce_scatter=True)
    before = "train_step" in vars(model)
    kdp.uninstall()
    try:
        after = "train_step" in vars(model)
        model.fit(X, Y, batch_size=32, epochs=1, verbose=0)
        keras_step = "reduce-scatter" not in collectives(model)
    finally:
        kdp.install()
    return {"before": before, "after": after, "keras_step": keras_step}


out = pathlib.Path(sys.argv[1])
CASES = {
    "overflow": overflow,
    "dropout": dropout,
    "refusals": refusals,
    "resume": lambda: resume(out),
    "uninstall": uninstalled,
}
findings = {}
for case in sys.argv[2:]:
    if case in CASES:
        findings[case] = CASES[case]()
    else:
        findings[case] = against_keras_step(case)
findings["devices"] = len(keras.distribution.list_devices())
print(json.dumps(findings))
