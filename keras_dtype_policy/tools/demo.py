"""The demo: a small convnet on real handwritten digits, under a policy.

The data is scikit-learn's copy of the UCI handwritten digits (1797 images
of 8x8 pixels, 10 classes), which ships inside scikit-learn: nothing is
downloaded. The demo trains the same convnet, from the same initial
weights, under the chosen policy and then under float32, and reports each
layer's dtypes, the loss-scale trajectory, and both runs side by side.
"""

import dataclasses

import keras
import numpy as np

from keras_dtype_policy import backend_dispatch
from keras_dtype_policy.loss_scaling import plots
from keras_dtype_policy.loss_scaling.callbacks import LossScaleMonitor
from keras_dtype_policy.policies.global_policy import policy_scope
from keras_dtype_policy.policies.introspection import public_class_name
from keras_dtype_policy.tools import measurement
from keras_dtype_policy.tools.model_report import dtype_bytes
from keras_dtype_policy.tools.model_report import layer_rows
from keras_dtype_policy.tools.tables import format_bytes
from keras_dtype_policy.tools.tables import format_table
from keras_dtype_policy.tools.tables import wrap

BATCH_SIZE = 32
TEST_FRACTION = 0.2
# At most this many loss-scale events are listed; the rest are counted.
MAX_EVENTS = 12


@dataclasses.dataclass
class Digits:
    """The digits, split once: float32 images `(n, 8, 8, 1)` in [0, 1]."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


@dataclasses.dataclass
class Run:
    """One training run of the demo and what was measured."""

    policy: str
    model: keras.Model
    history: keras.callbacks.History
    timer: measurement.StepTimer
    memory: measurement.PeakMemory
    monitor: LossScaleMonitor
    accuracy: float


def load_digits(max_samples=None, seed=0):
    """Returns scikit-learn's digits, shuffled and split into train and test.

    The training set is cut to whole batches of `BATCH_SIZE`, so that
    every step has the same shape (one compilation, comparable times).

    Args:
        max_samples: If given, train on at most this many images (the test
            set stays whole).
        seed: The seed of the shuffle.

    Raises:
        ImportError: if scikit-learn is not installed.
    """
    from sklearn import datasets

    digits = datasets.load_digits()
    x = (digits.images / 16.0).astype("float32")[..., np.newaxis]
    y = digits.target.astype("int32")
    order = np.random.default_rng(seed).permutation(len(x))
    test_count = int(len(x) * TEST_FRACTION)
    test, train = order[:test_count], order[test_count:]
    if max_samples is not None:
        train = train[:max_samples]
    if len(train) >= BATCH_SIZE:
        train = train[: len(train) // BATCH_SIZE * BATCH_SIZE]
    return Digits(x[train], y[train], x[test], y[test])


def build_model():
    """Returns the demo convnet; its softmax computes in float32."""
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(
                32, 3, padding="same", activation="relu", name="conv_1"
            ),
            keras.layers.Conv2D(
                64, 3, padding="same", activation="relu", name="conv_2"
            ),
            keras.layers.MaxPooling2D(2, name="pool"),
            keras.layers.Flatten(name="flatten"),
            keras.layers.Dense(128, activation="relu", name="dense"),
            keras.layers.Dense(10, name="logits"),
            # Softmax in float32 for numeric stability.
            keras.layers.Activation("softmax", dtype="float32", name="probs"),
        ],
        name="digits_convnet",
    )


def train(policy, data, epochs, verbose=1):
    """Trains the demo convnet under `policy`; returns a `Run`."""
    keras.utils.set_random_seed(0)
    with policy_scope(policy):
        model = build_model()
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    timer = measurement.StepTimer()
    callbacks = [timer]
    monitor = None
    if isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer):
        monitor = LossScaleMonitor(record_steps=True)
        callbacks.insert(0, monitor)
    with measurement.PeakMemory() as memory:
        history = model.fit(
            data.x_train,
            data.y_train,
            batch_size=BATCH_SIZE,
            epochs=epochs,
            callbacks=callbacks,
            verbose=verbose,
        )
    _, accuracy = model.evaluate(
        data.x_test, data.y_test, batch_size=256, verbose=0
    )
    return Run(policy, model, history, timer, memory, monitor, accuracy)


def run_demo(
    policy="mixed_bfloat16",
    epochs=5,
    max_samples=None,
    plot_path=None,
    verbose=1,
    print_fn=print,
    advice=None,
):
    """Trains under `policy`, then under float32, and reports both.

    Args:
        policy: The policy to demonstrate.
        epochs: Epochs per run.
        max_samples: Train on at most this many images, for a quick run.
        plot_path: If given, where to write a PNG of the loss scale and the
            losses per step (needs matplotlib).
        verbose: Keras' verbosity for `fit`: 1 shows its progress bar, 2
            one plain line per epoch.
        print_fn: Where the report's lines go.
        advice: Optional, the `advice.DemoChoice` of this machine: the
            report then states the policy `doctor` recommends here.

    Returns:
        The `Run`s: the chosen policy's, then float32's (just one if the
        policy is float32).
    """
    data = load_digits(max_samples)
    _print_introduction(data, policy, advice, print_fn)
    policies = [policy] if policy == "float32" else [policy, "float32"]
    runs = []
    for index, name in enumerate(policies, start=1):
        print_fn("")
        print_fn(
            f"[{index}/{len(policies)}] policy {name}"
            f"{_run_role(index, name, advice)}"
        )
        runs.append(train(name, data, epochs, verbose))
    print_fn("")
    for line in report_lines(runs[0], runs[-1]):
        print_fn(line)
    if advice is not None:
        _print_recommendation(advice, print_fn)
    if plot_path is not None:
        write_plot(plot_path, runs)
        print_fn("")
        print_fn(f"plot written to {plot_path}")
    return runs


def _print_introduction(data, policy, advice, print_fn):
    """Prints what the demo trains, on which backend, and why `policy`."""
    print_fn("Training a small convnet on scikit-learn's handwritten digits")
    print_fn(
        f"({len(data.x_train)} training and {len(data.x_test)} test images, "
        "8x8 pixels, 10 classes)"
    )
    print_fn(f"backend: {backend_dispatch.name()}")
    for line in advice_lines(policy, advice):
        print_fn(line)


def _run_role(index, name, advice):
    """What the `index`-th run (from 1) is there for, as a suffix."""
    role = " (for comparison)" if index > 1 else ""
    if advice is not None and name == advice.recommended:
        role = (
            " (recommended here)"
            if index == 1
            else (" (for comparison; recommended here)")
        )
    return role


def _print_recommendation(advice, print_fn):
    """Prints the policy `doctor` recommends on this machine, and why."""
    print_fn("")
    for line in wrap(
        f"Recommended on this machine (as 'keras-dtype-policy doctor' "
        f"says): {advice.recommended}: {advice.reason}."
    ):
        print_fn(line)
    if advice.low_precision:
        for line in wrap(f"Memory-bound training: {advice.low_precision}."):
            print_fn(line)


def advice_lines(policy, advice):
    """Returns the lines that say how `policy` relates to doctor's advice."""
    if advice is None:
        return []
    if policy == advice.recommended:
        return wrap(
            f"policy: {policy}, the policy 'keras-dtype-policy doctor' "
            "recommends on this machine"
        )
    return wrap(
        f"policy: {policy}, shown next to float32; on this machine "
        f"'keras-dtype-policy doctor' recommends {advice.recommended}: "
        f"{advice.reason}"
    )


