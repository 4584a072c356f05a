"""Benchmark 14: a keras-hub model's peak memory and loss (issue #43).

A `GPT2CausalLM` from a config (`hub_peak_memory_probe`: hidden 512,
vocabulary 8192, sequences of 128) at several depths, fine-tuned with
Adam for a few dozen steps under `mixed_bfloat16` and the package's
low-memory configurations, gradient release among them (PyTorch; the
usual step elsewhere). One fresh process a configuration and depth; the
slope of the process's peak resident memory against the parameter count
(bytes a parameter, fixed costs cancelled), the peak at the largest
depth, and the mean loss of the last steps against `mixed_bfloat16`'s.
Skipped, with the reason, where keras-hub is not installed.
`KDP_BENCHMARK14_ONLY` keeps a comma-separated subset (mixed_bfloat16
always). Importing this module imports no backend and not Keras.
"""

import importlib.util
import sys

from tests.benchmarks import memory
from tests.benchmarks import subsets
from tests.benchmarks.hub_peak_memory_probe import MARKER
from tests.benchmarks.peak_memory import slope

PROBE = "tests.benchmarks.hub_peak_memory_probe"
REFERENCE = "mixed_bfloat16"
CONFIGURATIONS = (
    REFERENCE,
    "stochastic_bfloat16_8bit",
    "stochastic_bfloat16_8bit+release",
    "stochastic_bfloat16_4bit+release",
)
LAYERS = {"full": (4, 8, 16), "quick": (2, 4)}
STEPS = {"full": 30, "quick": 4}
BATCH = 8


def run(backend, sizes, threads=None):
    """Runs the benchmark for `backend`; returns its results as a dict."""
    if importlib.util.find_spec("keras_hub") is None:
        return {"skipped": "keras-hub is not installed (tox -e keras-hub)"}
    names = subsets.chosen("KDP_BENCHMARK14_ONLY", CONFIGURATIONS, (REFERENCE,))
    layers = LAYERS[sizes.name]
    steps = STEPS[sizes.name]
    rows = {}
    for name in names:
        probes = [
            memory.run_probe(
                _command(backend, name, depth, steps, threads),
                timeout=1800,
                marker=MARKER,
            )
            for depth in layers
        ]
        largest = probes[-1]
        rows[name] = {
            "slope": slope([(p["parameters"], p["peak"]) for p in probes]),
            "parameters": [p["parameters"] for p in probes],
            "peaks": [p["peak"] for p in probes],
            "peak_over_imported": largest["peak"] - largest["imported"],
            "first_loss": _mean(largest["first_losses"]),
            "last_loss": _mean(largest["last_losses"]),
            "release_gradients": largest["release_gradients"],
        }
    return {
        "setup": {
            "model": "GPT2CausalLM from a config: hidden 512, 8 heads, "
            "vocabulary 8192, sequences of 128, Adam at 1e-4",
            "layers": list(layers),
            "batch": BATCH,
            "steps": steps,
        },
        "rows": rows,
    }


def _command(backend, name, layers, steps, threads):
    limit = [] if threads is None else [f"--threads={threads}"]
    return [
        sys.executable,
        "-m",
        PROBE,
        f"--backend={backend}",
        f"--configuration={name}",
        f"--layers={layers}",
        f"--batch={BATCH}",
        f"--steps={steps}",
        *limit,
    ]


def _mean(values):
    return sum(values) / len(values)
