"""Benchmark 15's section of the report (no Keras import)."""


def section(results):
    """Markdown lines of benchmark 15's results."""
    lines = ["### 15. The buffers of Keras' compiled step (XLA, JAX)", ""]
    if "skipped" in results:
        return lines + [f"Skipped: {results['skipped']}.", ""]
    setup = results["setup"]
    lines += [
        f"Keras' `train_step` under `jax.jit` with the state donated, as "
        f"`fit` compiles it, for stacks of {setup['depths']} Dense layers "
        f"{setup['width']} wide at batch {setup['batch']}; XLA's buffer "
        "assignment (`memory_analysis()`), in bytes a parameter between "
        "the two depths. Aliased: argument bytes the outputs reuse "
        "(donated: no second copy of weights and state).",
        "",
        "| configuration | weights + state | aliased | temporaries |",
        "|---|---|---|---|",
    ]
    for name, row in results["rows"].items():
        each = row["per_parameter"]
        lines.append(
            f"| {name} | {each['arguments']:.2f} | {each['aliased']:.2f} "
            f"| {each['temporaries']:.2f} |"
        )
    return lines + [""]
