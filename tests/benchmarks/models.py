"""The benchmark models, their data, and each arm's policies and optimizers.

An arm is "plugin" (this package's `DTypePolicy` and `LossScaleOptimizer`)
or "keras" (Keras' own classes of the same names). Every model is built with
the arm's policy objects and compiled with an explicit optimizer, so the
compile hook of this package (installed on import) wraps nothing: what runs
is exactly what the arm names.

Import this module only once `KERAS_BACKEND` is set: it imports Keras.
"""

import contextlib

import keras
import numpy as np

import keras_dtype_policy as kdp
from tests.benchmarks.sizes import KERAS
from tests.benchmarks.sizes import PLUGIN


def make_policy(arm, name):
    """Returns the policy called `name` of the arm `arm`.

    Args:
        arm: "plugin" or "keras".
        name: A policy name, such as "mixed_float16".

    Returns:
        A `keras_dtype_policy.DTypePolicy` or a `keras.DTypePolicy`.
    """
    if arm == PLUGIN:
        return kdp.DTypePolicy(name)
    if arm == KERAS:
        return keras.DTypePolicy(name)
    raise ValueError(f"Unknown arm. Expected 'plugin' or 'keras'. Got {arm!r}")


def make_optimizer(arm, policy_name, loss_scale=None):
    """Returns Adam, in the arm's loss-scale optimizer for float16 policies.

    Args:
        arm: "plugin" or "keras".
        policy_name: The model's policy name.
        loss_scale: True or False to force the decision; None wraps for a
            float16 compute dtype only.

    Returns:
        A `keras.optimizers.Optimizer`.
    """
    optimizer = keras.optimizers.Adam(1e-3)
    if loss_scale is None:
        loss_scale = make_policy(arm, policy_name).compute_dtype == "float16"
    if not loss_scale:
        return optimizer
    return wrap_optimizer(arm, optimizer)


def wrap_optimizer(arm, optimizer):
    """Returns `optimizer` in the arm's loss-scale optimizer."""
    if arm == PLUGIN:
        return kdp.LossScaleOptimizer(optimizer)
    if arm == KERAS:
        return keras.optimizers.LossScaleOptimizer(optimizer)
    raise ValueError(f"Unknown arm. Expected 'plugin' or 'keras'. Got {arm!r}")


@contextlib.contextmanager
def global_policy(policy):
    """Sets Keras' global policy to the object `policy` for a block."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        yield policy
    finally:
        keras.config.set_dtype_policy(previous)


def build_mlp(arm, policy_name, units, use_bias=True):
    """Returns an MLP `units[0] -> units[1:-1] (relu) -> units[-1]` logits.

    Every layer takes the arm's policy `policy_name`, but the logits layer,
    which computes in float32. `use_bias=False` leaves the hidden layers
    without bias.
    """
    with global_policy(make_policy(arm, policy_name)):
        layers = [keras.Input((units[0],))]
        layers += [
            keras.layers.Dense(u, activation="relu", use_bias=use_bias)
            for u in units[1:-1]
        ]
        layers.append(
            keras.layers.Dense(units[-1], dtype=make_policy(arm, "float32"))
        )
        return keras.Sequential(layers, name=f"mlp_{arm}_{policy_name}")


def build_deep(arm, policy_name, units, blocks, classes=10):
    """Returns a deep, narrow model with many small weight tensors.

    `blocks` x (Dense `units` (relu) + LayerNormalization), then float32
    logits: 4 x `blocks` + 2 weight tensors, as in the models trained in
    mixed precision, where a per-tensor cost adds up.
    """
    with global_policy(make_policy(arm, policy_name)):
        layers = [keras.Input((units,))]
        for _ in range(blocks):
            layers.append(keras.layers.Dense(units, activation="relu"))
            layers.append(keras.layers.LayerNormalization())
        layers.append(
            keras.layers.Dense(classes, dtype=make_policy(arm, "float32"))
        )
        return keras.Sequential(layers, name=f"deep_{arm}_{policy_name}")


def build_convnet(arm, policy_name, image, filters, classes=10):
    """Returns a small convnet for `image` x `image` RGB images.

    Three 3x3 convolutions with `filters` filters (relu, 2x2 max pooling
    after the first two), global average pooling and float32 logits.
    """
    with global_policy(make_policy(arm, policy_name)):
        layers = [keras.Input((image, image, 3))]
        for i, count in enumerate(filters):
            layers.append(
                keras.layers.Conv2D(count, 3, padding="same", activation="relu")
            )
            if i < len(filters) - 1:
                layers.append(keras.layers.MaxPooling2D(2))
        layers += [
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(classes, dtype=make_policy(arm, "float32")),
        ]
        return keras.Sequential(layers, name=f"convnet_{arm}_{policy_name}")


def compile_model(model, optimizer, jit_compile="auto"):
    """Compiles `model` for classification with `optimizer`, by default
    as Keras compiles (`jit_compile="auto"`)."""
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile,
    )
    return model


def classification_data(input_shape, samples, classes=10, seed=0):
    """Returns random float32 inputs and int32 labels as NumPy arrays."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((samples, *input_shape), dtype=np.float32)
    y = rng.integers(0, classes, size=samples).astype("int32")
    return x, y


def describe_model(model):
    """Returns the classes that a compiled model actually runs with."""
    optimizer = model.optimizer
    return {
        "policy_class": _qualified_name(type(model.layers[0].dtype_policy)),
        "policy": model.layers[0].dtype_policy.name,
        "optimizer_class": _qualified_name(type(optimizer)),
        "jit_compile": getattr(model, "jit_compile", None),
        "parameters": int(model.count_params()),
    }


def _qualified_name(cls):
    return f"{cls.__module__}.{cls.__qualname__}"
