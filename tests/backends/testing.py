"""Test helpers shared by every backend's run of the suite."""

import json

import keras
import numpy as np

BACKEND = keras.backend.backend()

MIXED_POLICIES = ("mixed_float16", "mixed_bfloat16")


def to_numpy(x):
    """Returns `x` as a NumPy array, whatever backend made it."""
    return keras.ops.convert_to_numpy(x)


def dtype_of(x):
    """Returns the Keras name of the dtype of a tensor or array."""
    return keras.backend.standardize_dtype(x.dtype)


def assert_serialization_round_trip(obj):
    """Serializes `obj` through JSON and back; returns the revived object.

    The revived object must be of the same class and have the same config.
    """
    config = keras.saving.serialize_keras_object(obj)
    revived = keras.saving.deserialize_keras_object(
        json.loads(json.dumps(config))
    )
    assert type(revived) is type(obj)
    assert revived.get_config() == obj.get_config()
    return revived


def assert_layer_precision(layer, inputs, policy):
    """Checks a built layer's outputs and weights against `policy`."""
    outputs = layer(inputs)
    for output in keras.tree.flatten(outputs):
        assert dtype_of(output) == policy.compute_dtype
    for weight in layer.weights:
        if keras.backend.is_float_dtype(weight.dtype):
            assert dtype_of(weight) == policy.variable_dtype


def small_mlp(policy=None, name="mlp"):
    """A Sequential MLP with a float32 softmax head."""
    dtype = {} if policy is None else {"dtype": policy}
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="relu", **dtype),
            keras.layers.Dense(3, **dtype),
            keras.layers.Activation("softmax", dtype="float32"),
        ],
        name=name,
    )


def classification_data(num_samples=64, seed=0):
    """A small learnable classification task with 6 features, 3 classes."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num_samples, 6)).astype("float32")
    y = (x[:, 0] > 0).astype("int32") + (x[:, 1] > 1).astype("int32")
    return x, y
