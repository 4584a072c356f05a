"""Benchmark 7: training in bfloat16 with compensated updates.

On three tasks (`low_precision_tasks`: the demo's digits convnet, a small
character-level transformer, a regression MLP), seven configurations train
side by side from the same initial weights, on the same batches, with Adam
at the same learning rate:

- float32;
- mixed_bfloat16: bfloat16 compute, float32 weights and optimizer state
  (Keras' mixed precision);
- bfloat16: Keras' own "bfloat16" policy, weights and Adam's moments in
  bfloat16, updates rounded to nearest (what a Keras user gets today);
- bfloat16_float32_state: bfloat16 weights, updates rounded to nearest,
  Adam's moments in float32 (`LowPrecisionOptimizer(update="nearest",
  state_dtype="float32")`): the updates lost to rounding alone, without
  the failures of Adam's moments in bfloat16;
- bfloat16_kahan: bfloat16 weights, `LowPrecisionOptimizer(update="kahan",
  state_dtype="bfloat16")`: one bfloat16 compensation buffer per weight;
- bfloat16_stochastic: bfloat16 weights, `update="stochastic_rounding"`,
  bfloat16 state, no buffer;
- mixed_bfloat16_state: mixed_bfloat16 with Adam's moments in bfloat16,
  stored with stochastic rounding (`update="stochastic_rounding",
  state_dtype="bfloat16"`).

Training runs in chunks of `fit` (one epoch over a slice of the batches),
the configurations taking turns, in an order that reverses each chunk, so
the step times (every chunk's but the first, which compiles) are measured
interleaved in one process. Reported per task and configuration: the
held-out score, the bytes of weights and optimizer state counted from the
variables, and the step time over mixed_bfloat16's and over plain
bfloat16's. The issue's targets are checked and stated, never asserted.

Run alone: `python tests/benchmarks/run.py --backend jax --only
low_precision` (add `--quick` for a smoke run; `KDP_BENCHMARK7_ONLY`, a
comma-separated list of configurations, runs a subset).
Import this module only once `KERAS_BACKEND` is set: it imports Keras.
"""

import keras
import numpy as np

import keras_dtype_policy as kdp
from keras_dtype_policy.policies.global_policy import policy_scope
from tests.benchmarks import low_precision_tasks as tasks
from tests.benchmarks import measure
from tests.benchmarks import stats
from tests.benchmarks import subsets
from tests.benchmarks import training

