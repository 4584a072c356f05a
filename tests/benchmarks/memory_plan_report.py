"""The memory-plan section of the report (no Keras import)."""

MIB = 2**20


def section(results):
    """Markdown lines of benchmark 13's results."""
    target = results["target"]
    lines = [
        "### 13. The memory plan against measured peaks",
        "",
        "`kdp.plan`'s predicted peak beside the process's measured peak "
        "resident memory (through the first training step and "
        f"{results['setup']['steps']} more), one fresh process each, on "
        "models the plan was not calibrated on. Target: predicted over "
        f"measured within {1 - target:.2f} to {1 + target:.2f}.",
        "",
        "| model | parameters | batch | configuration | predicted (MiB) "
        "| measured (MiB) | predicted / measured |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        model = f"{row['model']} {row['width']} wide, {row['depth']} deep"
        lines.append(
            f"| {model} | {row['parameters'] / 1e6:.1f}M | {row['batch']} "
            f"| {row['configuration']} | {row['predicted'] / MIB:.0f} "
            f"| {row['measured'] / MIB:.0f} | {row['ratio']:.3f}"
            f"{'' if row['within'] else ' (outside)'} |"
        )
    return lines + [""]
