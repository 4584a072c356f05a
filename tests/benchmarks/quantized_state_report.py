"""The quantized-state memory section of the report (no Keras import)."""

MIB = 2**20


def section(results):
    """Markdown lines of benchmark 10's results."""
    setup = results["setup"]
    target = results["target"]
    lines = [
        "### 10. Memory of 8-bit and 4-bit optimizer state",
        "",
        f"{setup['model']}: {setup['parameters']:,} parameters, batch "
        f"{setup['batch_size']}; one step, then {setup['steps']} more; "
        f"{setup['processes_per_configuration']} fresh process(es) per "
        "configuration. Bytes/param: weights + optimizer state counted "
        "from the variables (itemsize x size; an 8-bit or 4-bit slot "
        "counts its int8 codes and float32 block scales). Resident memory "
        "in MiB: imported (Keras, the backend and TensorFlow loaded), "
        "built (+ the model, its optimizer state and the data), first "
        "peak (the process's high-water mark through the first step, "
        "which compiles), steady peak (the high-water mark of the later "
        "steps, reset after the first: the state, plus what a step holds "
        "for a moment: gradients, activations, float32 copies of the "
        "moments and weights), after (resident once the steps are done).",
        "",
        "| configuration | weights | state | bytes/param | over mixed "
        "| imported | built | first peak | steady peak | after "
        "| steady peak - mixed's |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in results["rows"].items():
        over = row.get("bytes_over_mixed")
        lines.append(
            f"| {name} | {'/'.join(row['weight_dtypes'])} "
            f"| {'/'.join(row['state_dtypes'])} "
            f"| {row['bytes_per_parameter']:.3f} "
            f"| {'' if over is None else f'{over:.3f}'} "
            f"| {_mib(row['imported'])} | {_mib(row['built'])} "
            f"| {_mib(row['first_peak'])} | {_mib(row['steady_peak'])} "
            f"| {_mib(row['after'])} "
            f"| {_mib(row.get('steady_peak_minus_mixed'), signed=True)} |"
        )
    verdict = "ok" if target["within"] else "MISSED"
    figure = target["figure"]
    lines += [
        "",
        f"- {verdict}: {target['configuration']} "
        + ("n/a" if figure is None else f"{figure:.3f}")
        + f" bytes a parameter (target <= {target['bytes']})",
        "",
    ]
    return lines


def _mib(value, signed=False):
    if value is None:
        return "n/a"
    return f"{value / MIB:+.0f}" if signed else f"{value / MIB:.0f}"
