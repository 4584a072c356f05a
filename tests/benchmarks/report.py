"""Results as JSON and as a markdown report.

Importing this module imports no backend and not Keras.
"""

import json
import os
from pathlib import Path

from tests.benchmarks import hub_peak_memory_report
from tests.benchmarks import hub_quality_report
from tests.benchmarks import memory_plan_report
from tests.benchmarks import optimizer_step_report
from tests.benchmarks import peak_memory_report
from tests.benchmarks import quantized_state_report
from tests.benchmarks import step_buffers_report
from tests.benchmarks.sizes import ARMS
from tests.benchmarks.sizes import KERAS
from tests.benchmarks.sizes import PLUGIN
from tests.benchmarks.sizes import TARGETS

MIB = 2**20
# A mixed policy this many times slower than float32 in both arms is noted.
PATHOLOGICAL = 0.1


def write(results, directory, stem):
    """Writes `results` as `stem.json` and `stem.md` under `directory`.

    Args:
        results: A list of per-backend results dicts (from `suite.run`), or
            failures `{"backend": name, "error": text}`.
        directory: The output folder, created if missing.
        stem: The file name without its extension.

    Returns:
        The two paths written.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    json_path = directory / f"{stem}.json"
    markdown_path = directory / f"{stem}.md"
    _write_atomically(json_path, json.dumps(results, indent=1) + "\n")
    _write_atomically(markdown_path, render(results))
    return json_path, markdown_path


def read(path):
    """Returns the list of results stored in a JSON file from `write`."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def render(results):
    """Returns the markdown report of a list of per-backend results."""
    done = [r for r in results if "error" not in r]
    lines = ["# keras_dtype_policy benchmarks", ""]
    if done:
        lines += _machine_section(done[0])
    lines += _summary_section(results)
    for result in results:
        if "error" in result:
            lines += [f"## {result['backend']}: failed", "", "```"]
            lines += result["error"].rstrip().splitlines()
            lines += ["```", ""]
        else:
            lines += render_backend(result)
    return "\n".join(lines).rstrip() + "\n"


def render_backend(result):
    """Returns the markdown lines of one backend's results."""
    name = result["backend"]
    settings = ", ".join(
        f"{key}={value}"
        for key, value in result["settings"].items()
        if key != "backend"
    )
    load = result["load_average"]
    seconds = ", ".join(f"{k} {v} s" for k, v in result["seconds"].items())
    lines = [
        f"## {name}",
        "",
        f"- device: {result['device']}",
        f"- settings: {settings}",
        f"- thread limit: {_thread_limit(result.get('threads'))}",
        f"- load average (1 min): {load['before']} before, "
        f"{load.get('after')} after",
        f"- time taken: {seconds}",
        "",
    ]
    sections = (
        ("layer_call", _layer_call_section),
        ("loss_scaling", _loss_scaling_section),
        ("speedup", _speedup_section),
        ("memory", _memory_section),
        ("audit", audit_section),
        ("scaling_cost", _scaling_cost_section),
        ("low_precision", low_precision_section),
        ("low_precision_speed", low_precision_speed_section),
        ("float8", float8_section),
        ("hub_quality", hub_quality_report.section),
        ("quantized_state_memory", quantized_state_report.section),
        ("peak_memory", peak_memory_report.section),
        ("memory_plan", memory_plan_report.section),
        ("hub_peak_memory", hub_peak_memory_report.section),
        ("step_buffers", step_buffers_report.section),
        ("optimizer_step", optimizer_step_report.section),
    )
    for key, section in sections:
        if key in result:
            lines += section(result[key])
    return lines


def _machine_section(result):
    described = result["machine"]
    flags = described["cpu_flags"]
    present = " ".join(f for f, on in flags.items() if on) or "none"
    absent = " ".join(f for f, on in flags.items() if not on) or "none"
    versions = ", ".join(f"{k} {v}" for k, v in described["versions"].items())
    environment = (
        ", ".join(f"{k}={v}" for k, v in described["environment"].items())
        or "none set"
    )
    sizes = result["sizes"]["name"]
    return [
        f"Sizes: {sizes}. Date: {described['date']}. "
        f"Commit: {described['git']}.",
        "",
        "| machine | |",
        "|---|---|",
        f"| CPU | {described['cpu']} |",
        f"| cores | {described['cpus_usable']} usable of "
        f"{described['cpu_count']} |",
        f"| CPU flags present | {present} |",
        f"| CPU flags absent | {absent} |",
        f"| memory | {described['memory_gib']} GiB |",
        f"| platform | {described['platform']} |",
        f"| versions | {versions} |",
        f"| environment | {environment} |",
        "",
        "Times are medians with the interquartile range in brackets; ratios "
        "are ratios of medians, with the interquartile range of the ratios "
        "of the repetitions taken side by side. Verdict: ok, miss (three "
        "quarters of the paired ratios miss too) or unclear (noise).",
        "",
    ]