MIXED = "mixed_bfloat16"
PLAIN = "bfloat16"
NEAREST = "bfloat16_float32_state"
KAHAN = "bfloat16_kahan"
STOCHASTIC = "bfloat16_stochastic"
STATE = "mixed_bfloat16_state"
STOCHASTIC_FLOAT32 = "bfloat16_stochastic_float32_state"
STOCHASTIC_8BIT = "bfloat16_stochastic_8bit"
KAHAN_8BIT = "bfloat16_kahan_8bit"
MIXED_8BIT = "mixed_bfloat16_8bit"
STOCHASTIC_4BIT = "bfloat16_stochastic_4bit"
# name: (policy, LowPrecisionOptimizer arguments or None for bare Adam).
CONFIGURATIONS = {
    "float32": ("float32", None),
    MIXED: ("mixed_bfloat16", None),
    PLAIN: ("bfloat16", None),
    NEAREST: ("bfloat16", {"update": "nearest", "state_dtype": "float32"}),
    KAHAN: ("bfloat16", {"update": "kahan", "state_dtype": "bfloat16"}),
    STOCHASTIC: (
        "bfloat16",
        {"update": "stochastic_rounding", "state_dtype": "bfloat16", "seed": 0},
    ),
    # With float32 weights, `update` only decides how the state is
    # rounded: stochastically (to nearest, a bfloat16 second moment
    # freezes).
    STATE: (
        "mixed_bfloat16",
        {"update": "stochastic_rounding", "state_dtype": "bfloat16", "seed": 0},
    ),
    STOCHASTIC_FLOAT32: (
        "bfloat16",
        {"update": "stochastic_rounding", "state_dtype": "float32", "seed": 0},
    ),
    STOCHASTIC_8BIT: (
        "bfloat16",
        {"update": "stochastic_rounding", "state_dtype": "8bit", "seed": 0},
    ),
    KAHAN_8BIT: ("bfloat16", {"update": "kahan", "state_dtype": "8bit"}),
    MIXED_8BIT: (
        "mixed_bfloat16",
        {"update": "stochastic_rounding", "state_dtype": "8bit", "seed": 0},
    ),
    STOCHASTIC_4BIT: (
        "bfloat16",
        {"update": "stochastic_rounding", "state_dtype": "4bit", "seed": 0},
    ),
}
COMPENSATED = (KAHAN, STOCHASTIC)
# Checked against mixed_bfloat16's quality (issues #26 and #33).
QUALITY = (
    *COMPENSATED,
    STOCHASTIC_FLOAT32,
    STOCHASTIC_8BIT,
    KAHAN_8BIT,
    MIXED_8BIT,
    STOCHASTIC_4BIT,
)
# Targets of issues #26 and #33.
TARGETS = {
    # Held-out loss over mixed_bfloat16's, at most 1 + this.
    "relative_loss": 0.01,
    # Accuracy points below mixed_bfloat16's, at most.
    "accuracy_points": 0.5,
    # Bytes of weights and optimizer state over mixed_bfloat16's.
    "memory": {KAHAN: 0.67, STOCHASTIC: 0.5, STOCHASTIC_8BIT: 0.35},
    # Step time over plain bfloat16's.
    "step_time": 1.10,
}
# Steps and learning rate per task; quick runs take few steps.
FULL_STEPS = {"digits": 600, "char_lm": 300, "regression": 1000}
QUICK_STEPS = {"digits": 20, "char_lm": 10, "regression": 20}
LEARNING_RATES = {"digits": 1e-4, "char_lm": 1e-3, "regression": 1e-4}
FULL_CHUNKS = 10
QUICK_CHUNKS = 2


def available():
    """True where this package offers `LowPrecisionOptimizer`."""
    return hasattr(kdp, "LowPrecisionOptimizer")


def make_optimizer(learning_rate, arguments):
    """Returns Adam, wrapped in `LowPrecisionOptimizer` if `arguments`."""
    optimizer = keras.optimizers.Adam(learning_rate)
    if arguments is None:
        return optimizer
    return kdp.LowPrecisionOptimizer(optimizer, **arguments)


def build_tasks(quick):
    """Returns the three tasks at their full or quick sizes."""
    steps = QUICK_STEPS if quick else FULL_STEPS
    return [
        tasks.digits_task(steps["digits"], LEARNING_RATES["digits"]),
        tasks.char_lm_task(steps["char_lm"], LEARNING_RATES["char_lm"]),
        tasks.regression_task(
            steps["regression"], LEARNING_RATES["regression"]
        ),
    ]


def build_models(task, configurations):
    """Returns `{name: compiled model}`, all from the same weights."""
    keras.utils.set_random_seed(0)
    with policy_scope("float32"):
        initial = task.build().get_weights()
    built = {}
    for name in configurations:
        policy, arguments = CONFIGURATIONS[name]
        with policy_scope(policy):
            model = task.build()
        model.set_weights(initial)
        model.compile(
            optimizer=make_optimizer(task.learning_rate, arguments),
            loss=task.loss,
            metrics=["accuracy"] if task.metric == "accuracy" else None,
        )
        built[name] = model
    return built


def unique_variables(variables):
    """Returns the variables without repeats (a wrapper lists the inner
    optimizer's too)."""
    seen, unique = set(), []
    for variable in variables:
        key = id(variable)
        if key not in seen:
            seen.add(key)
            unique.append(variable)
    return unique


