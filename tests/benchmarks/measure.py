"""Interleaved timing of several arms in one process.

Every repetition takes each arm's measurement once, in an order that
alternates from one repetition to the next (A B, then B A, ...), so drift of
the machine (other processes, thermal state, caches) falls on all arms
alike.

Importing this module imports no backend and not Keras.
"""

import contextlib
import gc
import time


@contextlib.contextmanager
def collector_paused():
    """Collects young garbage, then pauses the collector for the block.

    As `timeit` does: a collection triggered by one arm's garbage does not
    land in another arm's timing. Only the young generations are collected
    first (microseconds; a full collection takes 0.1 s once a backend is
    imported): the previous measurement's garbage is young.
    """
    gc.collect(1)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def timed(block, units=1):
    """Returns a measurement: the seconds per unit of one `block()` call.

    Args:
        block: A callable taking no arguments that runs `units` units of
            work (layer calls, say) and waits for the device before
            returning.
        units: How many units one call of `block` runs.

    Returns:
        A callable taking no arguments and returning a float.
    """

    def measurement():
        with collector_paused():
            start = time.perf_counter()
            block()
            return (time.perf_counter() - start) / units

    return measurement


def interleaved(measurements, repeats, warmup=1):
    """Takes several measurements side by side, alternating their order.

    Args:
        measurements: A dict `{key: measurement}` of callables taking no
            arguments and returning seconds per unit (see `timed`).
        repeats: The repetitions of each measurement, at least 1.
        warmup: Untimed calls of each measurement before the first one kept.

    Returns:
        A dict `{key: [seconds per unit, one per repetition]}`.
    """
    if repeats < 1:
        raise ValueError(f"`repeats` must be at least 1. Received: {repeats}")
    keys = list(measurements)
    for _ in range(warmup):
        for key in keys:
            measurements[key]()
    samples = {key: [] for key in keys}
    for repetition in range(repeats):
        order = keys if repetition % 2 == 0 else keys[::-1]
        for key in order:
            samples[key].append(float(measurements[key]()))
    return samples