def report_lines(chosen, baseline):
    """Returns the report: layers, loss scale, and the comparison."""
    lines = [f"Layers of {chosen.model.name} under {chosen.policy}"]
    rows = [
        (
            row["path"],
            row["class"],
            row["policy"],
            row["compute_dtype"],
            row["variable_dtype"],
            row["params"],
        )
        for row in layer_rows(chosen.model)
        if row["class"] != "InputLayer"
    ]
    lines += format_table(
        ("layer", "class", "policy", "compute", "variables", "params"), rows
    )
    lines.append("")
    lines += loss_scale_lines(chosen)
    lines.append("")
    lines += comparison_lines(chosen, baseline)
    return lines


def loss_scale_lines(run):
    """Returns the lines that tell the loss-scale trajectory of a run."""
    optimizer = run.model.optimizer
    if run.monitor is None:
        compute = run.model.get_layer("dense").compute_dtype
        if compute == "bfloat16":
            return wrap(
                "Loss scale: none. bfloat16 has float32's range of "
                "exponents: small gradients do not flush to zero, and no "
                "loss scaling is needed."
            )
        return [
            f"Loss scale: none: under {run.policy} no layer computes in "
            "float16."
        ]
    trajectory = run.monitor.trajectory
    scales = trajectory["loss_scale"]
    kind = "dynamic" if getattr(optimizer, "dynamic", True) else "fixed"
    lines = [
        f"Loss scale ({kind}, {public_class_name(optimizer)}), "
        f"{len(scales)} steps:"
    ]
    lines += wrap(
        f"starts at {optimizer.initial_scale:g}, ends at {scales[-1]:g} "
        f"(lowest {min(scales):g}, highest {max(scales):g}); "
        f"{sum(trajectory['skipped'])} steps skipped for NaN or Inf "
        "gradients.",
        indent="  ",
    )
    events = _scale_events(trajectory, optimizer.initial_scale)
    if not events:
        growth = getattr(optimizer, "dynamic_growth_steps", None)
        if kind == "dynamic" and growth:
            lines += wrap(
                f"The scale never changed: it grows after {growth} finite "
                "steps in a row and shrinks only after a skipped step.",
                indent="  ",
            )
        return lines
    rows = [
        (step, epoch, event, f"{scale:g}")
        for step, epoch, event, scale in events
    ]
    shown = rows[:MAX_EVENTS]
    lines += format_table(
        ("step", "epoch", "event", "scale after"),
        shown,
        indent="  ",
        align="rrlr",
    )
    if len(rows) > len(shown):
        lines.append(f"  ... and {len(rows) - len(shown)} more events")
    return lines


