"""PNG plots of the loss scale and the loss over the training steps.

matplotlib (the `plot` extra) is imported inside the function, and only its
object-oriented API is used: no pyplot, so no global figure state and no
change of the user's matplotlib backend.
"""

import math
import pathlib


def write_training_plot(path, losses, loss_scale=None, title=None):
    """Writes a PNG of the loss scale (if any) above the loss, per step.

    Args:
        path: Where to write the PNG.
        losses: A dict `{label: (steps, values)}` of loss curves; values
            that are None or not finite leave a gap.
        loss_scale: None, or `(steps, scales, skipped)`: the scale after
            each step and whether the step was skipped. Skipped steps are
            marked with a red cross.
        title: The figure's title.

    Returns:
        The path written, as a `pathlib.Path`.

    Raises:
        ImportError: if matplotlib is not installed.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError(
            "Plotting needs matplotlib. Install it with: "
            "pip install 'keras_dtype_policy[plot]'"
        ) from None
    rows = 2 if loss_scale is not None else 1
    figure = Figure(figsize=(8, 3.2 * rows), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    if loss_scale is not None:
        _draw_loss_scale(axes[0], *loss_scale)
    _draw_losses(axes[-1], losses)
    axes[-1].set_xlabel("training step")
    if title:
        figure.suptitle(title)
    path = pathlib.Path(path)
    figure.savefig(path, format="png", dpi=110)
    return path


def _draw_loss_scale(axis, steps, scales, skipped):
    points = [
        (step, scale)
        for step, scale in zip(steps, scales, strict=True)
        if scale is not None
    ]
    if points:
        xs, ys = zip(*points, strict=True)
        axis.step(xs, ys, where="post", color="tab:blue", label="loss scale")
        axis.set_yscale("log", base=2)
    marks = [
        (step, scale)
        for step, scale, was_skipped in zip(steps, scales, skipped, strict=True)
        if was_skipped and scale is not None
    ]
    if marks:
        xs, ys = zip(*marks, strict=True)
        axis.plot(
            xs,
            ys,
            linestyle="none",
            marker="x",
            color="tab:red",
            label=f"skipped step ({len(marks)} in all)",
        )
    axis.set_ylabel("loss scale")
    axis.grid(True, alpha=0.3)
    axis.legend(loc="best")


def _draw_losses(axis, losses):
    for index, (label, (steps, values)) in enumerate(losses.items()):
        # NaN breaks the line: a NaN or Inf loss leaves a gap.
        ys = [
            value if value is not None and math.isfinite(value) else math.nan
            for value in values
        ]
        if any(math.isfinite(y) for y in ys):
            # Dashed after the first curve: equal curves stay visible.
            style = "-" if index == 0 else "--"
            axis.plot(list(steps), ys, linestyle=style, label=label)
    axis.set_ylabel("loss (running mean of the epoch)")
    axis.grid(True, alpha=0.3)
    if losses:
        axis.legend(loc="best")
