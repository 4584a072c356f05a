"""The few questions about the running backend that keras.ops cannot answer.

The backend is asked of `backend_dispatch`; a backend library is imported
inside a function, only once Keras already runs on that backend: importing
this package imports none of them.
"""

from keras_dtype_policy import backend_dispatch


def is_concrete(tensor):
    """Returns True if `tensor` holds a value now, outside any tracing.

    A concrete boolean can steer Python control flow; a traced one (inside a
    `tf.function` or `jax.jit`) needs `keras.ops.cond`.
    """
    if backend_dispatch.is_tensorflow():
        import tensorflow as tf

        return tf.executing_eagerly()
    if backend_dispatch.is_jax():
        import jax

        return not isinstance(tensor, jax.core.Tracer)
    return True


def is_indexed_slices(value):
    """Returns True if `value` is a TensorFlow `IndexedSlices` (a sparse
    gradient, which only TensorFlow has)."""
    if not backend_dispatch.is_tensorflow():
        return False
    import tensorflow as tf

    return isinstance(value, tf.IndexedSlices)


def with_values(slices, values):
    """Returns the `IndexedSlices` `slices` holding `values` instead."""
    import tensorflow as tf

    return tf.IndexedSlices(values, slices.indices, slices.dense_shape)
