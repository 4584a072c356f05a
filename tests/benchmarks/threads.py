"""An optional limit on the threads each backend computes with.

By default the suite leaves every thread setting as the backend chooses, and
only records it. `--threads N` limits them: on a machine shared with other
work, a thread pool as wide as the machine stalls whenever a core is taken
(PyTorch on two busy cores: 12 ms steps become 340 ms), and one thread fewer
measures far more steadily.

Importing this module imports no backend and not Keras.
"""

import os

# Read by OpenMP, MKL and oneDNN when the backend library loads.
ENVIRONMENT = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def limit_environment(threads):
    """Sets the thread environment variables; call before any import.

    Args:
        threads: The number of threads, or None to change nothing.
    """
    if threads is None:
        return
    for name in ENVIRONMENT:
        os.environ[name] = str(threads)


def limit_backend(threads):
    """Sets the running backend's thread pools; call before any work.

    PyTorch: intra-op threads (and inter-op ones while it still may).
    TensorFlow: intra- and inter-op threads. JAX: XLA sizes its own pool
    and offers no setting; only the environment variables apply.

    Args:
        threads: The number of threads, or None to change nothing.
    """
    if threads is None:
        return
    import keras

    backend = keras.backend.backend()
    if backend == "torch":
        import torch

        torch.set_num_threads(threads)
        try:
            torch.set_num_interop_threads(threads)
        except RuntimeError:
            # Only possible before the first parallel work of the process.
            pass
    elif backend == "tensorflow":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