def _summary_section(results):
    lines = [
        "## Summary",
        "",
        "Worst case of each benchmark: the ratio and its verdict.",
        "",
        f"| backend | device | layer call, plugin/Keras "
        f"(<= {TARGETS['layer_call']}) | training with loss scaling, "
        f"plugin/Keras (<= {TARGETS['loss_scaling']}) | mixed-precision "
        f"speed-up, plugin/Keras (>= {TARGETS['speedup']}) |",
        "|---|---|---|---|---|",
    ]
    for result in results:
        if "error" in result:
            lines.append(f"| {result['backend']} | failed | | | |")
            continue
        cells = [result["backend"], result["device"], "", "", ""]
        if "layer_call" in result:
            cells[2] = _worst(result["layer_call"]["rows"], max)
        if "loss_scaling" in result:
            cells[3] = _verdict_cell(result["loss_scaling"])
        if "speedup" in result:
            rows = [
                dict(row, model=name)
                for name, model in result["speedup"].items()
                for row in model["rows"]
            ]
            cells[4] = _worst(rows, min)
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def _worst(rows, pick):
    row = pick(rows, key=lambda r: r["comparison"]["ratio"])
    where = [row.get("model"), row["policy"], row.get("input")]
    label = ", ".join(w for w in where if w)
    return f"{_verdict_cell(row)} ({label})"


def _verdict_cell(row):
    return f"{row['comparison']['ratio']:.3f} {row['verdict']}"


def _layer_call_section(results):
    setup = results["setup"]
    lines = [
        "### 1. Layer-call overhead",
        "",
        f"Eager calls of {setup['layer']} on a float32 input of shape "
        f"{tuple(setup['input_shape'])}, each synchronized; "
        f"{setup['calls_per_repeat']} calls x {setup['repeats']} "
        "repetitions per arm, interleaved.",
        "",
        "| policy | input | plugin us/call | Keras us/call | plugin/Keras "
        f"| paired IQR | target <= {setup['target']} |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        lines.append(
            f"| {row['policy']} | {row['input']} "
            f"| {_time(row[PLUGIN], 1e6)} | {_time(row[KERAS], 1e6)} "
            f"| {_comparison(row)} |"
        )
    return lines + [""]


def _loss_scaling_section(results):
    setup = results["setup"]
    classes = ", ".join(
        f"{arm}: {setup['models'][arm]['optimizer_class']}" for arm in ARMS
    )
    jit = setup["models"][PLUGIN]["jit_compile"]
    return [
        "### 2. Training with loss scaling",
        "",
        f"{setup['model']} under Keras' own {setup['policy']} policy, batch "
        f"{setup['batch_size']}; {setup['repeats']} `fit` epochs per arm, "
        f"interleaved, timing {_steps(setup['steps_per_repeat'])} steps "
        f"each; jit_compile={jit}. Optimizers: {classes}.",
        "",
        "| plugin ms/step | Keras ms/step | plugin/Keras | paired IQR "
        f"| target <= {setup['target']} |",
        "|---|---|---|---|---|",
        f"| {_time(results[PLUGIN], 1e3)} | {_time(results[KERAS], 1e3)} "
        f"| {_comparison(results)} |",
        "",
    ]


