"""Benchmark 4: peak memory of training steps, each in a fresh process.

Every (policy, arm) configuration runs `memory_probe.py` in a process of its
own, `memory_repeats` times, the configurations taking turns. Process memory
(peak resident set size) is measured on every machine; device memory only
where a GPU is present, through the backend's own counters.

Importing this module imports no backend and not Keras.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.benchmarks import stats
from tests.benchmarks.memory_probe import MARKER
from tests.benchmarks.sizes import ARMS
from tests.benchmarks.sizes import POLICIES

PROBE = "tests.benchmarks.memory_probe"
# The repository root, from which `tests.benchmarks` is importable.
ROOT = Path(__file__).resolve().parents[2]

# Figures summarized across a configuration's processes.
FIGURES = (
    "baseline_rss",
    "peak_rss",
    "peak_over_baseline",
    "steady_peak_over_baseline",
    "device_peak",
)


def probe_command(backend, arm, policy, sizes, threads=None):
    """Returns the command line of one probe process."""
    limit = [] if threads is None else [f"--threads={threads}"]
    return [
        sys.executable,
        "-m",
        PROBE,
        f"--backend={backend}",
        f"--arm={arm}",
        f"--policy={policy}",
        f"--batch={sizes.memory_batch}",
        f"--width={sizes.memory_width}",
        f"--depth={sizes.memory_depth}",
        f"--steps={sizes.memory_steps}",
        *limit,
    ]


def run_probe(command, timeout=600, marker=MARKER):
    """Runs one probe process; returns its result dict (the JSON after
    `marker` on its standard output).

    Raises:
        RuntimeError: if the process fails or prints no result.
    """
    environment = dict(os.environ)
    environment.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    completed = subprocess.run(
        command,
        capture_output=True,
        text=True,
        env=environment,
        cwd=ROOT,
        timeout=timeout,
        check=False,
    )
    for line in reversed(completed.stdout.splitlines()):
        if line.startswith(marker):
            return json.loads(line[len(marker) :])
    raise RuntimeError(
        f"The memory probe failed (exit status {completed.returncode}): "
        f"{' '.join(command)}\n{completed.stderr[-3000:]}"
    )


def run(backend, sizes, threads=None):
    """Runs the benchmark for `backend`; returns its results as a dict.

    Args:
        backend: A Keras backend name.
        sizes: A `sizes.Sizes`.
        threads: A limit on the backend's threads, or None.

    Returns:
        A dict with the `setup` and one row per (policy, arm).
    """
    configurations = [(p, a) for p in POLICIES for a in ARMS]
    probes = {configuration: [] for configuration in configurations}
    for repetition in range(sizes.memory_repeats):
        order = configurations
        if repetition % 2:
            order = configurations[::-1]
        for policy, arm in order:
            command = probe_command(backend, arm, policy, sizes, threads)
            probes[policy, arm].append(run_probe(command))
    rows = []
    for (policy, arm), results in probes.items():
        row = {
            "policy": policy,
            "arm": arm,
            "device": results[0]["device"],
            "model": results[0]["model"],
        }
        for figure in FIGURES:
            values = [r[figure] for r in results if r[figure] is not None]
            row[figure] = stats.summarize(values) if values else None
        rows.append(row)
    units = "-".join(
        [str(sizes.memory_width)] * (sizes.memory_depth + 1) + ["10"]
    )
    return {
        "setup": {
            "model": f"MLP {units} (hidden layers without bias)",
            "batch_size": sizes.memory_batch,
            "steps": sizes.memory_steps,
            "processes_per_configuration": sizes.memory_repeats,
        },
        "rows": rows,
    }
