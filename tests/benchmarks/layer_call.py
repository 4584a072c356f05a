"""Benchmark 1: the cost of an eager layer call under each arm's policy.

A Dense layer is called eagerly on the same float32 input under this
package's `DTypePolicy` and under Keras' own `keras.DTypePolicy` of the same
name. Two inputs: a backend tensor (what a layer inside a model receives;
for "float32" Keras' fast path skips `convert_input` altogether) and a NumPy
array (always converted by the policy).

Import this module only once `KERAS_BACKEND` is set: it imports Keras.
"""

import keras
import numpy as np

from tests.benchmarks import backend_support
from tests.benchmarks import measure
from tests.benchmarks import stats
from tests.benchmarks.models import make_policy
from tests.benchmarks.sizes import ARMS
from tests.benchmarks.sizes import KERAS
from tests.benchmarks.sizes import PLUGIN
from tests.benchmarks.sizes import POLICIES
from tests.benchmarks.sizes import TARGETS

INPUTS = ("tensor", "numpy")


def make_layers(policy_name, units, features):
    """Returns `{arm: built Dense layer}`, with the same weights."""
    layers = {
        arm: keras.layers.Dense(units, dtype=make_policy(arm, policy_name))
        for arm in ARMS
    }
    for layer in layers.values():
        layer.build((None, features))
    layers[KERAS].set_weights(layers[PLUGIN].get_weights())
    return layers


def make_input(kind, shape, seed=0):
    """Returns a float32 input of `shape`: a backend tensor or NumPy array."""
    x = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
    if kind == "numpy":
        return x
    return keras.ops.convert_to_tensor(x)


def call_block(layer, x, calls):
    """Returns a callable making `calls` eager calls, each synchronized."""
    sync = backend_support.sync

    def block():
        for _ in range(calls):
            sync(layer(x))

    return block


def run(sizes):
    """Runs the benchmark; returns its results as a dict.

    Args:
        sizes: A `sizes.Sizes`.

    Returns:
        A dict with the `setup` and one row per (policy, input).
    """
    rows = []
    for policy_name in POLICIES:
        layers = make_layers(
            policy_name, sizes.layer_units, sizes.layer_shape[-1]
        )
        for kind in INPUTS:
            x = make_input(kind, sizes.layer_shape)
            measurements = {
                arm: measure.timed(
                    call_block(layers[arm], x, sizes.layer_calls),
                    units=sizes.layer_calls,
                )
                for arm in ARMS
            }
            samples = measure.interleaved(
                measurements, sizes.layer_repeats, warmup=2
            )
            comparison = stats.compare(samples[PLUGIN], samples[KERAS])
            rows.append(
                {
                    "policy": policy_name,
                    "input": kind,
                    PLUGIN: stats.summarize(samples[PLUGIN]),
                    KERAS: stats.summarize(samples[KERAS]),
                    "comparison": comparison,
                    "verdict": stats.verdict(
                        comparison, TARGETS["layer_call"], at_most=True
                    ),
                }
            )
    return {
        "setup": {
            "layer": f"Dense({sizes.layer_units})",
            "input_shape": list(sizes.layer_shape),
            "calls_per_repeat": sizes.layer_calls,
            "repeats": sizes.layer_repeats,
            "target": TARGETS["layer_call"],
        },
        "rows": rows,
    }
