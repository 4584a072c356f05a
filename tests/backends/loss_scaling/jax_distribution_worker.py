"""Loss scaling under `keras.distribution.DataParallel` on JAX, in a process.

    python jax_distribution_worker.py local OUT_DIR [CASES]
    python jax_distribution_worker.py multi OUT_DIR PORT PROCESS_ID [CASES]

(CASES: the `policy-mode` cases to run, comma-separated; all by default.)

`local` runs in one process with two forced host devices: for every policy
(mixed_float16, mixed_bfloat16) and scale mode (dynamic, fixed) it trains
the same model on a single device (the reference, engine `single`) and
under DataParallel over both devices (engine `local`). `multi` is one of two
processes joined over loopback by `jax.distributed.initialize`, each with
two host devices: DataParallel spans all four, and each process feeds its
half of every global batch.

Every DataParallel run then saves the model (every process, each to its
own file), loads process 0's file under the same distribution and trains
one more step on both the loaded model and the original. Results go to
OUT_DIR/ENGINE_POLICY_MODE_pID.npz (arrays) and .json (scalars and
per-step records), and OUT_DIR/ENGINE_pID.json (the setup) comes last.
Last, the `multi` engine trains `SHARDED_POLICY` (a `LossScaleOptimizer`
around 8-bit state and Kahan-compensated float16 weights) with that state
split across the devices by `shard_optimizer_state`, saves a `.keras` and
a `.weights.h5` file from every process, and writes the whole state,
gathered, to OUT_DIR/multi_sharded_pID.npz and .json.

Nothing is asserted here: the tests read the files.
"""

import faulthandler
import json
import os
import sys
import warnings

DEVICES_PER_PROCESS = 2
NUM_PROCESSES = 2
# Each process stops by itself: joining gives up after this many seconds,
# and a process still running after TIME_LIMIT seconds (a peer gone, a
# collective stuck) prints its stack and exits.
INIT_TIMEOUT = 60
TIME_LIMIT = 280
faulthandler.dump_traceback_later(TIME_LIMIT, exit=True)

os.environ["KERAS_BACKEND"] = "jax"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + f" --xla_force_host_platform_device_count={DEVICES_PER_PROCESS}"
)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import keras_dtype_policy as kdp  # noqa: E402

POLICIES = ("mixed_float16", "mixed_bfloat16")
MODES = ("dynamic", "fixed")
GLOBAL_BATCH, STEPS, FEATURES = 8, 8, 5
# The NaN sample: step 3, row 5 of the global batch. With two replicas of
# four rows it is in replica 1's shard; with four replicas of two rows, in
# replica 2's (process 1's first device). No other replica sees it.
NAN_STEP, NAN_ROW = 3, 5
INITIAL_SCALE, GROWTH_STEPS = 2.0**10, 3
# ZeRO-1 with the low-precision wing and loss scaling together: float16
# weights, 8-bit moments (the 64 x 128 and 128 x 64 kernels are above the
# 4096-element threshold) and a LossScaleOptimizer, all from the policy.
SHARDED_POLICY = "kahan_float16_8bit"
SHARDED_FEATURES = 64

warnings.filterwarnings("ignore", category=kdp.SlowFloat16Warning)


def data(features=FEATURES):
    """Returns fixed inputs and targets, one NaN input at a known place."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * GLOBAL_BATCH, features)).astype("float32")
    y = (x[:, :1] * 2 - x[:, 2:3] + 0.5).astype("float32")
    x[NAN_STEP * GLOBAL_BATCH + NAN_ROW, 1] = np.nan
    return x, y


def process_rows(array, process_id, num_processes):
    """Returns this process's part of every global batch, in order."""
    per_process = GLOBAL_BATCH // num_processes
    batches = array.reshape((STEPS, GLOBAL_BATCH) + array.shape[1:])
    start = process_id * per_process
    part = batches[:, start : start + per_process]
    return part.reshape((-1,) + array.shape[1:])


def new_model(policy, mode):
    """Builds and compiles the model, same initial weights every time."""
    keras.utils.set_random_seed(0)
    kdp.set_dtype_policy(policy)
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(1, dtype="float32"),
        ]
    )
    model.compile(
        kdp.LossScaleOptimizer(
            keras.optimizers.Adam(1e-2),
            dynamic=mode == "dynamic",
            initial_scale=INITIAL_SCALE,
            # tf.keras' rule: a fixed scale takes no growth steps.
            dynamic_growth_steps=GROWTH_STEPS if mode == "dynamic" else None,
        ),
        "mse",
    )
    return model


def copies(value):
    """Returns the copies of an array (or variable) on this process."""
    value = getattr(value, "value", value)
    return [np.asarray(shard.data) for shard in value.addressable_shards]


def devices(value):
    """Returns the names of the devices holding this process's copies."""
    value = getattr(value, "value", value)
    return [str(shard.device) for shard in value.addressable_shards]