def _speedup_section(results):
    lines = ["### 3. What mixed precision buys", ""]
    for name, model in results.items():
        setup = model["setup"]
        jit = next(iter(setup["models"].values()))["jit_compile"]
        times = model["step_times"]
        lines += [
            f"{name}: {setup['model']}, batch {setup['batch_size']}; "
            f"{setup['repeats']} `fit` epochs per model, six models "
            f"interleaved; jit_compile={jit}.",
            "",
            "| policy | plugin ms/step | Keras ms/step | timed steps per "
            "epoch (plugin, Keras) |",
            "|---|---|---|---|",
        ]
        counts = setup["steps_per_repeat"]
        for policy in ("float32", *(row["policy"] for row in model["rows"])):
            plugin, keras = f"{PLUGIN}/{policy}", f"{KERAS}/{policy}"
            lines.append(
                f"| {policy} | {_time(times[plugin], 1e3)} "
                f"| {_time(times[keras], 1e3)} "
                f"| {counts[plugin]}, {counts[keras]} |"
            )
        lines += [
            "",
            "Speed-up: float32 step time over the mixed policy's, per arm.",
            "",
            "| policy | plugin speed-up | Keras speed-up | plugin/Keras "
            f"| paired IQR | target >= {setup['target']} |",
            "|---|---|---|---|---|---|",
        ]
        for row in model["rows"]:
            lines.append(
                f"| {row['policy']} | {row['speedup'][PLUGIN]:.2f}x "
                f"| {row['speedup'][KERAS]:.2f}x | {_comparison(row)} |"
            )
        lines.append("")
        slow = [
            row["policy"]
            for row in model["rows"]
            if max(row["speedup"].values()) < PATHOLOGICAL
        ]
        if slow:
            lines += [
                f"Note: {', '.join(slow)} is more than "
                f"{1 / PATHOLOGICAL:.0f} times slower than float32 in both "
                "arms: a slow kernel of the backend on this machine, not a "
                "cost of either arm.",
                "",
            ]
    return lines


def _memory_section(results):
    setup = results["setup"]
    return [
        "### 4. Memory of training steps",
        "",
        f"{setup['model']}, batch {setup['batch_size']}: one step, then "
        f"{setup['steps']} more; each configuration in "
        f"{setup['processes_per_configuration']} fresh process(es). Baseline: "
        "resident memory after building and compiling, before the first "
        "step. Steady: the peak of the steps after the first, over the "
        "baseline. MiB, medians (min-max). Device peak: the backend's own "
        "counter of GPU memory; n/a on a CPU.",
        "",
        "| policy | arm | baseline RSS | peak RSS | peak - baseline "
        "| steady peak - baseline | device peak |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {row['policy']} | {row['arm']} "
            f"| {_mib(row['baseline_rss'])} | {_mib(row['peak_rss'])} "
            f"| {_mib(row['peak_over_baseline'])} "
            f"| {_mib(row['steady_peak_over_baseline'])} "
            f"| {_mib(row['device_peak'])} |"
            for row in results["rows"]
        ),
        "",
    ]


def audit_section(results):
    """Returns the markdown lines of the benchmark's results."""
    setup = results["setup"]
    return [
        "### 5. The numerics audit",
        "",
        f"`keras_dtype_policy.audit` of an {setup['model']} "
        f"({setup['parameters']:,} parameters) on {setup['samples']} "
        "samples with labels: both copies rebuilt, every layer's inputs and "
        "outputs read, gradients of one batch. Seconds, median "
        f"(min-max) of {setup['repeats']} runs after a warm-up.",
        "",
        "| policy | seconds | verdict |",
        "|---|---|---|",
        *(
            f"| {row['policy']} | {row['seconds']['median']:.2f} "
            f"({row['seconds']['min']:.2f}-{row['seconds']['max']:.2f}) "
            f"| {'safe' if row['safe'] else 'not safe'} |"
            for row in results["rows"]
        ),
        "",
    ]


def _scaling_cost_section(results):
    lines = ["### 6. What loss scaling costs a step", ""]
    lines += _scaling_cost_table(results)
    if "xla" in results:
        lines += ["Compiled with XLA:", ""]
        lines += _scaling_cost_table(results["xla"])
    return lines


