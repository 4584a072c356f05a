"""The keras-hub quality section of the benchmark report (no Keras import)."""


def section(results):
    """Markdown lines for the report: one table of losses per task."""
    lines = ["## keras-hub quality (held-out loss, lower is better)", ""]
    if "skipped" in results:
        return [*lines, f"Skipped: {results['skipped']}.", ""]
    for task, losses in results["tasks"].items():
        reference = losses["mixed_bfloat16"]
        lines += [f"**{task}**", "", "| configuration | loss | vs mixed |"]
        lines.append("|---|---|---|")
        for configuration, loss in losses.items():
            ratio = f"{loss / reference - 1:+.1%}"
            lines.append(f"| {configuration} | {loss:.4f} | {ratio} |")
        lines.append("")
    return lines