def comparison_lines(chosen, baseline):
    """Returns float32 and the chosen policy side by side."""
    runs = [baseline, chosen] if baseline is not chosen else [chosen]
    title = (
        f"float32 against {chosen.policy}"
        if len(runs) == 2
        else "float32 (nothing to compare with)"
    )
    memory_where = chosen.memory.where
    step_times = [run.timer.median_step_time() for run in runs]
    activations = [activation_bytes(run.model, BATCH_SIZE) for run in runs]
    peaks = [run.memory.peak_bytes for run in runs]
    rows = [
        ("step time (median)", *(_milliseconds(t) for t in step_times)),
        (
            f"activations per batch of {BATCH_SIZE}",
            *(format_bytes(a) for a in activations),
        ),
        (f"peak memory ({memory_where})", *(format_bytes(p) for p in peaks)),
        ("test accuracy", *(f"{run.accuracy:.1%}" for run in runs)),
    ]
    if len(runs) == 2:
        ratios = (
            _ratio(step_times[1], step_times[0]),
            _ratio(activations[1], activations[0]),
            _ratio(peaks[1], peaks[0]),
            "",
        )
        rows = [(*row, ratio) for row, ratio in zip(rows, ratios, strict=True)]
    header = ("", *(run.policy for run in runs))
    if len(runs) == 2:
        header += (f"{chosen.policy} / float32",)
    lines = [title]
    lines += format_table(header, rows, align="l" + "r" * (len(header) - 1))
    lines.append("")
    lines += wrap(
        "activations: the layers' outputs for one batch, in their compute "
        "dtype, as kept for the backward pass (computed, not measured)."
    )
    if chosen.memory.peak_bytes is None:
        lines += wrap(
            "peak memory: measured with the accelerator's own counters; a "
            "CPU has none, and the process's memory mixes in compilation "
            "and allocator caches, so it is not shown."
        )
    else:
        lines += wrap(
            "peak memory: the accelerator's peak above what was in use "
            "when training began."
        )
    return lines


def activation_bytes(model, batch_size):
    """Returns the bytes of all layer outputs for a batch of `batch_size`.

    Computed from the outputs' shapes and dtypes (the compute dtype of each
    layer), not measured.
    """
    total = 0
    for layer in model.layers:
        for output in keras.tree.flatten(layer.output):
            elements = int(np.prod(output.shape[1:], dtype=np.int64))
            total += batch_size * elements * dtype_bytes(output.dtype)
    return total


def write_plot(path, runs):
    """Writes the PNG of the chosen run's loss scale and both runs' loss."""
    chosen = runs[0]
    losses = {}
    for run in runs:
        steps = list(range(1, len(run.timer.losses) + 1))
        losses[run.policy] = (steps, run.timer.losses)
    loss_scale = None
    if chosen.monitor is not None:
        trajectory = chosen.monitor.trajectory
        loss_scale = (
            trajectory["step"],
            trajectory["loss_scale"],
            trajectory["skipped"],
        )
    return plots.write_training_plot(
        path,
        losses=losses,
        loss_scale=loss_scale,
        title=f"digits convnet on {backend_dispatch.name()}: "
        f"{chosen.policy} against float32",
    )


def _scale_events(trajectory, initial_scale):
    """Returns `(step, epoch, event, scale)` for each skip or change."""
    events = []
    previous = initial_scale
    for step, epoch, scale, skipped in zip(
        trajectory["step"],
        trajectory["epoch"],
        trajectory["loss_scale"],
        trajectory["skipped"],
        strict=True,
    ):
        if skipped:
            event = "skipped (NaN or Inf)"
        elif scale > previous:
            event = "grew"
        elif scale < previous:
            event = "shrank"
        else:
            previous = scale
            continue
        events.append((step, epoch, event, scale))
        previous = scale
    return events


def _milliseconds(seconds):
    return "n/a" if seconds is None else f"{seconds * 1000:.2f} ms"


def _ratio(value, reference):
    if value is None or not reference:
        return "n/a"
    return f"{value / reference:.2f}x"
