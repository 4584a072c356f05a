"""Benchmark 3: what mixed precision buys, with each arm's policies.

For the MLP and the convnet, six copies of the model (two arms, three
policies) with the same weights train side by side. An arm's speed-up of a
mixed policy is its float32 step time over its mixed step time; the plugin
should buy what Keras buys: plugin speed-up over Keras speed-up near 1.

Import this module only once `KERAS_BACKEND` is set: it imports Keras.
"""

from tests.benchmarks import models
from tests.benchmarks import stats
from tests.benchmarks import training
from tests.benchmarks.sizes import ARMS
from tests.benchmarks.sizes import KERAS
from tests.benchmarks.sizes import MIXED_POLICIES
from tests.benchmarks.sizes import PLUGIN
from tests.benchmarks.sizes import POLICIES
from tests.benchmarks.sizes import TARGETS


def model_specs(sizes):
    """Returns `{model name: (builder, input shape, batch size, title)}`."""
    mlp_units = sizes.mlp_units
    image = sizes.conv_image
    return {
        "mlp": (
            lambda arm, policy: models.build_mlp(arm, policy, mlp_units),
            (mlp_units[0],),
            sizes.mlp_batch,
            "MLP " + "-".join(str(u) for u in mlp_units),
        ),
        "convnet": (
            lambda arm, policy: models.build_convnet(
                arm, policy, image, sizes.conv_filters
            ),
            (image, image, 3),
            sizes.conv_batch,
            f"convnet {image}x{image}x3, filters "
            + "-".join(str(f) for f in sizes.conv_filters),
        ),
    }


def build(builder):
    """Returns `{(arm, policy): compiled model}`, all with the same weights."""
    built = {}
    for arm in ARMS:
        for policy in POLICIES:
            model = builder(arm, policy)
            models.compile_model(model, models.make_optimizer(arm, policy))
            built[arm, policy] = model
    weights = next(iter(built.values())).get_weights()
    for model in built.values():
        model.set_weights(weights)
    return built


def speedups(samples):
    """Returns each arm's speed-up of each mixed policy, and their ratios.

    Args:
        samples: `{(arm, policy): [seconds per step]}`, paired repetitions.

    Returns:
        A list of rows, one per mixed policy.
    """
    rows = []
    for policy in MIXED_POLICIES:
        per_arm = {}
        for arm in ARMS:
            float32 = samples[arm, "float32"]
            mixed = samples[arm, policy]
            per_arm[arm] = {
                "speedup": stats.summarize(float32)["median"]
                / stats.summarize(mixed)["median"],
                "paired": [a / b for a, b in zip(float32, mixed, strict=True)],
            }
        comparison = stats.compare(
            per_arm[PLUGIN]["paired"], per_arm[KERAS]["paired"]
        )
        # The ratio of the speed-ups themselves (medians of step times).
        comparison["ratio"] = (
            per_arm[PLUGIN]["speedup"] / per_arm[KERAS]["speedup"]
        )
        rows.append(
            {
                "policy": policy,
                "speedup": {arm: per_arm[arm]["speedup"] for arm in ARMS},
                "comparison": comparison,
                "verdict": stats.verdict(
                    comparison, TARGETS["speedup"], at_most=False
                ),
            }
        )
    return rows


def run(sizes):
    """Runs the benchmark; returns its results as a dict.

    Args:
        sizes: A `sizes.Sizes`.

    Returns:
        A dict `{model name: results}`.
    """
    results = {}
    for name, (builder, shape, batch_size, title) in model_specs(sizes).items():
        compiled = build(builder)
        x, y = models.classification_data(
            shape, training.samples_needed(sizes.max_steps, batch_size)
        )
        # Both arms of a policy time the same number of steps.
        samples, steps = training.step_times(
            compiled, x, y, batch_size, sizes, group=lambda key: key[1]
        )
        results[name] = {
            "setup": {
                "model": title,
                "batch_size": batch_size,
                "steps_per_repeat": {
                    f"{arm}/{policy}": count
                    for (arm, policy), count in steps.items()
                },
                "repeats": sizes.repeats,
                "target": TARGETS["speedup"],
                "models": {
                    f"{arm}/{policy}": models.describe_model(model)
                    for (arm, policy), model in compiled.items()
                },
            },
            "step_times": {
                f"{arm}/{policy}": stats.summarize(samples[arm, policy])
                for arm, policy in compiled
            },
            "rows": speedups(samples),
        }
        del compiled
    return results
