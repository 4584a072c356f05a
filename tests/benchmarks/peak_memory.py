"""Benchmark 12: the process's peak memory a parameter (issue #43).

What a user meets is the training step's peak, not the variables' bytes.
For each configuration of benchmark 10 (`quantized_state_probe
.CONFIGURATIONS`), a stack of Dense layers `width` wide is trained at
several depths, one fresh process a size, and the process's peak
resident memory (the high-water mark through the first step and the
later ones) is fitted against the parameter count by least squares: the
slope, in bytes a parameter, cancels what does not grow with the model
(the interpreter, the backend, compiled code of a fixed size). Each row
sets the slope beside the ideal (weights + optimizer state + one gradient
a weight, from the variables' bytes) and says how many times more
parameters than under `mixed_bfloat16` fit in the same memory. On a GPU
the device's peak (`backend_support.peak_device_memory`) gets a slope
of its own.

The sizes vary the depth (the slope), and the batch (a second slope at a
larger batch, where activations grow but must not change the slope by
more than their own bytes); `KDP_BENCHMARK12_ONLY` keeps a
comma-separated subset of the configurations (mixed_bfloat16 always),
`KDP_BENCHMARK12_BATCHES` other batch sizes (comma-separated),
`KDP_BENCHMARK12_WIDTH` and `KDP_BENCHMARK12_DEPTHS` another stack (the
memory plan's calibration adds width 512, depths 8 and 32).

Run alone: `python tests/benchmarks/run.py --backend jax --threads 1
--only peak_memory`. Importing this module imports no backend and not
Keras.
"""

import dataclasses
import os

from tests.benchmarks import memory
from tests.benchmarks import subsets
from tests.benchmarks.quantized_state_memory import probe_command
from tests.benchmarks.quantized_state_probe import CONFIGURATIONS
from tests.benchmarks.quantized_state_probe import MARKER

REFERENCE = "mixed_bfloat16"
# Issue #43: every configuration's slope at most 1.25x its ideal.
TARGET_OVER_IDEAL = 1.25


def run(backend, sizes, threads=None):
    """Runs the benchmark for `backend`; returns its results as a dict.

    Args:
        backend: A Keras backend name.
        sizes: A `sizes.Sizes` (`peak_width`, `peak_depths`,
            `peak_batches`, `state_memory_steps`).
        threads: A limit on the backend's threads, or None.

    Returns:
        A dict with the `setup` and one row per configuration: the probes
        (parameters and peak bytes a size and batch), the slope a batch,
        the ideal, and the ratios.
    """
    names = subsets.chosen("KDP_BENCHMARK12_ONLY", CONFIGURATIONS, (REFERENCE,))
    sizes = _shape(sizes)
    batches = _batches(sizes)
    rows = {}
    for name in names:
        points = {}
        for batch in batches:
            points[batch] = [
                _probe(backend, name, sizes, depth, batch, threads)
                for depth in sizes.peak_depths
            ]
        rows[name] = _row(points)
    reference = rows.get(REFERENCE)
    for row in rows.values():
        if reference is not None:
            row["times_mixed"] = reference["slope"] / row["slope"]
    return {
        "setup": {
            "model": f"Dense layers {sizes.peak_width} wide with biases "
            "(ReLU between), mean squared error on random targets, Adam",
            "depths": list(sizes.peak_depths),
            "batches": list(batches),
            "steps": sizes.state_memory_steps,
        },
        "rows": rows,
        "target_over_ideal": TARGET_OVER_IDEAL,
    }


def slope(points):
    """The least-squares slope of `(parameters, bytes)` points."""
    count = len(points)
    mean_x = sum(x for x, _ in points) / count
    mean_y = sum(y for _, y in points) / count
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / spread


def _shape(sizes):
    """The sizes with `KDP_BENCHMARK12_WIDTH` and `KDP_BENCHMARK12_DEPTHS`
    (comma-separated) in place of the stack's width and depths."""
    width = os.environ.get("KDP_BENCHMARK12_WIDTH")
    depths = os.environ.get("KDP_BENCHMARK12_DEPTHS")
    return dataclasses.replace(
        sizes,
        peak_width=int(width) if width else sizes.peak_width,
        peak_depths=tuple(int(d) for d in depths.split(","))
        if depths
        else sizes.peak_depths,
    )


def _batches(sizes):
    """The batch sizes: `KDP_BENCHMARK12_BATCHES`, or the sizes'."""
    given = os.environ.get("KDP_BENCHMARK12_BATCHES")
    if not given:
        return tuple(sizes.peak_batches)
    return tuple(int(batch) for batch in given.split(","))


def _probe(backend, name, sizes, depth, batch, threads):
    command = probe_command(
        backend,
        name,
        sizes,
        threads,
        width=sizes.peak_width,
        depth=depth,
        batch=batch,
    )
    return memory.run_probe(command, marker=MARKER, timeout=1800)


def _row(points):
    """One configuration's row from its probes a batch."""
    first_batch = next(iter(points))
    first = points[first_batch][0]
    variables = first["variables"]
    parameters = variables["parameters"]
    # A gradient a weight, unless released in the backward pass.
    gradients = 0 if first.get("release_gradients") else 1
    ideal = (
        (1 + gradients) * variables["weight_bytes"] + variables["state_bytes"]
    ) / parameters
    slopes = {
        batch: slope(
            [
                (
                    p["variables"]["parameters"],
                    max(p["first_peak"], p["steady_peak"] or 0),
                )
                for p in probes
            ]
        )
        for batch, probes in points.items()
    }
    device = None
    if first.get("device_peak") is not None:
        device = slope(
            [
                (p["variables"]["parameters"], p["device_peak"])
                for p in points[first_batch]
            ]
        )
    return {
        "device": first["device"],
        "device_slope": device,
        "policy": first["policy"],
        "optimizer": first["optimizer"],
        "state_dtype": first["state_dtype"],
        "ideal": ideal,
        "slope": slopes[first_batch],
        "slopes": {str(batch): value for batch, value in slopes.items()},
        "over_ideal": slopes[first_batch] / ideal,
        "peaks": {
            str(batch): [
                [
                    p["variables"]["parameters"],
                    p["first_peak"],
                    p["steady_peak"],
                ]
                for p in probes
            ]
            for batch, probes in points.items()
        },
    }
