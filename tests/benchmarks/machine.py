"""What the results were measured on: CPU, memory, versions, date, load.

Importing this module imports no backend and not Keras: versions are read
from the installed distributions' metadata.
"""

import datetime
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

# CPU flags that decide what float16 and bfloat16 can gain on a CPU.
CPU_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512_bf16",
    "avx512_fp16",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_fp16",
)

DISTRIBUTIONS = (
    "keras",
    "keras_dtype_policy",
    "numpy",
    "ml_dtypes",
    "tensorflow",
    "tensorflow-cpu",
    "jax",
    "jaxlib",
    "torch",
)

# Environment variables that change threading or compilation.
ENVIRONMENT = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "TF_NUM_INTEROP_THREADS",
    "TF_NUM_INTRAOP_THREADS",
    "TF_ENABLE_ONEDNN_OPTS",
    "TF_XLA_FLAGS",
    "XLA_FLAGS",
    "XLA_PYTHON_CLIENT_PREALLOCATE",
    "XLA_PYTHON_CLIENT_MEM_FRACTION",
    "JAX_PLATFORMS",
    "JAX_ENABLE_X64",
    "CUDA_VISIBLE_DEVICES",
)


def describe():
    """Returns a dict describing this machine and this Python environment."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"
        ),
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "cpu_flags": cpu_flags(),
        "memory_gib": memory_gib(),
        "versions": versions(),
        "git": git_revision(),
        "environment": {
            name: os.environ[name] for name in ENVIRONMENT if name in os.environ
        },
    }


def cpu_model():
    """Returns the CPU's model name, or the platform's guess at it."""
    for line in _read_lines("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_flags():
    """Returns `{flag: bool}` for the flags in `CPU_FLAGS`, or {} if unknown."""
    for line in _read_lines("/proc/cpuinfo"):
        if line.startswith("flags"):
            present = set(line.split(":", 1)[1].split())
            return {flag: flag in present for flag in CPU_FLAGS}
    return {}


def memory_gib():
    """Returns the machine's total memory in GiB, or None if unknown."""
    for line in _read_lines("/proc/meminfo"):
        if line.startswith("MemTotal:"):
            return round(int(line.split()[1]) / 2**20, 1)
    return None


def load_average():
    """Returns the 1-minute load average, or None where there is none."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def versions():
    """Returns `{distribution: version}` for the installed `DISTRIBUTIONS`."""
    found = {"python": platform.python_version()}
    for name in DISTRIBUTIONS:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def git_revision():
    """Returns the repository's short commit, with "+dirty" if edited."""
    try:
        commit = _git("rev-parse", "--short", "HEAD")
        dirty = _git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "")


def _git(*args):
    """Runs git in the repository; returns its stripped output."""
    return subprocess.run(
        ["git", *args],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        check=True,
        timeout=10,
    ).stdout.strip()


def _read_lines(path):
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().splitlines()
    except OSError:
        return []
