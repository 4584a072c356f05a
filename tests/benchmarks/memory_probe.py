"""One memory measurement, in a fresh process of its own.

Run by `memory.py` from the repository root, one process per
configuration, so that no earlier model, compilation cache or allocator
pool inflates the peak:

    python -m tests.benchmarks.memory_probe --backend jax --arm plugin \
        --policy mixed_bfloat16 --batch 16384 --width 256 --depth 6 --steps 3

It builds the activation-heavy MLP (a large batch through narrow, bias-free
hidden layers), reads the resident memory, trains one step (compilation,
optimizer slots), resets the peak, trains `--steps` more and reads the peak
again. The result is one JSON line after `MARKER` on
standard output.
"""

import argparse
import json
import os
import sys

from tests.benchmarks import threads

MARKER = "MEMORY_PROBE_RESULT "


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", required=True)
    parser.add_argument("--arm", required=True, choices=("plugin", "keras"))
    parser.add_argument("--policy", required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--width", type=int, required=True)
    parser.add_argument("--depth", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--threads", type=int, default=None)
    return parser


def probe(arm, policy, batch, width, depth, steps):
    """Measures the memory of training steps; returns a dict of bytes.

    Call only once `KERAS_BACKEND` is set.

    Returns:
        A dict: `baseline_rss` (after the model, its data and compile, before
        any step), `peak_rss` (the process's peak after all steps),
        `steady_peak_rss` (the peak of the steps after the first, or None
        where the peak cannot be reset), the `*_over_baseline` differences,
        and `device_peak` (None on a CPU).
    """
    from tests.benchmarks import backend_support
    from tests.benchmarks import models
    from tests.benchmarks import process_memory

    units = (width,) * (depth + 1) + (10,)
    # No bias in the hidden layers: TensorFlow's graph rewrite fuses MatMul
    # and BiasAdd, and that fused kernel in float16 is hundreds of times
    # slower on some CPUs (see docs/benchmarks.md). Memory is the question
    # here, not speed.
    model = models.build_mlp(arm, policy, units, use_bias=False)
    models.compile_model(model, models.make_optimizer(arm, policy))
    x, y = models.classification_data((width,), batch)
    variable = model.trainable_variables[0]

    baseline = process_memory.current_rss()
    backend_support.reset_peak_device_memory()
    model.train_on_batch(x, y)
    backend_support.sync(variable)
    first_peak = process_memory.peak_rss()
    can_reset = process_memory.reset_peak_rss()
    backend_support.reset_peak_device_memory()
    for _ in range(steps):
        model.train_on_batch(x, y)
    backend_support.sync(variable)
    last_peak = process_memory.peak_rss()
    steady_peak = last_peak if can_reset else None
    peak = max(first_peak, last_peak)
    return {
        "arm": arm,
        "policy": policy,
        "backend": backend_support.backend(),
        "device": backend_support.device(),
        "model": models.describe_model(model),
        "baseline_rss": baseline,
        "peak_rss": peak,
        "peak_over_baseline": peak - baseline,
        "steady_peak_rss": steady_peak,
        "steady_peak_over_baseline": (
            None if steady_peak is None else steady_peak - baseline
        ),
        "device_peak": backend_support.peak_device_memory(),
    }


def main(argv=None):
    """Runs one probe and prints its result; returns the exit status."""
    args = build_parser().parse_args(argv)
    os.environ["KERAS_BACKEND"] = args.backend
    threads.limit_environment(args.threads)
    threads.limit_backend(args.threads)
    result = probe(
        args.arm, args.policy, args.batch, args.width, args.depth, args.steps
    )
    sys.stdout.write(MARKER + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
