"""`LossScaleMonitor`: the loss scale in the logs, and a watch for stalls."""

import importlib.util
import os
import pathlib
import warnings

import keras

from keras_dtype_policy.loss_scaling.optimizer import LossScaleOptimizer
from keras_dtype_policy.policies.validation import check_positive_int

TRAJECTORY_KEYS = ("step", "epoch", "loss_scale", "skipped", "loss")


class LossScaleMonitor(keras.callbacks.Callback):
    """Logs the loss scale and the skipped steps; stops a stalled training.

    Each epoch's logs get `loss_scale` and `skipped_steps` (and, with this
    package's `LossScaleOptimizer`, `nonfinite_gradient_variables`; the
    paths are in `skip_report` and `summary()`). Put it before
    `keras.callbacks.TensorBoard` in `callbacks`. With Keras' own
    `LossScaleOptimizer` it logs `loss_scale` and counts a step as skipped
    when `iterations` did not advance; with any other optimizer it warns
    once and logs nothing. Per-step reading costs a state copy per step on
    JAX. See docs/telemetry.md.

    Args:
        record_steps: Whether to record, after every step, the loss scale,
            whether the step was skipped, and the loss, in `trajectory`.
        max_consecutive_skips: None (never stop), or a number of skipped
            steps in a row after which training stops.
        plot_path: None, or the path of a PNG file to write at the end of
            training: the loss scale (with the skipped steps marked) and
            the loss over the steps. Needs matplotlib (the `plot` extra)
            and implies `record_steps`.
        verbose: 1 prints why training was stopped, and the summary of the
            skipped steps at the end of `fit` if any was skipped; 0 prints
            nothing.

    Attributes:
        trajectory: A dict of lists, one entry per recorded step: `step`,
            `epoch`, `loss_scale`, `skipped` and `loss`.
        stop_reason: None, or the message that explains why this callback
            stopped training.
        skip_report: A list of dicts, one per skipped step (per-step
            reading) or per epoch with skips: `epoch`, `step`, `skipped` and
            `gradients` (variable path: skipped steps it overflowed in).

    Example:

    >>> monitor = keras_dtype_policy.LossScaleMonitor(max_consecutive_skips=50)
    >>> history = model.fit(x, y, epochs=3, callbacks=[monitor])
    >>> history.history["loss_scale"], history.history["skipped_steps"]
    ([32768.0, 32768.0, 16384.0], [0, 0, 1])
    """

    def __init__(
        self,
        record_steps: bool = False,
        max_consecutive_skips: int | None = None,
        plot_path: str | os.PathLike | None = None,
        verbose: int = 1,
    ) -> None:
        super().__init__()
        if not isinstance(record_steps, bool):
            raise TypeError(
                "`record_steps` must be True or False. "
                f"Received: record_steps={record_steps!r} "
                f"(of type {type(record_steps).__name__})"
            )
        if max_consecutive_skips is not None:
            max_consecutive_skips = check_positive_int(
                "max_consecutive_skips", max_consecutive_skips
            )
        if plot_path is not None:
            plot_path = _check_plot_path(plot_path)
        if verbose not in (0, 1) or isinstance(verbose, float):
            raise ValueError(
                f"`verbose` must be 0 or 1. Received: verbose={verbose!r}"
            )
        self.record_steps = record_steps or plot_path is not None
        self.max_consecutive_skips = max_consecutive_skips
        self.plot_path = plot_path
        self.verbose = int(verbose)
        self.trajectory: dict[str, list] = {key: [] for key in TRAJECTORY_KEYS}
        self.stop_reason = None
        self.skip_report: list = []
        self._optimizer = None
        if self.record_steps or max_consecutive_skips is not None:
            # Defined per instance, so a monitor that reads once per epoch
            # leaves Keras' own `on_train_batch_end` in place, which lets
            # Keras dispatch the other callbacks' batch work asynchronously.
            self.on_train_batch_end = self._after_steps

    def on_train_begin(self, logs: dict | None = None) -> None:
        optimizer = self.model.optimizer
        self.trajectory = {key: [] for key in TRAJECTORY_KEYS}
        self.stop_reason = None
        self.skip_report = []
        self._epoch_counts: dict = {}
        self._epoch_skipped = 0
        self._steps_done = 0
        self._epoch = 0
        self._in_a_row = 0
        self._first_step = 0
        if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            self._optimizer = None
            warnings.warn(
                "LossScaleMonitor has nothing to monitor: the model's "
                f"optimizer ({type(optimizer).__name__}) does not scale the "
                "loss. Compile the model under a float16 policy, or with a "
                "keras_dtype_policy.LossScaleOptimizer.",
                UserWarning,
                stacklevel=2,
            )
            return
        self._optimizer = optimizer
        _, self._iterations, self._skipped = _read_state(optimizer)

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch + 1
        if self._optimizer is not None and self._attributes():
            # At the start of an epoch Keras' state is in the variables.
            self._epoch_counts = self._optimizer.nonfinite_gradient_counts
            self._epoch_skipped = self._optimizer.skipped_steps

    def _attributes(self):
        # Only this package's optimizer records where a step overflowed.
        return isinstance(self._optimizer, LossScaleOptimizer)

    def on_train_batch_begin(
        self, batch: int, logs: dict | None = None
    ) -> None:
        self._first_step = batch

    def _after_steps(self, batch, logs=None):
        """Reads the state after a step (or an execution of several)."""
        steps = batch - self._first_step + 1
        self._steps_done += steps
        loss = (logs or {}).get("loss")
        loss = None if loss is None else float(loss)
        if self._optimizer is None:
            self._record(None, False, loss)
            return
        # On JAX, reading `self.model` copies the training state into the
        # model's variables, the optimizer's among them.
        scale, iterations, skipped = _read_state(self.model.optimizer)
        if skipped is None:
            skipped_now = steps - (iterations - self._iterations)
        else:
            skipped_now = skipped - self._skipped
        self._iterations, self._skipped = iterations, skipped
        if skipped_now > 0 and self._attributes():
            paths = self.model.optimizer.nonfinite_gradients
            self.skip_report.append(
                {
                    "epoch": self._epoch,
                    "step": self._steps_done,
                    "skipped": skipped_now,
                    "gradients": dict.fromkeys(paths, skipped_now),
                }
            )
        self._record(scale, skipped_now > 0, loss)
        if skipped_now >= steps:
            self._in_a_row += steps
        else:
            # Some step of the execution was applied; if several steps ran
            # at once their order is unknown, so the count starts again.
            self._in_a_row = 0
        limit = self.max_consecutive_skips
        if limit is not None and self._in_a_row >= limit:
            self._stop(scale)

    def _record(self, scale, skipped, loss):
        if not self.record_steps:
            return
        values = (self._steps_done, self._epoch, scale, skipped, loss)
        for key, value in zip(TRAJECTORY_KEYS, values, strict=True):
            self.trajectory[key].append(value)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self._optimizer is None or logs is None:
            return
        scale, _, skipped = _read_state(self.model.optimizer)
        logs["loss_scale"] = scale
        if skipped is not None:
            logs["skipped_steps"] = skipped
        if self._attributes():
            counts = self.model.optimizer.nonfinite_gradient_counts
            overflowed = {
                path: count - self._epoch_counts.get(path, 0)
                for path, count in counts.items()
                if count > self._epoch_counts.get(path, 0)
            }
            logs["nonfinite_gradient_variables"] = len(overflowed)
            skipped_in_epoch = skipped - self._epoch_skipped
            if skipped_in_epoch and not self._reads_every_step():
                self.skip_report.append(
                    {
                        "epoch": self._epoch,
                        "step": None,
                        "skipped": skipped_in_epoch,
                        "gradients": overflowed,
                    }
                )

    def _reads_every_step(self):
        return self.record_steps or self.max_consecutive_skips is not None

    def summary(self) -> str:
        """Returns the skipped steps and where they overflowed, as text.

        One line per entry of `skip_report`, for example
        `step 12 (epoch 1) skipped: non-finite gradients in dense_3/kernel,
        dense_3/bias`.
        """
        if not self.skip_report:
            return "LossScaleMonitor: no step was skipped."
        lines = [
            "LossScaleMonitor: skipped steps and their non-finite gradients"
        ]
        for entry in self.skip_report:
            gradients = entry["gradients"]
            if entry["step"] is not None:
                where = ", ".join(gradients) or "no recorded variable"
                lines.append(
                    f"  step {entry['step']} (epoch {entry['epoch']}) "
                    f"skipped: non-finite gradients in {where}"
                )
                continue
            where = ", ".join(
                f"{path} ({count})" for path, count in gradients.items()
            )
            lines.append(
                f"  epoch {entry['epoch']}: {entry['skipped']} step(s) "
                f"skipped; non-finite gradients (in how many of them) in "
                f"{where or 'no recorded variable'}"
            )
        return "\n".join(lines)

    def on_train_end(self, logs: dict | None = None) -> None:
        if self.verbose and self.skip_report:
            print(self.summary(), flush=True)
        if self.plot_path is not None:
            from keras_dtype_policy.loss_scaling import plots

            steps = self.trajectory["step"]
            loss_scale = None
            if self._optimizer is not None:
                loss_scale = (
                    steps,
                    self.trajectory["loss_scale"],
                    self.trajectory["skipped"],
                )
            plots.write_training_plot(
                self.plot_path,
                losses={"loss": (steps, self.trajectory["loss"])},
                loss_scale=loss_scale,
                title=f"{self.model.name}: loss scale and loss per step",
            )

    def _stop(self, scale):
        optimizer = self._optimizer
        floor = getattr(optimizer, "min_scale", None)
        if floor is not None and scale <= floor:
            where = (
                f"the loss scale is {scale:g}, its floor (min_scale="
                f"{floor:g}): lowering it further cannot help"
            )
        else:
            where = f"the loss scale is now {scale:g}"
        self.stop_reason = (
            f"LossScaleMonitor stopped training in epoch {self._epoch} after "
            f"{self._in_a_row} steps in a row were skipped for NaN or Inf "
            f"gradients; {where}. The model itself produces non-finite "
            "values: check the inputs and the loss for NaN or Inf, lower "
            "the learning rate, or compute the failing layers in float32 "
            '(dtype="float32").'
        )
        self.model.stop_training = True
        if self.verbose:
            print(self.stop_reason, flush=True)


