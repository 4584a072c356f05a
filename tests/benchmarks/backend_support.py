"""The few things the suite asks the running backend's own library.

Import this module only once `KERAS_BACKEND` is set: it imports Keras. The
backend library itself (TensorFlow, JAX or PyTorch) is imported inside the
functions, and only the running backend's.
"""

import keras


def backend():
    """Returns the name of the running Keras backend."""
    return keras.backend.backend()


def sync(x):
    """Waits until the device has computed `x`; returns `x`.

    JAX dispatches asynchronously (`block_until_ready` waits). TensorFlow
    eager (`.numpy()` waits; on a CPU it shares memory, no copy). PyTorch on
    a CPU computes before returning; on a GPU `torch.cuda.synchronize`.

    Args:
        x: A backend tensor (or a Keras variable).

    Returns:
        `x`.
    """
    value = getattr(x, "value", x)
    name = backend()
    if name == "jax":
        import jax

        jax.block_until_ready(value)
    elif name == "tensorflow":
        value.numpy()
    elif name == "torch":
        import torch

        if value.is_cuda:
            torch.cuda.synchronize()
    else:
        keras.ops.convert_to_numpy(value)
    return x


def gpu_name():
    """Returns the name of the GPU Keras computes on, or None on a CPU."""
    name = backend()
    if name == "jax":
        import jax

        device = jax.devices()[0]
        return None if device.platform == "cpu" else device.device_kind
    if name == "tensorflow":
        import tensorflow as tf

        gpus = tf.config.list_physical_devices("GPU")
        if not gpus:
            return None
        details = tf.config.experimental.get_device_details(gpus[0])
        return details.get("device_name", gpus[0].name)
    if name == "torch":
        import torch

        if not torch.cuda.is_available():
            return None
        return torch.cuda.get_device_name(0)
    return None


def device():
    """Returns a short description of the device Keras computes on."""
    gpu = gpu_name()
    return f"gpu: {gpu}" if gpu else "cpu"


def thread_settings():
    """Returns the process-wide settings that change the timings, as a dict.

    Thread pools of the backend library, and its compilation default.
    """
    name = backend()
    settings = {"backend": name, "floatx": keras.config.floatx()}
    if name == "tensorflow":
        import tensorflow as tf

        threading = tf.config.threading
        settings.update(
            {
                "tf_inter_op_threads": (
                    threading.get_inter_op_parallelism_threads()
                ),
                "tf_intra_op_threads": (
                    threading.get_intra_op_parallelism_threads()
                ),
                "tf_executing_eagerly": tf.executing_eagerly(),
                "tf_xla_jit": tf.config.optimizer.get_jit() or "off",
            }
        )
    elif name == "jax":
        import jax

        settings.update(
            {
                "jax_default_backend": jax.default_backend(),
                "jax_devices": [str(d) for d in jax.devices()],
                "jax_enable_x64": bool(jax.config.jax_enable_x64),
            }
        )
    elif name == "torch":
        import torch

        settings.update(
            {
                "torch_num_threads": torch.get_num_threads(),
                "torch_num_interop_threads": torch.get_num_interop_threads(),
                "torch_mkldnn": torch.backends.mkldnn.is_available(),
                "torch_cuda": torch.cuda.is_available(),
            }
        )
    return settings


def reset_peak_device_memory():
    """Resets the GPU's peak-memory counter, where the backend has one."""
    if gpu_name() is None:
        return
    name = backend()
    if name == "tensorflow":
        import tensorflow as tf

        tf.config.experimental.reset_memory_stats("GPU:0")
    elif name == "torch":
        import torch

        torch.cuda.reset_peak_memory_stats()
    # JAX's peak_bytes_in_use cannot be reset: a fresh process starts at 0.


def peak_device_memory():
    """Returns the GPU's peak memory in bytes, or None on a CPU.

    Since the last `reset_peak_device_memory` (TensorFlow, PyTorch) or the
    start of the process (JAX).
    """
    if gpu_name() is None:
        return None
    name = backend()
    if name == "tensorflow":
        import tensorflow as tf

        return int(tf.config.experimental.get_memory_info("GPU:0")["peak"])
    if name == "torch":
        import torch

        return int(torch.cuda.max_memory_allocated())
    if name == "jax":
        import jax

        stats = jax.devices()[0].memory_stats() or {}
        peak = stats.get("peak_bytes_in_use")
        return None if peak is None else int(peak)
    return None