def _scaling_cost_table(results):
    setup = results["setup"]
    jit = setup["models"]["bare"]["jit_compile"]
    lines = [
        f"{setup['model']} ({setup['weight_tensors']} weight tensors) under "
        f"Keras' own {setup['policy']} policy, batch {setup['batch_size']}, "
        "Adam bare and in each loss-scale optimizer; "
        f"{setup['repeats']} `fit` epochs per arm, interleaved; "
        f"jit_compile={jit}.",
        "",
        "| arm | ms/step | over bare | paired IQR "
        f"| target <= {setup['target']} |",
        "|---|---|---|---|---|",
        f"| bare Adam | {_time(results['bare'], 1e3)} | | | |",
    ]
    labels = {
        KERAS: "Keras' wrapper",
        PLUGIN: "plugin",
        "never_skips": "plugin checking, never skipping (diagnostic)",
    }
    for arm, label in labels.items():
        if arm in results["cost"]:
            lines.append(
                f"| {label} | {_time(results[arm], 1e3)} "
                f"| {_comparison(results['cost'][arm])} |"
            )
    versus = results["plugin_over_keras"]
    lines += [
        "",
        f"plugin/Keras: {_comparison(versus)} (target <= 1.0).",
        "",
    ]
    return lines


def low_precision_speed_section(results):
    """Returns the markdown lines of the low-precision step-time
    benchmark."""
    lines = [
        "### 9. Step time of low-precision training on a real-sized model",
        "",
        f"{results['model']}: {results['parameters']:,} parameters in "
        f"{results['weight_tensors']} weight tensors; "
        f"{results['rounds']} rounds of {results['steps_per_round']} steps, "
        "the configurations taking turns (median seconds a step).",
        "",
        "| configuration | optimizer | ms a step | over mixed_bfloat16 "
        "| over bfloat16 |",
        "|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        lines.append(
            f"| {row['configuration']} | {row['optimizer']} | "
            f"{row['seconds_per_step'] * 1e3:.1f} | "
            f"{row['over_mixed_bfloat16']:.2f} | {row['over_bfloat16']:.2f} |"
        )
    targets = results["targets"]
    lines += [
        "",
        f"Targets: <= {targets['over_mixed']:.2f} of mixed_bfloat16 "
        f"(goal {targets['goal_over_mixed']:.2f}); stochastic rounding <= "
        f"{targets['over_plain']:.2f} of plain bfloat16.",
        "",
    ]
    return lines


def low_precision_section(results):
    """Returns the markdown lines of the low-precision benchmark."""
    lines = [
        "### 7. Training in bfloat16 with compensated updates",
        "",
        "Adam, the same initial weights and batches for every "
        "configuration; score on held-out data (accuracy, or loss: lower "
        "is better); bytes a parameter of weights + optimizer state counted "
        "from the variables (the optimizer's few fixed bytes, step counters "
        "and a generator's state, left out); step time over "
        "mixed_bfloat16's and plain bfloat16's "
        "(ratio of medians over the chunks of `fit` that took turns, with "
        "the interquartile range of the paired ratios).",
        "",
    ]
    if results["unavailable"]:
        lines += [
            "Not run (no `LowPrecisionOptimizer` in this version): "
            + ", ".join(results["unavailable"]),
            "",
        ]
    for name, task in results["tasks"].items():
        setup = task["setup"]
        parameters = next(iter(task["rows"].values()))["memory"]["parameters"]
        lines += [
            f"{name}: {setup['description']}, {parameters:,} parameters; "
            f"{setup['steps']} steps in "
            f"{setup['chunks']} chunks, learning rate "
            f"{setup['learning_rate']:g}, jit_compile={setup['jit_compile']}.",
            "",
        ]
        lines += low_precision_table(task)
        lines += [""]
        for check in task["targets"]:
            verdict = "ok" if check["within"] else "MISSED"
            lines.append(f"- {verdict}: {_target_text(check)}")
        if task["targets"]:
            lines.append("")
    return lines


