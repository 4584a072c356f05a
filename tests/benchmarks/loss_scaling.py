"""Benchmark 2: training throughput under loss scaling, optimizer vs optimizer.

Two copies of the MLP under Keras' own "mixed_float16" policy, with the same
weights, train with `fit` side by side: one with this package's
`LossScaleOptimizer`, one with `keras.optimizers.LossScaleOptimizer`, both
around Adam and passed to `compile` explicitly (the compile hook keeps a
loss-scale optimizer as it is). Only the optimizer differs.

Import this module only once `KERAS_BACKEND` is set: it imports Keras.
"""

from tests.benchmarks import models
from tests.benchmarks import stats
from tests.benchmarks import training
from tests.benchmarks.sizes import ARMS
from tests.benchmarks.sizes import KERAS
from tests.benchmarks.sizes import PLUGIN
from tests.benchmarks.sizes import TARGETS

POLICY = "mixed_float16"


def build(sizes):
    """Returns `{arm: compiled MLP}`, same policy and weights, own optimizer."""
    built = {}
    for arm in ARMS:
        model = models.build_mlp(KERAS, POLICY, sizes.mlp_units)
        models.compile_model(
            model, models.make_optimizer(arm, POLICY, loss_scale=True)
        )
        built[arm] = model
    built[KERAS].set_weights(built[PLUGIN].get_weights())
    return built


def run(sizes):
    """Runs the benchmark; returns its results as a dict.

    Args:
        sizes: A `sizes.Sizes`.

    Returns:
        A dict with the `setup`, each arm's step times and the comparison.
    """
    compiled = build(sizes)
    x, y = models.classification_data(
        (sizes.mlp_units[0],),
        training.samples_needed(sizes.max_steps, sizes.mlp_batch),
        classes=sizes.mlp_units[-1],
    )
    samples, steps = training.step_times(
        compiled, x, y, sizes.mlp_batch, sizes, group=lambda arm: POLICY
    )
    comparison = stats.compare(samples[PLUGIN], samples[KERAS])
    return {
        "setup": {
            "model": "MLP " + "-".join(str(u) for u in sizes.mlp_units),
            "policy": POLICY,
            "batch_size": sizes.mlp_batch,
            "steps_per_repeat": steps,
            "repeats": sizes.repeats,
            "target": TARGETS["loss_scaling"],
            "models": {
                arm: models.describe_model(m) for arm, m in compiled.items()
            },
        },
        PLUGIN: stats.summarize(samples[PLUGIN]),
        KERAS: stats.summarize(samples[KERAS]),
        "comparison": comparison,
        "verdict": stats.verdict(
            comparison, TARGETS["loss_scaling"], at_most=True
        ),
    }
