"""Benchmark 10: memory of 8-bit and 4-bit optimizer state (issue #33).

A stack of Dense layers of over 50M parameters trains with Adam under
eight configurations: float32, mixed_bfloat16, kahan_bfloat16,
stochastic_bfloat16, and 8-bit state with stochastic_bfloat16,
kahan_bfloat16 and mixed_bfloat16 (float32 weights), and 4-bit state with
stochastic_bfloat16 (`quantized_state_probe.CONFIGURATIONS`). Each runs
`quantized_state_probe.py` in a process of its own, the configurations
taking turns. Reported: the bytes a parameter of weights and optimizer
state counted from the variables (dtype itemsize times size; a quantized
slot counts its codes and scales), and the process's resident memory:
after importing the backend, after building the model and its state, and
the high-water mark of training steps.

Run alone: `python tests/benchmarks/run.py --backend jax --threads 1
--only quantized_state_memory`. Importing this module imports no backend
and not Keras.
"""

import sys

from tests.benchmarks import memory
from tests.benchmarks.quantized_state_probe import CONFIGURATIONS
from tests.benchmarks.quantized_state_probe import MARKER

PROBE = "tests.benchmarks.quantized_state_probe"
# Target of issue #33: weights + Adam's state, bytes a parameter, at most.
TARGET = {"configuration": "stochastic_bfloat16_8bit", "bytes": 4.1}
REFERENCE = "mixed_bfloat16"


def probe_command(
    backend,
    configuration,
    sizes,
    threads=None,
    width=None,
    depth=None,
    batch=None,
):
    """Returns the command line of one probe process: the model of
    `sizes` (`state_memory_*`), or the `width`, `depth` and `batch`
    given."""
    limit = [] if threads is None else [f"--threads={threads}"]
    return [
        sys.executable,
        "-m",
        PROBE,
        f"--backend={backend}",
        f"--configuration={configuration}",
        f"--width={width or sizes.state_memory_width}",
        f"--depth={depth or sizes.state_memory_depth}",
        f"--batch={batch or sizes.state_memory_batch}",
        f"--steps={sizes.state_memory_steps}",
        *limit,
    ]


def run(backend, sizes, threads=None):
    """Runs the benchmark for `backend`; returns its results as a dict.

    Args:
        backend: A Keras backend name.
        sizes: A `sizes.Sizes`.
        threads: A limit on the backend's threads, or None.

    Returns:
        A dict with the `setup`, one row per configuration (each process's
        result, and the differences to mixed_bfloat16's), and the target.
    """
    names = list(CONFIGURATIONS)
    results = {name: [] for name in names}
    for repetition in range(sizes.state_memory_repeats):
        order = names if repetition % 2 == 0 else names[::-1]
        for name in order:
            command = probe_command(backend, name, sizes, threads)
            results[name].append(
                memory.run_probe(command, marker=MARKER, timeout=1800)
            )
    rows = {name: summarize(probes) for name, probes in results.items()}
    reference = rows.get(REFERENCE)
    for row in rows.values():
        if reference is not None:
            row["bytes_over_mixed"] = (
                row["bytes_per_parameter"] / reference["bytes_per_parameter"]
            )
            row["steady_peak_minus_mixed"] = _difference(
                row["steady_peak"], reference["steady_peak"]
            )
            row["built_minus_mixed"] = _difference(
                row["built"], reference["built"]
            )
    width, depth = sizes.state_memory_width, sizes.state_memory_depth
    target = rows.get(TARGET["configuration"])
    return {
        "setup": {
            "model": f"{depth} Dense layers {width}x{width} with biases "
            "(ReLU between), mean squared error on random targets, Adam",
            "parameters": next(iter(rows.values()))["parameters"],
            "batch_size": sizes.state_memory_batch,
            "steps": sizes.state_memory_steps,
            "processes_per_configuration": sizes.state_memory_repeats,
        },
        "rows": rows,
        "target": {
            **TARGET,
            "figure": None if target is None else target["bytes_per_parameter"],
            "within": target is not None
            and target["bytes_per_parameter"] <= TARGET["bytes"],
        },
    }


def summarize(probes):
    """One row from a configuration's probe results: the variables' bytes
    (the same in every process) and the median of each memory reading."""
    first = probes[0]
    row = {
        "policy": first["policy"],
        "optimizer": first["optimizer"],
        "update": first["update"],
        "state_dtype": first["state_dtype"],
        "device": first["device"],
        **first["variables"],
        "processes": len(probes),
    }
    for key in ("imported", "built", "first_peak", "steady_peak", "after"):
        values = sorted(p[key] for p in probes if p[key] is not None)
        row[key] = values[len(values) // 2] if values else None
    return row


def _difference(value, reference):
    if value is None or reference is None:
        return None
    return value - reference
