"""Benchmark 17: JAX's step on a CPU with and without glibc's huge pages.

    python -m tests.benchmarks.page_faults [--depth 12] [--rounds 2]

A stack of Dense 1024 layers (12 by default: 12.6M parameters), Adam,
trained by `fit` under `mixed_bfloat16`, `stochastic_bfloat16_8bit` and
`stochastic_bfloat16_4bit` (the configurations taking turns in one
process, 5 timed epochs of 20 steps, the order reversed every other) at
batch 8 and 64, on one thread pinned to one core. Each round runs one
process as the environment has it and one with
`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, which glibc reads only when a
process starts (see `keras_dtype_policy.tools.page_faults`). Reported:
the median milliseconds a step and minor page faults a step (from
`getrusage`), per process. Writes
`tests/benchmarks/results/page_faults/jax.json`. JAX only: the faults
come from its CPU runtime's per-step buffers.
"""

import argparse
import json
import os
import pathlib
import resource
import subprocess
import sys
import time

WIDTH = 1024
STEPS = 20
EPOCHS = 5
BATCHES = (8, 64)
CONFIGURATIONS = (
    "mixed_bfloat16",
    "stochastic_bfloat16_8bit",
    "stochastic_bfloat16_4bit",
)
TUNABLE = "glibc.malloc.hugetlb=1"
RESULTS = pathlib.Path(__file__).with_name("results") / "page_faults"


def _faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def probe(depth):
    """Times each configuration in this process; returns its rows."""
    import keras
    import numpy as np

    import keras_dtype_policy as kdp

    def build(policy):
        keras.utils.set_random_seed(0)
        with kdp.policy_scope(policy):
            model = keras.Sequential(
                [keras.Input((WIDTH,))]
                + [keras.layers.Dense(WIDTH) for _ in range(depth)]
            )
        model.compile(keras.optimizers.Adam(1e-3), "mse")
        return model

    rows = []
    for batch in BATCHES:
        x = np.random.RandomState(0).randn(batch * STEPS, WIDTH)
        x = x.astype("float32")
        models = {name: build(name) for name in CONFIGURATIONS}
        for model in models.values():
            model.fit(x[:batch], x[:batch], batch_size=batch, verbose=0)
        times = {name: [] for name in CONFIGURATIONS}
        faults = {name: [] for name in CONFIGURATIONS}
        for epoch in range(EPOCHS):
            order = CONFIGURATIONS[:: 1 if epoch % 2 else -1]
            for name in order:
                before, start = _faults(), time.perf_counter()
                models[name].fit(
                    x, x, batch_size=batch, verbose=0, shuffle=False
                )
                times[name].append((time.perf_counter() - start) / STEPS)
                faults[name].append((_faults() - before) / STEPS)
        for name in CONFIGURATIONS:
            rows.append(
                {
                    "batch": batch,
                    "configuration": name,
                    "parameters": models[name].count_params(),
                    "ms_a_step": round(1e3 * float(np.median(times[name])), 1),
                    "faults_a_step": round(float(np.median(faults[name]))),
                }
            )
    return rows


def _run_probe(depth, huge_pages):
    env = dict(os.environ, KERAS_BACKEND="jax", OMP_NUM_THREADS="1")
    env.pop("GLIBC_TUNABLES", None)
    if huge_pages:
        env["GLIBC_TUNABLES"] = TUNABLE
    command = [sys.executable, "-m", "tests.benchmarks.page_faults"]
    command += ["--probe", f"--depth={depth}"]
    if hasattr(os, "sched_setaffinity"):
        core = max(os.sched_getaffinity(0))
        command = ["taskset", "-c", str(core), *command]
    result = subprocess.run(
        command, env=env, capture_output=True, text=True, check=True
    )
    return json.loads(result.stdout.splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        print(json.dumps(probe(args.depth)))
        return
    runs = []
    for round_ in range(args.rounds):
        for huge_pages in (False, True):
            rows = _run_probe(args.depth, huge_pages)
            runs.append(
                {"round": round_, "huge_pages": huge_pages, "rows": rows}
            )
            print(json.dumps(runs[-1]), flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "jax.json").write_text(json.dumps(runs, indent=1) + "\n")


if __name__ == "__main__":
    main()
