"""Benchmark 16's section of the report (no Keras import)."""

GB = 1e9


def section(results):
    """Markdown lines of benchmark 16's results."""
    setup, stream = results["setup"], results["stream"]
    lines = [
        "### 16. The optimizer step alone, against the memory's bandwidth",
        "",
        f"Adam's step over {setup['depth']} Dense layers {setup['width']} "
        "wide, no forward or backward pass (the same gradients each step), "
        "as the backend's trainer runs it; configurations interleaved, "
        f"{setup['repeats']} repetitions. Bytes moved: every weight and "
        "byte of state read and written, every gradient read. Stream "
        f"bandwidth in the same process: copy {stream['copy'] / GB:.1f} "
        f"GB/s (numpy), triad {stream['triad'] / GB:.1f} GB/s (the "
        "backend's own, fused).",
        "",
        "| configuration | bytes a parameter | step (ms) | x mixed "
        "| GB/s | of copy | of triad |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in results["rows"].items():
        seconds = row["seconds"]
        lines.append(
            f"| {name} | {row['bytes_moved'] / row['parameters']:.1f} "
            f"| {seconds['median'] * 1e3:.1f} "
            f"[{seconds['q1'] * 1e3:.1f}, {seconds['q3'] * 1e3:.1f}] "
            f"| {row['over_mixed']:.2f} | {row['bandwidth'] / GB:.1f} "
            f"| {row['of_copy']:.0%} | {row['of_triad']:.0%} |"
        )
    return lines + [""]
