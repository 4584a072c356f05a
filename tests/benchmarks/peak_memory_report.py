"""The peak-memory section of the report (no Keras import)."""

MIB = 2**20


def section(results):
    """Markdown lines of benchmark 12's results."""
    setup = results["setup"]
    batches = setup["batches"]
    limit = results["target_over_ideal"]
    lines = [
        "### 12. The process's peak memory a parameter",
        "",
        f"{setup['model']}, depths {setup['depths']} (one fresh process "
        f"each), batch {' and '.join(str(b) for b in batches)}. Slope: "
        "the least-squares fit of the process's peak resident memory "
        "(through the first step and "
        f"{setup['steps']} more) against the parameter count, in bytes a "
        "parameter. Ideal: weights + optimizer state + a gradient a "
        "weight (none under +release: gradients released in the "
        "backward pass), from the variables. x mixed: how many times more "
        "parameters fit in the same memory than under mixed_bfloat16.",
        "",
        "| configuration | ideal | "
        + " | ".join(f"slope, batch {b}" for b in batches)
        + f" | over ideal (<= {limit}) | x mixed | peaks at batch "
        f"{batches[0]} (MiB) |",
        "|---|---|" + "---|" * len(batches) + "---|---|---|",
    ]
    for name, row in results["rows"].items():
        slopes = " | ".join(f"{row['slopes'][str(b)]:.1f}" for b in batches)
        peaks = ", ".join(
            f"{_mib(max(first, steady or 0))}"
            for _, first, steady in row["peaks"][str(batches[0])]
        )
        times = row.get("times_mixed")
        lines.append(
            f"| {name} | {row['ideal']:.2f} | {slopes} "
            f"| {row['over_ideal']:.2f} "
            f"| {'' if times is None else f'{times:.2f}'} | {peaks} |"
        )
    devices = {
        name: row["device_slope"]
        for name, row in results["rows"].items()
        if row.get("device_slope") is not None
    }
    if devices:
        lines += [
            "",
            f"Device peak ({next(iter(results['rows'].values()))['device']}),"
            f" slope at batch {batches[0]}, bytes a parameter:",
            "",
            "| configuration | ideal | device slope | over ideal |",
            "|---|---|---|---|",
        ]
        for name, device in devices.items():
            ideal = results["rows"][name]["ideal"]
            lines.append(
                f"| {name} | {ideal:.2f} | {device:.1f} "
                f"| {device / ideal:.2f} |"
            )
    return lines + [""]


def _mib(value):
    return f"{value / MIB:.0f}"