def memory_row(model):
    """Returns the bytes of the model's weights and optimizer state.

    `state_bytes` counts the optimizer variables shaped as a weight (the
    state that grows with the model: moments, compensation buffers) and
    the codes and scales of 8-bit and 4-bit slots; `fixed_bytes` the
    others (step counters, the learning rate, a random generator's state,
    the one-scalar storage of a quantized slot), a few bytes whatever the
    model.
    """
    model.optimizer.build(model.trainable_variables)
    weights = unique_variables(model.weights)
    weight_ids = {id(v) for v in weights}
    shapes = {tuple(v.shape) for v in model.trainable_variables}
    variables = unique_variables(model.optimizer.variables)
    coded = {}
    for slot in _quantized_slots(model.optimizer):
        coded[id(slot.codes)] = slot.codes
        coded[id(slot.scales)] = slot.scales
    state, fixed = list(coded.values()), []
    for variable in variables:
        if id(variable) in weight_ids or id(variable) in coded:
            continue
        if tuple(variable.shape) in shapes and len(variable.shape):
            state.append(variable)
        else:
            fixed.append(variable)
    parameters = sum(int(np.prod(v.shape)) for v in weights) or 1
    weight_bytes = tasks.variable_bytes(weights)
    state_bytes = tasks.variable_bytes(state)
    return {
        "parameters": parameters,
        "weight_bytes": weight_bytes,
        "state_bytes": state_bytes,
        "fixed_bytes": tasks.variable_bytes(fixed),
        "total_bytes": weight_bytes + state_bytes,
        "bytes_per_parameter": (weight_bytes + state_bytes) / parameters,
        "weight_dtypes": sorted(
            {keras.backend.standardize_dtype(v.dtype) for v in weights}
        ),
        "state_dtypes": sorted(
            {keras.backend.standardize_dtype(v.dtype) for v in state}
        ),
    }


def _quantized_slots(optimizer):
    """The quantized slots of a `LowPrecisionOptimizer`, also inside a
    loss-scale optimizer; none for any other optimizer."""
    while optimizer is not None:
        if isinstance(optimizer, kdp.LowPrecisionOptimizer):
            return optimizer.quantized_slots
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return []


def train_interleaved(task, models, chunks):
    """Trains every model on the task's batches, in turns, chunk by chunk.

    Returns:
        `({name: [seconds per step, one per chunk but the first]},
        {name: [training loss at the end of each chunk]})`.
    """
    steps = len(task.x_train) // task.batch_size
    per_chunk = steps // chunks
    names = list(models)
    clocks = {name: training.StepClock(training.SKIP) for name in names}
    times = {name: [] for name in names}
    losses = {name: [] for name in names}
    for chunk in range(chunks):
        start = chunk * per_chunk * task.batch_size
        stop = start + per_chunk * task.batch_size
        order = names if chunk % 2 == 0 else names[::-1]
        for name in order:
            with measure.collector_paused():
                history = models[name].fit(
                    task.x_train[start:stop],
                    task.y_train[start:stop],
                    batch_size=task.batch_size,
                    epochs=1,
                    shuffle=False,
                    verbose=0,
                    callbacks=[clocks[name]],
                )
            losses[name].append(float(history.history["loss"][-1]))
            if chunk:
                times[name].append(clocks[name].seconds_per_step())
    return times, losses


