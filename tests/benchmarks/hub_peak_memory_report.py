"""The keras-hub peak-memory section of the report (no Keras import)."""

MIB = 2**20


def section(results):
    """Markdown lines of benchmark 14's results."""
    lines = ["### 14. A keras-hub model's peak memory and loss", ""]
    if "skipped" in results:
        return lines + [f"Skipped: {results['skipped']}.", ""]
    setup = results["setup"]
    rows = results["rows"]
    reference = rows.get("mixed_bfloat16")
    lines += [
        f"{setup['model']}, {setup['layers']} transformer layers (one "
        f"fresh process each), batch {setup['batch']}, {setup['steps']} "
        "steps. Slope: the process's peak resident memory against the "
        "parameter count, in bytes a parameter; the peak and the losses "
        "are the largest model's (losses: the mean of the first and of "
        "the last four steps).",
        "",
        "| configuration | parameters | slope | x mixed | peak over "
        "imported (MiB) | first loss | last loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        times = reference["slope"] / row["slope"] if reference else None
        times_text = "" if times is None else f"{times:.2f}"
        lines.append(
            f"| {name} | {row['parameters'][-1] / 1e6:.1f}M "
            f"| {row['slope']:.1f} | {times_text} "
            f"| {row['peak_over_imported'] / MIB:.0f} "
            f"| {row['first_loss']:.3f} | {row['last_loss']:.3f} |"
        )
    return lines + [""]
