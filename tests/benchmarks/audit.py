"""Benchmark 5: the numerics audit of a model of about 300,000 parameters.

An MLP 784-320-160-10 (304,170 parameters), compiled with a loss, is
audited on 256 samples with labels (so the gradient columns are computed
too) under mixed_float16 and mixed_bfloat16: the wall time of
`keras_dtype_policy.audit`, rebuilding both copies included. The issue asks
for "seconds on this machine". The quick sizes audit a smaller MLP.

Run alone: `KERAS_BACKEND=jax python -m tests.benchmarks.audit [--quick]`.
Import this module only once `KERAS_BACKEND` is set: it imports Keras.
"""

import json
import sys
import time

import keras
import numpy as np

import keras_dtype_policy as kdp
from tests.benchmarks import stats

POLICIES = ("mixed_float16", "mixed_bfloat16")
FULL_UNITS = (784, 320, 160, 10)
QUICK_UNITS = (64, 32, 10)
SAMPLES = 256


def build(units):
    """Returns a compiled float32 MLP with `units` (inputs ... classes)."""
    inputs = keras.Input((units[0],))
    x = inputs
    for width in units[1:-1]:
        x = keras.layers.Dense(width, activation="relu")(x)
    outputs = keras.layers.Dense(units[-1], name="logits")(x)
    model = keras.Model(inputs, outputs, name="mlp")
    model.compile("adam", "sparse_categorical_crossentropy")
    return model


def run(sizes):
    """Times the audit; returns its results as a dict.

    Args:
        sizes: A `sizes.Sizes` (its `name` picks the model, its `repeats`
            the timed repetitions).
    """
    units = QUICK_UNITS if sizes.name == "quick" else FULL_UNITS
    model = build(units)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((SAMPLES, units[0])).astype("float32")
    y = rng.integers(0, units[-1], SAMPLES)
    kdp.audit(model, POLICIES[0], x=x, y=y)  # warm-up: tracing, kernels
    rows = []
    for policy in POLICIES:
        seconds = []
        for _ in range(sizes.repeats):
            began = time.perf_counter()
            table = kdp.audit(model, policy, x=x, y=y)
            seconds.append(time.perf_counter() - began)
        rows.append(
            {
                "policy": policy,
                "seconds": stats.summarize(seconds),
                "safe": table.safe,
                "layers": len(table),
            }
        )
    return {
        "setup": {
            "model": "MLP " + "-".join(str(u) for u in units),
            "parameters": model.count_params(),
            "samples": SAMPLES,
            "gradients": True,
            "repeats": sizes.repeats,
        },
        "rows": rows,
    }


def main(argv=None):
    from tests.benchmarks import report
    from tests.benchmarks import sizes as sizes_module

    argv = sys.argv[1:] if argv is None else argv
    results = run(sizes_module.get_sizes("--quick" in argv))
    print("\n".join(report.audit_section(results)))
    print(json.dumps(results, indent=2), file=sys.stderr)


if __name__ == "__main__":
    main()
