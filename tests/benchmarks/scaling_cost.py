"""Benchmark 6: what loss scaling costs a training step, per wrapper.

Three copies of a many-tensor model (`models.build_deep`: 48 x (Dense +
LayerNormalization), 194 weight tensors) under Keras' own "mixed_bfloat16"
policy, with the same weights, train with `fit` side by side: with the bare
Adam, with Adam in `keras.optimizers.LossScaleOptimizer`, and with Adam in
this package's `LossScaleOptimizer`, each wrapper passed to `compile`
explicitly. The cost of a wrapper is its step time over the bare one.

bfloat16 rather than float16: a CPU without float16 units takes about half
a second for a float16 step of this model, which hides any overhead. On a
GPU, float16 is what loss scaling is for: `policy_for` picks it there.

The models compile as Keras compiles by default (`jit_compile="auto"`: XLA
on JAX, none on PyTorch, none on TensorFlow without a GPU). On TensorFlow
the three also run a second time compiled with XLA (`jit_compile=True`):
without XLA, TensorFlow's graph executor overlaps each weight's update with
the rest of the backward pass, which no wrapper that may skip a step can
do (the update must wait for the verdict on every gradient). There a
fourth arm, `NeverSkippingLossScaleOptimizer`, checks every gradient and
applies every step: a diagnostic that puts the cost of the check apart
from the cost of waiting for it.

Import this module only once `KERAS_BACKEND` is set: it imports Keras.
"""

import keras
from keras import ops

import keras_dtype_policy as kdp
from tests.benchmarks import backend_support
from tests.benchmarks import models
from tests.benchmarks import stats
from tests.benchmarks import training
from tests.benchmarks.sizes import KERAS
from tests.benchmarks.sizes import PLUGIN
from tests.benchmarks.sizes import TARGETS

BARE = "bare"
NEVER_SKIPS = "never_skips"
ARMS = (BARE, KERAS, PLUGIN)


class NeverSkippingLossScaleOptimizer(kdp.LossScaleOptimizer):
    """A diagnostic, not a safe optimizer: checks, then applies every step.

    The verdict only counts the steps it would have skipped, which keeps
    the check in the graph while no update waits for it.
    """

    def _common_apply(self, grads, trainable_variables=None, finite=None):
        finite = self.check_finite(grads)
        self._stateful_handle_finite_grads(grads, trainable_variables)
        counter = self._skipped_step_counter
        counter.assign_add(ops.cast(ops.logical_not(finite), counter.dtype))


def policy_for(device):
    """Returns "mixed_float16" on a GPU, else "mixed_bfloat16"."""
    return "mixed_float16" if "gpu" in device.lower() else "mixed_bfloat16"


def build(sizes, policy, jit_compile="auto", arms=ARMS):
    """Returns `{arm: compiled model}`: same weights, own optimizer."""
    built = {}
    for arm in arms:
        model = models.build_deep(
            KERAS, policy, sizes.deep_units, sizes.deep_blocks
        )
        optimizer = keras.optimizers.Adam(1e-3)
        if arm == NEVER_SKIPS:
            optimizer = NeverSkippingLossScaleOptimizer(optimizer)
        elif arm != BARE:
            optimizer = models.wrap_optimizer(arm, optimizer)
        models.compile_model(model, optimizer, jit_compile=jit_compile)
        built[arm] = model
    for arm in arms[1:]:
        built[arm].set_weights(built[BARE].get_weights())
    return built


def run(sizes):
    """Runs the benchmark; returns its results as a dict.

    Args:
        sizes: A `sizes.Sizes`.

    Returns:
        A dict with the `setup`, each arm's step times, each wrapper's cost
        over the bare optimizer and the plugin's over Keras'; on
        TensorFlow, under `"xla"`, the same with `jit_compile=True`.
    """
    if keras.backend.backend() != "tensorflow":
        return run_compiled(sizes, "auto", ARMS)
    results = run_compiled(sizes, "auto", (*ARMS, NEVER_SKIPS))
    results["xla"] = run_compiled(sizes, True, ARMS)
    return results


def run_compiled(sizes, jit_compile, arms):
    """Runs the benchmark's `arms` compiled with `jit_compile`."""
    policy = policy_for(backend_support.device())
    compiled = build(sizes, policy, jit_compile, arms)
    x, y = models.classification_data(
        (sizes.deep_units,),
        training.samples_needed(sizes.max_steps, sizes.deep_batch),
        classes=10,
    )
    samples, steps = training.step_times(
        compiled,
        x,
        y,
        sizes.deep_batch,
        sizes,
        group=lambda arm: policy,
        repeats=sizes.deep_repeats,
    )
    target = TARGETS["scaling_cost"]
    costs = {}
    for arm in arms[1:]:
        comparison = stats.compare(samples[arm], samples[BARE])
        costs[arm] = {
            "comparison": comparison,
            "verdict": stats.verdict(comparison, target, at_most=True),
        }
    plugin_over_keras = stats.compare(samples[PLUGIN], samples[KERAS])
    return {
        "setup": {
            "model": f"{sizes.deep_blocks} x (Dense {sizes.deep_units} + "
            "LayerNormalization), Dense 10",
            "policy": policy,
            "batch_size": sizes.deep_batch,
            "steps_per_repeat": steps,
            "repeats": sizes.deep_repeats,
            "target": target,
            "models": {
                arm: models.describe_model(m) for arm, m in compiled.items()
            },
            "weight_tensors": len(compiled[BARE].trainable_weights),
        },
        **{arm: stats.summarize(samples[arm]) for arm in arms},
        "cost": costs,
        "plugin_over_keras": {
            "comparison": plugin_over_keras,
            "verdict": stats.verdict(plugin_over_keras, 1.0, at_most=True),
        },
    }