def _read_state(optimizer):
    """Returns a loss-scale optimizer's scale, iterations and skipped steps.

    The skipped count is None for an optimizer that does not keep one
    (Keras' own).
    """
    iterations = int(keras.ops.convert_to_numpy(optimizer.iterations))
    if isinstance(optimizer, LossScaleOptimizer):
        return optimizer.loss_scale, iterations, optimizer.skipped_steps
    scale = getattr(optimizer, "dynamic_scale", None)
    if scale is None:  # not built yet
        return float(optimizer.initial_scale), iterations, None
    return float(keras.ops.convert_to_numpy(scale)), iterations, None


def _check_plot_path(plot_path):
    if not isinstance(plot_path, (str, os.PathLike)):
        raise TypeError(
            "`plot_path` must be a path (a string or a pathlib.Path) or "
            f"None. Received: plot_path={plot_path!r} "
            f"(of type {type(plot_path).__name__})"
        )
    path = pathlib.Path(plot_path)
    if path.suffix.lower() != ".png":
        raise ValueError(
            "`plot_path` must name a .png file. "
            f"Received: plot_path={str(plot_path)!r}"
        )
    if importlib.util.find_spec("matplotlib") is None:
        raise ImportError(
            "`plot_path` needs matplotlib. Install it with: "
            "pip install 'keras_dtype_policy[plot]'"
        )
    return path
