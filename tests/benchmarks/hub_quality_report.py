"""The keras-hub quality section of the benchmark report (no Keras import).

Per task and configuration: the mean and standard deviation of the
held-out loss over the seeds, and the mean of its paired difference
(same seed) to mixed_bfloat16 with that mean's standard error. A
configuration matches mixed_bfloat16 where the difference is within 1%
of mixed's mean loss; it is not resolved from mixed where the difference
is under two standard errors. Both are stated, not merged.
"""

import math
import statistics

REFERENCE = "mixed_bfloat16"
TOLERANCE = 0.01


def section(results):
    """Markdown lines for the report: one table of losses per task."""
    lines = ["## keras-hub quality (held-out loss, lower is better)", ""]
    if "skipped" in results:
        return [*lines, f"Skipped: {results['skipped']}.", ""]
    seeds = results.get("seeds", [0])
    steps = results.get("steps", {})
    lines += [
        f"{len(seeds)} seed(s) {seeds}; every configuration starts from "
        "each seed's initial weights and trains on its batches. Diff: the "
        f"mean paired difference to {REFERENCE} ± its standard error. "
        f"Within 1%: |diff| <= 1% of {REFERENCE}'s mean loss. Resolved: "
        "|diff| >= 2 standard errors, a difference these seeds can tell "
        "from seed noise. Ok: within 1%, or not resolved (then these seeds "
        "cannot show a gap either way).",
        "",
    ]
    for task, losses in results["tasks"].items():
        reference = _as_list(losses[REFERENCE])
        count = steps.get(task, "?") if isinstance(steps, dict) else steps
        lines += [
            f"**{task}** ({count} steps of batch {results.get('batch', '?')})",
            "",
            "| configuration | loss (mean ± sd) | diff vs mixed ± s.e. "
            "| diff / mixed | within 1% | resolved | ok |",
            "|---|---|---|---|---|---|---|",
        ]
        for configuration, values in losses.items():
            lines.append(_row(configuration, _as_list(values), reference))
        lines.append("")
    return lines


def _row(configuration, values, reference):
    mean, spread = _mean_sd(values)
    base = statistics.fmean(reference)
    cells = [configuration, f"{mean:.4f} ± {spread}"]
    if configuration == REFERENCE:
        return "| " + " | ".join([*cells, "", "", "", "", ""]) + " |"
    diffs = [a - b for a, b in zip(values, reference, strict=True)]
    diff = statistics.fmean(diffs)
    error = (
        statistics.stdev(diffs) / math.sqrt(len(diffs))
        if len(diffs) > 1
        else None
    )
    within = abs(diff) <= TOLERANCE * base
    resolved = None if error is None else abs(diff) >= 2 * error
    cells += [
        f"{diff:+.4f} ± " + ("n/a" if error is None else f"{error:.4f}"),
        f"{diff / base:+.1%}",
        _yes(within),
        "n/a" if resolved is None else _yes(resolved),
        _yes(within or resolved is False),
    ]
    return "| " + " | ".join(cells) + " |"


def _mean_sd(values):
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, "n/a"
    return mean, f"{statistics.stdev(values):.4f}"


def _as_list(values):
    # Results of the one-seed version hold a single float per cell.
    return list(values) if isinstance(values, (list, tuple)) else [values]


def _yes(flag):
    return "yes" if flag else "no"
