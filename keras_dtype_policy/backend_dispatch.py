"""The one place the package asks which backend Keras runs on.

Code for one backend lives in a module that imports that backend at its
top (`low_precision/torch_step.py` imports torch, for one). Nothing
imports such a module at the package's import time: callers ask this
module for it, and it is imported on first use, only under its backend.
Every other module asks `name()` or one of the `is_*` questions here
instead of comparing `keras.backend.backend()` itself.
"""

import importlib

import keras

JAX = "jax"
TENSORFLOW = "tensorflow"
TORCH = "torch"

# The backend-specific modules of the package, by backend and role.
_MODULES = {
    (TORCH, "low_precision_step"): (
        "keras_dtype_policy.low_precision.torch_step"
    ),
    (TENSORFLOW, "low_precision_step"): (
        "keras_dtype_policy.low_precision.tensorflow_step"
    ),
    (TORCH, "low_precision_apply"): (
        "keras_dtype_policy.low_precision.torch_apply"
    ),
    (TENSORFLOW, "low_precision_apply"): (
        "keras_dtype_policy.low_precision.tensorflow_step"
    ),
    (TORCH, "rounding_noise"): "keras_dtype_policy.low_precision.torch_noise",
    (TORCH, "gradient_release"): (
        "keras_dtype_policy.low_precision.torch_release"
    ),
    (TORCH, "kernels"): "keras_dtype_policy.low_precision.torch_kernels",
    (JAX, "gathering"): "keras_dtype_policy.low_precision.jax_gathering",
    (JAX, "tracing"): "keras_dtype_policy.low_precision.jax_tracing",
    (JAX, "reduce_scatter"): (
        "keras_dtype_policy.low_precision.jax_reduce_scatter"
    ),
    (TORCH, "sharding"): "keras_dtype_policy.low_precision.torch_sharding",
}


def name():
    """Returns the name of the backend Keras runs on."""
    return keras.backend.backend()


def is_jax():
    """True when Keras runs on JAX."""
    return name() == JAX


def is_tensorflow():
    """True when Keras runs on TensorFlow."""
    return name() == TENSORFLOW


def is_torch():
    """True when Keras runs on PyTorch."""
    return name() == TORCH


def module_for(role):
    """Returns the current backend's module for `role`, or None.

    Args:
        role: What the module does, e.g. `"low_precision_step"`.

    Returns:
        The imported module, or None where the backend has none (JAX
        needs no step of its own: `keras.ops` under `jit` is its step).
    """
    path = _MODULES.get((name(), role))
    if path is None:
        return None
    return importlib.import_module(path)
