"""One process of benchmark 11: N simulated devices, every configuration.

    python -m tests.benchmarks.state_sharding_probe --devices=N \
        [--width=1024] [--depth=10] [--batch=16] [--steps=100] [--threads=1]

Sets `XLA_FLAGS=--xla_force_host_platform_device_count=N` before JAX
starts. For each configuration (`CONFIGURATIONS`) it trains the same
stack of Dense layers under `keras.distribution.DataParallel` three times:
without `keras_dtype_policy.shard_optimizer_state`, with it (Keras' train
step), and with it and `reduce_scatter=True` (the package's step). It
prints one line: `MARKER` and a JSON dict of the per-device state bytes,
the largest weight difference after `--steps` steps, the step times, and
the collectives of each compiled train step (read from its HLO text) with
the bytes each device sends for them (`wire_bytes`).
"""

import argparse
import collections
import json
import os
import re
import sys
import time

MARKER = "STATE_SHARDING_PROBE "
CONFIGURATIONS = (
    "adam",
    "lso_adam",
    "kahan_bfloat16",
    "stochastic_bfloat16_8bit",
)
RUNS = ("unsharded", "sharded", "reduce_scatter")
COLLECTIVES = (
    "all-reduce",
    "reduce-scatter",
    "all-gather",
    "all-to-all",
    "collective-permute",
)
_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "pred": 1}
# One instruction: `%name = SHAPE kind(` (or `kind-start(`); a tuple's
# SHAPE may hold `/*index=5*/` comments.
_OPERATION = re.compile(
    r"^\s*(?:ROOT )?%\S+ = (.+?) (" + "|".join(COLLECTIVES) + r")(?:-start)?\(",
    re.MULTILINE,
)
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")


def arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--threads", type=int, default=None)
    return parser.parse_args(argv)


def collectives(hlo_text):
    """Returns `{kind: {"count": n, "bytes": b}}` of an HLO module's text."""
    found = collections.defaultdict(lambda: {"count": 0, "bytes": 0})
    for shape, kind in _OPERATION.findall(hlo_text):
        found[kind]["count"] += 1
        for dtype, dims in _ARRAY.findall(shape):
            size = 1
            for d in filter(None, dims.split(",")):
                size *= int(d)
            found[kind]["bytes"] += size * _BYTES.get(dtype, 4)
    return dict(found)


def wire_bytes(found, devices):
    """Bytes one device sends a step for the collectives `found`, as a
    ring (or any bandwidth-optimal algorithm) moves them: an all-reduce of
    S bytes sends 2(N-1)/N S, a reduce-scatter (N-1)/N of its operand
    (N times its result, which the HLO shape gives), an all-gather
    (N-1)/N of its result."""
    share = (devices - 1) / devices
    factor = {
        "all-reduce": 2 * share,
        "reduce-scatter": share * devices,
        "all-gather": share,
    }
    return sum(
        found.get(kind, {"bytes": 0})["bytes"] * f for kind, f in factor.items()
    )


def main(argv=None):
    args = arguments(argv)
    flags = [f"--xla_force_host_platform_device_count={args.devices}"]
    if args.threads:
        flags.append("--xla_cpu_multi_thread_eigen=false")
        flags.append(f"intra_op_parallelism_threads={args.threads}")
    os.environ["XLA_FLAGS"] = " ".join(flags)
    os.environ["KERAS_BACKEND"] = "jax"
    import jax
    import keras
    import numpy as np

    import keras_dtype_policy as kdp

    rng = np.random.RandomState(0)
    x = rng.randn(args.batch * args.steps, args.width).astype("float32")
    y = np.tanh(x[:, : args.width] * 0.5).astype("float32")

    def build(configuration):
        keras.utils.set_random_seed(0)
        policy = None if "adam" in configuration else configuration
        with kdp.policy_scope(policy or "float32"):
            model = keras.Sequential(
                [keras.Input((args.width,))]
                + [
                    keras.layers.Dense(args.width, activation="tanh")
                    for _ in range(args.depth)
                ]
            )
        optimizer = keras.optimizers.Adam(1e-4)
        if configuration == "lso_adam":
            optimizer = kdp.LossScaleOptimizer(optimizer)
        model.compile(optimizer, "mse")
        return model

    def hlo_text(model, distribution):
        mesh = distribution.device_mesh.backend_mesh
        rows = jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec(distribution.batch_dim_name)
        )
        data = tuple(jax.device_put(a[: args.batch], rows) for a in (x, y))
        state = model._get_jax_state(
            trainable_variables=True,
            non_trainable_variables=True,
            optimizer_variables=True,
            metrics_variables=True,
        )
        step = jax.jit(
            model.train_step,
            out_shardings=(None, model._get_state_sharding_spec()),
        )
        return step.lower(tuple(state), data).compile().as_text()

    class StepTimes(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.ends = []

        def on_train_batch_end(self, batch, logs=None):
            self.ends.append(time.perf_counter())

    def train(configuration, run):
        keras.utils.clear_session()
        distribution = keras.distribution.DataParallel()
        keras.distribution.set_distribution(distribution)
        model = build(configuration)
        if run != "unsharded":
            kdp.shard_optimizer_state(
                model, reduce_scatter=run == "reduce_scatter"
            )
        model.optimizer.build(model.trainable_variables)
        local = whole = 0
        for variable in model.optimizer.variables:
            whole += variable.value.nbytes
            local += variable.value.addressable_shards[0].data.nbytes
        times = StepTimes()
        model.fit(
            x,
            y,
            batch_size=args.batch,
            epochs=1,
            verbose=0,
            shuffle=False,
            callbacks=[times],
        )
        steps = np.diff(times.ends)  # the first step compiles
        weights = [
            keras.ops.convert_to_numpy(keras.ops.cast(w, "float32"))
            for w in model.weights
        ]
        found = {
            "state_bytes_per_device": local,
            "state_bytes": whole,
            "step_seconds": float(np.median(steps)),
            "collectives": collectives(hlo_text(model, distribution)),
        }
        found["wire_bytes"] = wire_bytes(found["collectives"], args.devices)
        return found, weights, model.count_params()

    rows = {}
    for configuration in CONFIGURATIONS:
        found, trained, parameters = {}, {}, None
        for run in RUNS:
            found[run], trained[run], parameters = train(configuration, run)
        row = {"parameters": parameters, **found}
        for run in RUNS[1:]:
            row[f"{run}_state_ratio"] = (
                found[run]["state_bytes_per_device"]
                / found["unsharded"]["state_bytes_per_device"]
            )
            row[f"{run}_step_time_ratio"] = (
                found[run]["step_seconds"] / found["unsharded"]["step_seconds"]
            )
            row[f"{run}_weight_difference"] = max(
                float(np.max(np.abs(a - b)))
                for a, b in zip(trained[run], trained["unsharded"], strict=True)
            )
        rows[configuration] = row
    result = {
        "devices": args.devices,
        "device_kind": jax.devices()[0].platform,
        "width": args.width,
        "depth": args.depth,
        "batch": args.batch,
        "steps": args.steps,
        "threads": args.threads,
        "rows": rows,
    }
    print(MARKER + json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
