"""Runs the benchmark suite: one backend in this process, or all in turn.

    python tests/benchmarks/run.py --backend jax
    python tests/benchmarks/run.py --backend all
    python tests/benchmarks/run.py --backend torch --quick

(`python -m tests.benchmarks.run ...` from the repository root is the
same.) See `tests/benchmarks/cli.py` for the options.
"""

import importlib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main():
    """Makes `tests.benchmarks` importable, then runs its command line."""
    # Run as a file, this folder is sys.path[0]: its modules would shadow
    # installed modules of the same name. The suite imports them as
    # `tests.benchmarks.*` from the repository root instead, as `python -m`
    # from the root (how it starts its own subprocesses) would.
    if sys.path and Path(sys.path[0] or ".").resolve() == HERE:
        del sys.path[0]
    root = str(HERE.parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)
    cli = importlib.import_module("tests.benchmarks.cli")
    return cli.main()


if __name__ == "__main__":
    raise SystemExit(main())