def float8_section(results):
    """Returns the markdown lines of the float8 benchmark."""
    example = results["keras_example"]
    lines = [
        "### 8. Training under a global float8 policy",
        "",
        "Adam, the same initial weights and batches for every "
        "configuration; held-out loss (lower is better) and its ratio to "
        "mixed_bfloat16's; step time over mixed_bfloat16's (ratio of "
        "medians over the chunks of `fit` that took turns, with the "
        "interquartile range of the paired ratios). float8 is emulated on "
        "a CPU: the step time is the emulation's cost, not float8's speed. "
        f"For scale, Keras' own float8 example reports {example['float8']}% "
        f"test accuracy against {example['mixed_bfloat16']}% in "
        "mixed_bfloat16.",
        "",
    ]
    for name, task in results["tasks"].items():
        setup = task["setup"]
        lines += [
            f"{name}: {setup['description']}; {setup['steps']} steps in "
            f"{setup['chunks']} chunks, learning rate "
            f"{setup['learning_rate']:g}, jit_compile={setup['jit_compile']}.",
            "",
            "| configuration | float8 layers | test loss | loss over mixed "
            "| ms/step | time over mixed |",
            "|---|---|---|---|---|---|",
        ]
        for configuration, row in task["rows"].items():
            lines.append(
                f"| {configuration} | {row['float8_layers']} "
                f"| {row['test_loss']:.4f} | {row['loss_over_mixed']:.4f} "
                f"| {row['step_time']['median'] * 1e3:.3g} "
                f"| {_paired(row['time_over_mixed'])} |"
            )
        if not results.get("device", "cpu").startswith("gpu"):
            lines.append(
                "| float8_from_mixed_bfloat16 on a GPU with float8 units "
                "| | to fill | | | to fill |"
            )
        lines.append("")
    if not results.get("device", "cpu").startswith("gpu"):
        lines += [
            "The GPU rows are to be filled from `python "
            "tests/benchmarks/run.py --backend jax --only float8` on a GPU "
            "with float8 units (H100 or later); no such machine ran this.",
            "",
        ]
    return lines


def low_precision_table(task):
    """Returns the markdown table of one task of the benchmark."""
    metric = task["setup"]["metric"]
    score = "test accuracy" if metric == "accuracy" else "test loss"
    lines = [
        f"| configuration | {score} | bytes/param | over mixed | ms/step "
        "| time over mixed | time over bfloat16 |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in task["rows"].items():
        value = (
            f"{100 * row['score']:.1f}%"
            if metric == "accuracy"
            else f"{row['score']:.4f}"
        )
        over_mixed = row.get("memory_over_mixed")
        lines.append(
            f"| {name} | {value} "
            f"| {row['memory']['bytes_per_parameter']:.2f} "
            f"| {'' if over_mixed is None else f'{over_mixed:.3f}'} "
            f"| {row['step_time']['median'] * 1e3:.3g} "
            f"| {_paired(row.get('time_over_mixed'))} "
            f"| {_paired(row.get('time_over_plain'))} |"
        )
    return lines


def _paired(comparison):
    if comparison is None:
        return ""
    paired = comparison["paired"]
    return f"{comparison['ratio']:.3f} ({paired['q1']:.3f}-{paired['q3']:.3f})"


def _target_text(check):
    name = check["configuration"]
    if check["target"] == "quality":
        limit = "0.5" if "accuracy" in check["unit"] else "0.01"
        return (
            f"{name} within the quality target: {check['figure']:.4g} "
            f"{check['unit']} (target <= {limit})"
        )
    if check["target"] == "plain_worse":
        return (
            f"plain bfloat16 visibly worse: {check['figure']:.4g} "
            f"{check['unit']}"
        )
    what = "memory" if check["target"] == "memory" else "step time"
    versus = "mixed_bfloat16" if what == "memory" else "plain bfloat16"
    return (
        f"{name} {what} {check['figure']:.3f} of {versus} "
        f"(target <= {check['limit']})"
    )


def _thread_limit(threads):
    if threads is None:
        return "none (the backend's default)"
    return f"{threads} (--threads)"


def _steps(counts):
    return ", ".join(f"{counts[arm]} ({arm})" for arm in ARMS)


def _time(summary, scale):
    return (
        f"{summary['median'] * scale:.4g} "
        f"({summary['q1'] * scale:.4g}-{summary['q3'] * scale:.4g})"
    )


def _comparison(row):
    comparison = row["comparison"]
    paired = comparison["paired"]
    return (
        f"{comparison['ratio']:.3f} | {paired['q1']:.3f}-{paired['q3']:.3f} "
        f"| {row['verdict']}"
    )


def _mib(summary):
    if summary is None:
        return "n/a"
    median = summary["median"] / MIB
    if summary["n"] == 1:
        return f"{median:.0f}"
    return (
        f"{median:.0f} ({summary['min'] / MIB:.0f}-{summary['max'] / MIB:.0f})"
    )


def _write_atomically(path, text):
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)
