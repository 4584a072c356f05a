"""Step times and accelerator peak memory of a training run, for the demo.

Backend libraries are imported inside the functions.
"""

import statistics
import time

import keras

from keras_dtype_policy import backend_dispatch


class StepTimer(keras.callbacks.Callback):
    """Times every training step and records the loss after it.

    Keras turns a step's logs into Python numbers before the callbacks see
    them, which waits for the step to finish, so the time from
    `on_train_batch_begin` to `on_train_batch_end` covers the whole step,
    also on JAX, which dispatches work asynchronously.

    Attributes:
        durations: Seconds per step (or per execution of several steps).
        losses: The loss logged after each step (Keras' running mean over
            the epoch).
    """

    def __init__(self):
        super().__init__()
        self.durations = []
        self.losses = []
        self._start = None

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        loss = (logs or {}).get("loss")
        self.losses.append(None if loss is None else float(loss))
        self.durations.append(time.perf_counter() - self._start)

    def median_step_time(self, warmup=2):
        """Returns the median seconds per step, after `warmup` steps.

        The first steps compile the training function; they are left out
        when there are enough steps to spare. Returns None without steps.
        """
        durations = self.durations
        if len(durations) > 2 * warmup:
            durations = durations[warmup:]
        return statistics.median(durations) if durations else None


class PeakMemory:
    """A context manager that measures an accelerator's peak memory.

    It reads the backend's own counters (`torch.cuda`, TensorFlow's
    `get_memory_info`, JAX's `memory_stats`). A CPU has no such counters,
    and a process's resident memory mixes in compilation and allocator
    caches, so on a CPU nothing is measured.

    Attributes:
        where: The device measured, such as `"cuda:0"`, or `"cpu"`.
        peak_bytes: The peak above the memory in use when the block began,
            or None where it cannot be measured.
    """

    def __init__(self):
        self.where = "cpu"
        self.peak_bytes = None
        self._probe = None

    def __enter__(self):
        self._probe = _device_probe()
        if self._probe is not None:
            self.where = self._probe.where
            self._probe.start()
        return self

    def __exit__(self, *exc_info):
        if self._probe is not None:
            self.peak_bytes = self._probe.stop()
        return False


class _TorchProbe:
    def __init__(self, torch):
        self._torch = torch
        self.where = f"cuda:{torch.cuda.current_device()}"

    def start(self):
        self._torch.cuda.synchronize()
        self._torch.cuda.reset_peak_memory_stats()
        self._baseline = self._torch.cuda.memory_allocated()

    def stop(self):
        self._torch.cuda.synchronize()
        return self._torch.cuda.max_memory_allocated() - self._baseline


class _TensorFlowProbe:
    where = "GPU:0"

    def __init__(self, tf):
        self._tf = tf

    def start(self):
        self._tf.config.experimental.reset_memory_stats(self.where)
        info = self._tf.config.experimental.get_memory_info(self.where)
        self._baseline = info["current"]

    def stop(self):
        info = self._tf.config.experimental.get_memory_info(self.where)
        return info["peak"] - self._baseline


class _JaxProbe:
    """JAX cannot reset its peak: a block that stays below an earlier peak
    has an unknown peak (None)."""

    def __init__(self, device):
        self._device = device
        self.where = f"{device.platform}:{device.id}"

    def start(self):
        stats = self._device.memory_stats()
        self._baseline = stats["bytes_in_use"]
        self._earlier_peak = stats.get("peak_bytes_in_use", 0)

    def stop(self):
        peak = self._device.memory_stats().get("peak_bytes_in_use")
        if peak is None or peak <= self._earlier_peak:
            return None
        return peak - self._baseline


def _device_probe():
    """Returns a probe of the backend's accelerator, or None on a CPU."""
    backend = backend_dispatch.name()
    try:
        if backend == "torch":
            import torch

            return _TorchProbe(torch) if torch.cuda.is_available() else None
        if backend == "tensorflow":
            import tensorflow as tf

            gpus = tf.config.list_physical_devices("GPU")
            return _TensorFlowProbe(tf) if gpus else None
        if backend == "jax":
            import jax

            device = jax.devices()[0]
            if device.platform != "cpu" and device.memory_stats():
                return _JaxProbe(device)
    except (RuntimeError, ValueError, AttributeError, KeyError):
        return None
    return None