class StateRecorder(keras.callbacks.Callback):
    """Records the optimizer's scale, counter and skips, per step and copy."""

    def __init__(self):
        super().__init__()
        self.steps = []

    def on_train_batch_end(self, batch, logs=None):
        # Reading `self.model` makes Keras copy the JAX state back.
        optimizer = self.model.optimizer
        self.steps.append(
            {
                "loss_scale": [
                    float(c) for c in copies(optimizer.dynamic_scale)
                ],
                "dynamic_counter": [
                    int(c) for c in copies(optimizer.step_counter)
                ],
                "skipped_steps": [
                    int(c) for c in copies(optimizer._skipped_step_counter)
                ],
                "iterations": [int(c) for c in copies(optimizer.iterations)],
            }
        )


def state(model):
    """Returns a model's weights and optimizer variables, with copies."""
    arrays = {}
    variables = [("weight", model.weights)]
    variables.append(("optimizer", model.optimizer.variables))
    for kind, values in variables:
        for i, variable in enumerate(values):
            stacked = np.stack(copies(variable))
            arrays[f"{kind}_{i}"] = stacked[0]
            arrays[f"{kind}_{i}_copies"] = stacked
    return arrays


def scalars(model):
    """Returns the loss-scale state and the policies, JSON-ready."""
    optimizer = model.optimizer
    return {
        "optimizer_type": f"{type(optimizer).__module__}."
        f"{type(optimizer).__qualname__}",
        "loss_scale": optimizer.loss_scale,
        # The variable: a fixed scale's dynamic_counter is None.
        "dynamic_counter": int(
            keras.ops.convert_to_numpy(optimizer.step_counter)
        ),
        "skipped_steps": optimizer.skipped_steps,
        "dynamic": optimizer.dynamic,
        "iterations": int(np.asarray(optimizer.iterations.value)),
        "policies": [layer.dtype_policy.name for layer in model.layers],
        "devices": devices(model.weights[0]),
    }


def nan_in_shards(dist, x, per_process):
    """Says, per local device, whether its shard of the NaN batch has NaN.

    The batch is placed as Keras' JAX trainer places it.
    """
    batch = x[NAN_STEP * per_process : (NAN_STEP + 1) * per_process]
    layout = dist.get_data_layout(batch.shape).backend_layout
    global_batch = jax.make_array_from_process_local_data(layout, batch)
    return {
        str(shard.device): bool(np.isnan(np.asarray(shard.data)).any())
        for shard in global_batch.addressable_shards
    }


def run(engine, policy, mode, out_dir, process_id, num_processes, dist):
    """Trains one model (under `dist` if given) and writes its results."""
    x, y = data()
    result = {}
    per_process = GLOBAL_BATCH
    if dist is not None:
        x = process_rows(x, process_id, num_processes)
        y = process_rows(y, process_id, num_processes)
        per_process = GLOBAL_BATCH // num_processes
        result["nan_in_shards"] = nan_in_shards(dist, x, per_process)
    model = new_model(policy, mode)
    arrays = {
        f"initial_weight_{i}": copies(weight)[0]
        for i, weight in enumerate(model.weights)
    }
    recorder = StateRecorder()
    model.fit(
        x,
        y,
        batch_size=per_process,
        shuffle=False,
        verbose=0,
        callbacks=[recorder],
    )
    result["steps"] = recorder.steps
    result["final"] = scalars(model)
    arrays.update(state(model))

    if dist is not None:
        # Every process saves, each to its own file: `model.save` makes a
        # throwaway optimizer, whose variable is placed on every device, a
        # step all processes must take together. Every process then loads
        # process 0's file (all arrays are replicated: each file holds the
        # whole model) under the same distribution.
        stem = os.path.join(out_dir, f"{engine}_{policy}_{mode}")
        model.save(f"{stem}_p{process_id}.keras")
        if num_processes > 1:
            multihost_utils.sync_global_devices(f"saved {policy} {mode}")
        loaded = keras.saving.load_model(f"{stem}_p0.keras")
        result["loaded"] = scalars(loaded)
        arrays.update({f"loaded_{k}": v for k, v in state(loaded).items()})
        # One more (finite) step on both: the first global batch.
        for name, which in (("original", model), ("loaded", loaded)):
            which.fit(
                x[:per_process],
                y[:per_process],
                batch_size=per_process,
                shuffle=False,
                verbose=0,
            )
            result[f"more_{name}"] = scalars(which)
            arrays.update(
                {f"more_{name}_{k}": v for k, v in state(which).items()}
            )

    stem = os.path.join(out_dir, f"{engine}_{policy}_{mode}_p{process_id}")
    np.savez(stem + ".npz", **arrays)
    with open(stem + ".json", "w") as f:
        json.dump(result, f)


def gathered(variable):
    """Returns a variable's whole value, gathered from every process."""
    value = getattr(variable, "value", variable)
    if jax.process_count() == 1:
        return np.asarray(value)
    return np.asarray(multihost_utils.process_allgather(value, tiled=True))