def run_task(task, chunks, configurations):
    """Runs one task; returns its rows and setup."""
    models = build_models(task, configurations)
    memory = {name: memory_row(model) for name, model in models.items()}
    times, losses = train_interleaved(task, models, chunks)
    rows = {}
    for name, model in models.items():
        score, loss = tasks.evaluate(model, task)
        row = {
            "policy": CONFIGURATIONS[name][0],
            "optimizer": _optimizer_name(model.optimizer),
            "score": score,
            "test_loss": loss,
            "train_losses": losses[name],
            "memory": memory[name],
            "step_time": stats.summarize(times[name]),
        }
        if MIXED in models:
            row["memory_over_mixed"] = (
                memory[name]["total_bytes"] / memory[MIXED]["total_bytes"]
            )
            row["time_over_mixed"] = stats.compare(times[name], times[MIXED])
        if PLAIN in models:
            row["time_over_plain"] = stats.compare(times[name], times[PLAIN])
        rows[name] = row
    return {
        "setup": {
            "description": task.description,
            "metric": task.metric,
            "steps": (len(task.x_train) // task.batch_size) // chunks * chunks,
            "chunks": chunks,
            "batch_size": task.batch_size,
            "learning_rate": task.learning_rate,
            "jit_compile": getattr(models[MIXED], "jit_compile", None)
            if MIXED in models
            else None,
        },
        "rows": rows,
        "targets": check_targets(task.metric, rows),
    }


def check_targets(metric, rows):
    """Returns each target of the issue with the figure and a verdict."""
    if MIXED not in rows:
        return []
    reference = rows[MIXED]["score"]
    checks = []

    def quality(name):
        score = rows[name]["score"]
        if metric == "accuracy":
            points = 100 * (reference - score)
            return points, points <= TARGETS["accuracy_points"]
        relative = score / reference - 1
        return relative, relative <= TARGETS["relative_loss"]

    unit = (
        "accuracy points below mixed"
        if metric == "accuracy"
        else "relative loss over mixed"
    )
    for name in QUALITY:
        if name in rows:
            figure, within = quality(name)
            checks.append(
                {
                    "target": "quality",
                    "configuration": name,
                    "figure": figure,
                    "unit": unit,
                    "within": within,
                }
            )
    if PLAIN in rows:
        # Not a target of this package: the effect the benchmark must show
        # somewhere, plain bfloat16 losing updates.
        figure, within = quality(PLAIN)
        checks.append(
            {
                "target": "plain_worse",
                "configuration": PLAIN,
                "figure": figure,
                "unit": unit,
                "within": not within,
            }
        )
    for name, limit in TARGETS["memory"].items():
        if name in rows:
            ratio = rows[name]["memory_over_mixed"]
            checks.append(
                {
                    "target": "memory",
                    "configuration": name,
                    "figure": ratio,
                    "limit": limit,
                    "within": ratio <= limit,
                }
            )
    for name in COMPENSATED:
        if name in rows and PLAIN in rows:
            comparison = rows[name]["time_over_plain"]
            checks.append(
                {
                    "target": "step_time",
                    "configuration": name,
                    "figure": comparison["ratio"],
                    "limit": TARGETS["step_time"],
                    "verdict": stats.verdict(
                        comparison, TARGETS["step_time"], at_most=True
                    ),
                    "within": comparison["ratio"] <= TARGETS["step_time"],
                }
            )
    return checks


def run(sizes):
    """Runs the benchmark; returns its results as a dict.

    Args:
        sizes: A `sizes.Sizes`; its `name` ("full" or "quick") picks the
            steps.
    """
    quick = sizes.name == "quick"
    configurations = subsets.chosen(
        "KDP_BENCHMARK7_ONLY", CONFIGURATIONS, (MIXED, PLAIN)
    )
    missing = []
    if not available():
        missing = [n for n in configurations if CONFIGURATIONS[n][1]]
        configurations = [n for n in configurations if n not in missing]
    results = {
        "targets": TARGETS,
        "unavailable": missing,
        "tasks": {},
    }
    for task in build_tasks(quick):
        results["tasks"][task.name] = run_task(
            task, QUICK_CHUNKS if quick else FULL_CHUNKS, configurations
        )
        keras.utils.clear_session()
    return results


def _optimizer_name(optimizer):
    inner = getattr(optimizer, "inner_optimizer", None)
    name = type(optimizer).__name__
    if inner is None:
        return name
    return f"{name}({type(inner).__name__})"
