"""The few questions about the running backend that keras.ops cannot answer.

Backend libraries are imported inside the functions, only once Keras already
runs on that backend: importing this package imports none of them.
"""

import keras


def is_concrete(tensor):
    """Returns True if `tensor` holds a value now, outside any tracing.

    A concrete boolean can steer Python control flow; a traced one (inside a
    `tf.function` or `jax.jit`) needs `keras.ops.cond`.
    """
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.executing_eagerly()
    if backend == "jax":
        import jax

        return not isinstance(tensor, jax.core.Tracer)
    return True