def run_sharded_state(
    engine, out_dir, process_id, num_processes, reduce_scatter=False
):
    """Trains `SHARDED_POLICY` with its state split across the devices.

    The compile hook wraps Adam in a `LossScaleOptimizer` around a
    `LowPrecisionOptimizer` (Kahan-compensated float16 weights, 8-bit
    moments); `shard_optimizer_state` splits the compensation buffers,
    codes and scales along the data axis; the NaN batch skips one step.
    Every process saves a `.keras` and a `.weights.h5` file; the whole
    (gathered) state, each variable's path and the shapes of this
    process's shards go to OUT_DIR/ENGINE_sharded_pID.npz and .json
    (ENGINE_scattered_pID with `reduce_scatter`, the package's step).
    """
    keras.utils.clear_session()
    dist = keras.distribution.DataParallel(auto_shard_dataset=False)
    keras.distribution.set_distribution(dist)
    x, y = data(SHARDED_FEATURES)
    x = process_rows(x, process_id, num_processes)
    y = process_rows(y, process_id, num_processes)
    per_process = GLOBAL_BATCH // num_processes
    keras.utils.set_random_seed(0)
    kdp.set_dtype_policy(SHARDED_POLICY)
    model = keras.Sequential(
        [
            keras.Input((SHARDED_FEATURES,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(1, dtype="float32"),
        ]
    )
    model.compile(
        keras.optimizers.Adam(1e-3, epsilon=1e-4),
        "mse",
    )
    kdp.shard_optimizer_state(model, reduce_scatter=reduce_scatter)
    recorder = StateRecorder()
    model.fit(
        x,
        y,
        batch_size=per_process,
        shuffle=False,
        verbose=0,
        callbacks=[recorder],
    )
    run_name = "scattered" if reduce_scatter else "sharded"
    stem = os.path.join(out_dir, f"{engine}_{run_name}_p{process_id}")
    model.save(f"{stem}.keras")
    model.save_weights(f"{stem}.weights.h5")
    if num_processes > 1:
        multihost_utils.sync_global_devices("saved sharded state")
    optimizer = model.optimizer
    arrays, paths, shard_shapes = {}, {}, {}
    for kind, values in (
        ("weight", model.weights),
        ("optimizer", optimizer.variables),
    ):
        for i, variable in enumerate(values):
            arrays[f"{kind}_{i}"] = gathered(variable)
            paths[f"{kind}_{i}"] = variable.path
            value = getattr(variable, "value", variable)
            shard_shapes[f"{kind}_{i}"] = [
                list(shard.data.shape) for shard in value.addressable_shards
            ]
    result = {
        "optimizer_type": type(optimizer).__name__,
        "inner_type": type(optimizer.inner_optimizer).__name__,
        "loss_scale": optimizer.loss_scale,
        "skipped_steps": optimizer.skipped_steps,
        "iterations": int(np.asarray(optimizer.iterations.value)),
        "steps": recorder.steps,
        "paths": paths,
        "shard_shapes": shard_shapes,
    }
    np.savez(f"{stem}.npz", **arrays)
    with open(f"{stem}.json", "w") as f:
        json.dump(result, f)
    keras.distribution.set_distribution(None)
    kdp.set_dtype_policy("float32")


def main(argv):
    engine, out_dir = argv[1], argv[2]
    # The `policy-mode` cases to run, comma-separated, after the engine's
    # own arguments (all where none are named).
    cases = None
    if engine == "local":
        process_id, num_processes = 0, 1
        if len(argv) > 3:
            cases = argv[3].split(",")
    elif engine == "multi":
        port, process_id = argv[3], int(argv[4])
        if len(argv) > 5:
            cases = argv[5].split(",")
        num_processes = NUM_PROCESSES
        jax.distributed.initialize(
            coordinator_address=f"localhost:{port}",
            num_processes=num_processes,
            process_id=process_id,
            initialization_timeout=INIT_TIMEOUT,
        )
    else:
        raise SystemExit(f"unknown engine {engine!r}")

    for policy in POLICIES:
        for mode in MODES:
            if cases is not None and f"{policy}-{mode}" not in cases:
                continue
            if engine == "local":
                keras.utils.clear_session()
                run("single", policy, mode, out_dir, 0, 1, None)
            # `clear_session` also forgets the distribution: clear first.
            keras.utils.clear_session()
            # Data already split per process: no tf.data auto-sharding.
            dist = keras.distribution.DataParallel(auto_shard_dataset=False)
            keras.distribution.set_distribution(dist)
            run(engine, policy, mode, out_dir, process_id, num_processes, dist)
            keras.distribution.set_distribution(None)
    if engine == "multi":
        for reduce_scatter in (False, True):
            run_sharded_state(
                engine, out_dir, process_id, num_processes, reduce_scatter
            )

    setup = {
        "devices": [str(d) for d in jax.devices()],
        "local_devices": [str(d) for d in jax.local_devices()],
        "process_count": jax.process_count(),
        "steps": STEPS,
        "nan_step": NAN_STEP,
        "initial_scale": INITIAL_SCALE,
        "growth_steps": GROWTH_STEPS,
    }
    if engine == "multi":
        multihost_utils.sync_global_devices("finished")
        jax.distributed.shutdown()
    with open(os.path.join(out_dir, f"{engine}_p{process_id}.json"), "w") as f:
        json.dump(setup, f)


if __name__ == "__main__":
    main(sys.argv)
    faulthandler.cancel_dump_traceback_later()
