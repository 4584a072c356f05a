"""Whether a JAX value is being traced (inside `jax.jit`) or concrete."""

import jax


def is_traced(value):
    """True for a tracer: the value of a computation `jax.jit` compiles."""
    return isinstance(value, jax.core.Tracer)
