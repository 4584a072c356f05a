"""The command line of the suite: one backend in this process, or all.

One backend runs in this process and writes `<backend>.json` and
`<backend>.md`. `all` runs each installed backend in a process of its own,
one after the other, then writes `latest.json` and `latest.md` with every
backend. Full runs write into `tests/benchmarks/results/`, quick runs
(`--quick`, tiny sizes for smoke testing) into `results/quick/`.
"""

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from tests.benchmarks import report
from tests.benchmarks import threads
from tests.benchmarks.sizes import BENCHMARKS
from tests.benchmarks.sizes import get_sizes

BACKENDS = ("tensorflow", "jax", "torch")
RESULTS = Path(__file__).resolve().with_name("results")
# The repository root, from which `tests.benchmarks` is importable.
ROOT = Path(__file__).resolve().parents[2]


def build_parser():
    parser = argparse.ArgumentParser(
        prog="run.py",
        description="Benchmarks keras_dtype_policy against Keras' own "
        "policies and loss scaling.",
    )
    parser.add_argument(
        "--backend",
        required=True,
        choices=(*BACKENDS, "all"),
        help="A Keras backend, or 'all' for each one in its own process.",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="Tiny sizes and few repetitions: a smoke test, not a result.",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=BENCHMARKS,
        default=list(BENCHMARKS),
        help="Run only these benchmarks (default: all).",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="Limit the backend's threads to N (default: as the backend "
        "chooses). Steadier timings on a machine shared with other work.",
    )
    parser.add_argument(
        "--output",
        type=lambda text: Path(text).resolve(),
        default=None,
        help="Where results go (default: results/, or results/quick/).",
    )
    return parser


def output_directory(args):
    """Returns the folder the results of `args` go to."""
    if args.output is not None:
        return args.output
    return RESULTS / "quick" if args.quick else RESULTS


def run_one(args):
    """Runs the suite on `args.backend` in this process; returns 0."""
    os.environ["KERAS_BACKEND"] = args.backend
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    threads.limit_environment(args.threads)
    from tests.benchmarks import suite

    results = suite.run(
        get_sizes(args.quick), benchmarks=args.only, threads=args.threads
    )
    paths = report.write([results], output_directory(args), args.backend)
    for path in paths:
        print(f"wrote {path}", file=sys.stderr)
    return 0


def run_all(args):
    """Runs each backend in a process of its own; returns 0 if all ran."""
    directory = output_directory(args)
    collected = []
    status = 0
    for backend in BACKENDS:
        if importlib.util.find_spec(backend) is None:
            collected.append(
                {"backend": backend, "error": f"{backend} is not installed."}
            )
            status = 1
            continue
        command = [
            sys.executable,
            "-m",
            "tests.benchmarks.run",
            f"--backend={backend}",
            f"--output={directory}",
            "--only",
            *args.only,
        ]
        if args.quick:
            command.append("--quick")
        if args.threads is not None:
            command.append(f"--threads={args.threads}")
        completed = subprocess.run(command, cwd=ROOT, check=False)
        json_path = directory / f"{backend}.json"
        if completed.returncode == 0 and json_path.exists():
            collected += report.read(json_path)
        else:
            collected.append(
                {
                    "backend": backend,
                    "error": f"exit status {completed.returncode}; "
                    "see the output above.",
                }
            )
            status = 1
    for path in report.write(collected, directory, "latest"):
        print(f"wrote {path}", file=sys.stderr)
    return status


def main(argv=None):
    """Runs the command line; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.backend == "all":
        return run_all(args)
    return run_one(args)
