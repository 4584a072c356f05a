"""The whole suite on the backend this process runs, as one results dict.

Import this module only once `KERAS_BACKEND` is set: it imports Keras.
"""

import dataclasses
import sys
import time

import keras

from tests.benchmarks import audit
from tests.benchmarks import backend_support
from tests.benchmarks import float8_training
from tests.benchmarks import hub_peak_memory
from tests.benchmarks import hub_quality
from tests.benchmarks import layer_call
from tests.benchmarks import loss_scaling
from tests.benchmarks import low_precision
from tests.benchmarks import low_precision_speed
from tests.benchmarks import machine
from tests.benchmarks import memory
from tests.benchmarks import memory_plan_check
from tests.benchmarks import optimizer_step
from tests.benchmarks import peak_memory
from tests.benchmarks import quantized_state_memory
from tests.benchmarks import scaling_cost
from tests.benchmarks import speedup
from tests.benchmarks import step_buffers
from tests.benchmarks import threads as thread_limit
from tests.benchmarks.sizes import BENCHMARKS


def run(sizes, benchmarks=BENCHMARKS, threads=None, log=None):
    """Runs `benchmarks` on the running backend; returns the results.

    Args:
        sizes: A `sizes.Sizes`.
        benchmarks: The names of the benchmarks to run, from `BENCHMARKS`.
        threads: A limit on the backend's threads, or None for its default
            (see `threads.py`; the environment must be set already).
        log: A function taking one line of progress; defaults to stderr.

    Returns:
        A dict: the machine, the process-wide settings, each benchmark's
        results and the seconds it took.
    """
    log = log or _log_to_stderr
    name = backend_support.backend()
    thread_limit.limit_backend(threads)
    keras.utils.set_random_seed(0)
    results = {
        "backend": name,
        "sizes": dataclasses.asdict(sizes),
        "threads": threads,
        "machine": machine.describe(),
        "device": backend_support.device(),
        "settings": backend_support.thread_settings(),
        "load_average": {"before": machine.load_average()},
        "seconds": {},
    }
    runners = {
        "layer_call": lambda: layer_call.run(sizes),
        "loss_scaling": lambda: loss_scaling.run(sizes),
        "speedup": lambda: speedup.run(sizes),
        "memory": lambda: memory.run(name, sizes, threads),
        "audit": lambda: audit.run(sizes),
        "scaling_cost": lambda: scaling_cost.run(sizes),
        "low_precision": lambda: low_precision.run(sizes),
        "low_precision_speed": lambda: low_precision_speed.run(sizes),
        "float8": lambda: float8_training.run(sizes),
        "hub_quality": lambda: hub_quality.run(sizes),
        "quantized_state_memory": lambda: quantized_state_memory.run(
            name, sizes, threads
        ),
        "peak_memory": lambda: peak_memory.run(name, sizes, threads),
        "memory_plan": lambda: memory_plan_check.run(name, sizes, threads),
        "hub_peak_memory": lambda: hub_peak_memory.run(name, sizes, threads),
        "step_buffers": lambda: step_buffers.run(name, sizes),
        "optimizer_step": lambda: optimizer_step.run(sizes),
    }
    start = time.perf_counter()
    for benchmark in benchmarks:
        log(f"[{name}] {benchmark} ...")
        began = time.perf_counter()
        results[benchmark] = runners[benchmark]()
        seconds = time.perf_counter() - began
        results["seconds"][benchmark] = round(seconds, 1)
        log(f"[{name}] {benchmark} done in {seconds:.1f} s")
        keras.utils.clear_session()
    results["seconds"]["total"] = round(time.perf_counter() - start, 1)
    results["load_average"]["after"] = machine.load_average()
    return results


def _log_to_stderr(line):
    print(line, file=sys.stderr, flush=True)
