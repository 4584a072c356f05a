"""Benchmark 8: training under a global float8 policy.

On two tasks of `low_precision_tasks` (the small character-level
transformer and the regression MLP), three configurations train side by
side from the same initial weights, on the same batches, with Adam at the
same learning rate: float32, mixed_bfloat16, and
float8_from_mixed_bfloat16 set as one policy (its Dense and EinsumDense
layers, those inside MultiHeadAttention included, train in float8; every
other layer in mixed_bfloat16). Reported per task: the held-out loss, its
ratio to mixed_bfloat16's, and the step time over mixed_bfloat16's,
measured interleaved in one process (the chunks of `fit` take turns).

float8 has no arithmetic units on these CPUs: Keras emulates it (a cast to
float8 and back around each matmul, plus the scaling bookkeeping), so the
step time here measures the emulation's cost, never float8's speed. The
speed belongs to a GPU with float8 units (H100 and later); the report
keeps a row for it, filled only from a real run on such a machine.

Run alone: `python tests/benchmarks/run.py --backend jax --only float8`
(add `--quick` for a smoke run).
Import this module only once `KERAS_BACKEND` is set: it imports Keras.
"""

import keras

from keras_dtype_policy.policies.global_policy import policy_scope
from tests.benchmarks import backend_support
from tests.benchmarks import low_precision
from tests.benchmarks import low_precision_tasks as tasks
from tests.benchmarks import stats

FLOAT8 = "float8_from_mixed_bfloat16"
MIXED = "mixed_bfloat16"
CONFIGURATIONS = ("float32", MIXED, FLOAT8)
FULL_STEPS = {"char_lm": 300, "regression": 1000}
QUICK_STEPS = {"char_lm": 10, "regression": 20}
LEARNING_RATES = {"char_lm": 1e-3, "regression": 1e-4}
FULL_CHUNKS = 10
QUICK_CHUNKS = 2
# Keras' own float8 example (a transformer classifier on IMDB): test
# accuracy 80.98% under float8 against 81.16% in mixed_bfloat16.
KERAS_EXAMPLE = {"float8": 80.98, "mixed_bfloat16": 81.16}


def build_tasks(quick):
    """Returns the two tasks at their full or quick sizes."""
    steps = QUICK_STEPS if quick else FULL_STEPS
    return [
        tasks.char_lm_task(steps["char_lm"], LEARNING_RATES["char_lm"]),
        tasks.regression_task(
            steps["regression"], LEARNING_RATES["regression"]
        ),
    ]


def trained_weights(model):
    """The model's weights that training updates (not float8 scaling
    state, which a float8 layer adds before its kernel)."""
    return [
        weight
        for weight in model.weights
        if not getattr(weight, "overwrite_with_gradient", False)
    ]


def float8_layer_count(model):
    """How many of the model's layers train in float8."""
    return sum(
        1
        for layer in model._flatten_layers(include_self=False)
        if layer.quantization_mode == "float8"
    )


def build_models(task):
    """Returns `{name: compiled model}`, all from the same weights."""
    keras.utils.set_random_seed(0)
    with policy_scope("float32"):
        initial = task.build().get_weights()
    built = {}
    for name in CONFIGURATIONS:
        with policy_scope(name):
            model = task.build()
        targets = trained_weights(model)
        if len(targets) != len(initial):
            raise RuntimeError(
                f"{task.name} under {name} has {len(targets)} trained "
                f"weights, float32 has {len(initial)}"
            )
        for target, value in zip(targets, initial, strict=True):
            target.assign(value)
        model.compile(
            optimizer=keras.optimizers.Adam(task.learning_rate),
            loss=task.loss,
        )
        built[name] = model
    return built


def run_task(task, chunks):
    """Runs one task; returns its rows and setup."""
    models = build_models(task)
    times, losses = low_precision.train_interleaved(task, models, chunks)
    rows = {}
    for name, model in models.items():
        _, loss = tasks.evaluate(model, task)
        rows[name] = {
            "test_loss": loss,
            "train_losses": losses[name],
            "float8_layers": float8_layer_count(model),
            "optimizer": type(model.optimizer).__name__,
            "step_time": stats.summarize(times[name]),
            "time_over_mixed": stats.compare(times[name], times[MIXED]),
        }
    for row in rows.values():
        row["loss_over_mixed"] = row["test_loss"] / rows[MIXED]["test_loss"]
    return {
        "setup": {
            "description": task.description,
            "steps": (len(task.x_train) // task.batch_size) // chunks * chunks,
            "chunks": chunks,
            "batch_size": task.batch_size,
            "learning_rate": task.learning_rate,
            "jit_compile": getattr(models[MIXED], "jit_compile", None),
        },
        "rows": rows,
    }


def run(sizes):
    """Runs the benchmark; returns its results as a dict.

    Args:
        sizes: A `sizes.Sizes`; its `name` ("full" or "quick") picks the
            steps.
    """
    quick = sizes.name == "quick"
    results = {
        "keras_example": KERAS_EXAMPLE,
        "device": backend_support.device(),
        "tasks": {},
    }
    for task in build_tasks(quick):
        results["tasks"][task.name] = run_task(
            task, QUICK_CHUNKS if quick else FULL_CHUNKS
        )
        keras.utils.clear_session()
    return results
