"""Checks of the suite's own machinery, without pytest and without timings.

    python -m tests.benchmarks.selfcheck
    python -m tests.benchmarks.selfcheck --smoke jax

The first checks the statistics, the interleaving, the memory readings and
the report against known answers (no backend needed, a second). `--smoke
BACKEND` also runs the quick suite on that backend into a temporary folder
and checks that its JSON and markdown hold every benchmark. Nothing here
asserts how fast anything is.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from tests.benchmarks import measure
from tests.benchmarks import process_memory
from tests.benchmarks import report
from tests.benchmarks import stats
from tests.benchmarks import step_profile_report
from tests.benchmarks.sizes import BENCHMARKS

ROOT = Path(__file__).resolve().parents[2]


def check_quartiles():
    rng = np.random.default_rng(0)
    for size in (1, 2, 5, 7, 16):
        samples = list(rng.standard_normal(size))
        expected = np.percentile(samples, [25, 50, 75])
        got = stats.quartiles(samples)
        _expect(np.allclose(got, expected), f"quartiles of {size} samples")


def check_compare_and_verdict():
    comparison = stats.compare([1.1, 1.2, 1.0], [1.0, 1.0, 1.0])
    _expect(abs(comparison["ratio"] - 1.1) < 1e-12, "ratio of medians")
    _expect(comparison["paired"]["n"] == 3, "paired ratios")
    _expect(stats.verdict(comparison, 1.2, at_most=True) == "ok", "ok")
    _expect(stats.verdict(comparison, 1.05, at_most=True) == "unclear", "?")
    _expect(stats.verdict(comparison, 0.9, at_most=True) == "miss", "miss")
    _expect(stats.verdict(comparison, 1.0, at_most=False) == "ok", "ok >=")
    _expect(stats.verdict(comparison, 1.3, at_most=False) == "miss", "miss >=")
    try:
        stats.compare([1.0], [1.0, 2.0])
    except ValueError:
        pass
    else:
        raise AssertionError("compare accepted unpaired samples")


def check_interleaving():
    order = []

    def measurement(key):
        def take():
            order.append(key)
            return 1.0

        return take

    samples = measure.interleaved(
        {"a": measurement("a"), "b": measurement("b")}, repeats=3, warmup=1
    )
    _expect(order == ["a", "b", "a", "b", "b", "a", "a", "b"], "ABBA order")
    _expect(samples == {"a": [1.0] * 3, "b": [1.0] * 3}, "samples per key")


def check_process_memory():
    before = process_memory.peak_rss()
    block = np.ones(64 * 2**20 // 8)  # 64 MiB, touched
    after = process_memory.peak_rss()
    _expect(after >= before, "the peak never falls without a reset")
    del block
    if process_memory.reset_peak_rss():
        _expect(
            process_memory.peak_rss() < after, "a reset brings the peak down"
        )


def check_report_of_failure():
    text = report.render([{"backend": "jax", "error": "boom"}])
    _expect("## jax: failed" in text and "boom" in text, "failure rendered")


def check_step_profile_kinds():
    events = [
        ("select_convert_fusion.17", 3_000_000_000),
        ("select_convert_fusion.4", 1_000_000_000),
        ("dot_general", 2_000_000_000),
        ("$python frame", 9_000_000_000),
        ("ThunkExecutor::Execute", 9_000_000_000),
        ("DevicePut", 9_000_000_000),
    ]
    rows = step_profile_report.kernel_times(events, steps=2)
    _expect(
        [(r["kind"], r["ms_per_step"], r["kernels_per_step"]) for r in rows]
        == [("select_convert_fusion", 2.0, 1.0), ("dot_general", 1.0, 0.5)],
        f"step_profile_report kernel times: {rows}",
    )


def smoke(backend):
    """Runs the quick suite on `backend`; checks what it writes."""
    with tempfile.TemporaryDirectory() as directory:
        command = [
            sys.executable,
            "-m",
            "tests.benchmarks.run",
            f"--backend={backend}",
            "--quick",
            f"--output={directory}",
        ]
        subprocess.run(command, cwd=ROOT, check=True)
        results = json.loads(Path(directory, f"{backend}.json").read_text())
        markdown = Path(directory, f"{backend}.md").read_text()
    (result,) = results
    for benchmark in BENCHMARKS:
        _expect(benchmark in result, f"{benchmark} in the JSON")
    for title in (
        "Layer-call",
        "loss scaling",
        "mixed precision",
        "Memory",
        "numerics audit",
        "compensated updates",
        "global float8 policy",
    ):
        _expect(title in markdown, f"{title!r} in the markdown")
    low = result["low_precision"]["tasks"]
    _expect(
        set(low) == {"digits", "char_lm", "regression"},
        "three low-precision tasks",
    )
    for task in low.values():
        rows = task["rows"]
        mixed = rows["mixed_bfloat16"]["memory"]["bytes_per_parameter"]
        _expect(mixed == 12, "Adam under mixed_bfloat16: 12 bytes a parameter")
        for name, expected in (
            ("bfloat16_kahan", 8),
            ("bfloat16_stochastic", 6),
        ):
            if name in rows:
                got = rows[name]["memory"]["bytes_per_parameter"]
                _expect(
                    got == expected, f"{name}: {expected} bytes a parameter"
                )
    eight = result["float8"]["tasks"]
    _expect(set(eight) == {"char_lm", "regression"}, "two float8 tasks")
    for task in eight.values():
        rows = task["rows"]
        _expect(rows["float32"]["float8_layers"] == 0, "float32: no float8")
        _expect(
            rows["float8_from_mixed_bfloat16"]["float8_layers"] > 0,
            "float8 layers under the float8 policy",
        )
    for key in ("cpu", "cpu_flags", "versions", "date"):
        _expect(key in result["machine"], f"machine {key}")
    _expect(result["settings"]["backend"] == backend, "settings recorded")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--smoke",
        choices=("tensorflow", "jax", "torch"),
        help="Also run the quick suite on this backend.",
    )
    args = parser.parse_args(argv)
    checks = (
        check_quartiles,
        check_compare_and_verdict,
        check_interleaving,
        check_process_memory,
        check_report_of_failure,
        check_step_profile_kinds,
    )
    for check in checks:
        check()
        print(f"ok  {check.__name__}")
    if args.smoke:
        smoke(args.smoke)
        print(f"ok  smoke run on {args.smoke}")
    return 0


def _expect(condition, what):
    if not condition:
        raise AssertionError(f"selfcheck failed: {what}")


if __name__ == "__main__":
    raise SystemExit(main())
