"""Checks of what a tf.keras 2 SavedModel directory loads as.

Shared by the SavedModel tests of tf_keras_compat/: which backends can
read the checkpoint, the loaded layers' policies, and the optimizer state
against the fixtures' manifest and expected values.
"""

import importlib.util

import keras
import numpy as np
import pytest
from testing import to_numpy

HAS_TENSORFLOW = importlib.util.find_spec("tensorflow") is not None
needs_tensorflow = pytest.mark.skipif(
    not HAS_TENSORFLOW, reason="reading a checkpoint needs TensorFlow"
)
without_tensorflow = pytest.mark.skipif(
    HAS_TENSORFLOW, reason="TensorFlow is installed here"
)


def loaded_policies(model):
    """Returns `{layer path: policy name}` for a loaded model's layers.

    tf.keras saved no policy for a nested model (its layers' policies are
    compared) nor for an InputLayer (it has its tensor's dtype).
    """
    policies = {}
    for layer in model.layers:
        if isinstance(layer, keras.Model):
            for inner in layer.layers:
                if not isinstance(inner, keras.layers.InputLayer):
                    key = f"{layer.name}/{inner.name}"
                    policies[key] = inner.dtype_policy.name
        elif not isinstance(layer, keras.layers.InputLayer):
            policies[layer.name] = layer.dtype_policy.name
    return policies


def assert_optimizer_state(optimizer, record, expected, name):
    """The loaded optimizer holds exactly what tf.keras saved.

    Args:
        optimizer: the loaded model's optimizer.
        record: the manifest's `optimizer` record of the fixture.
        expected: the fixtures' expected values (an `.npz` mapping).
        name: the fixture's name, the prefix of its expected values.
    """
    inner = optimizer
    if "loss_scale" in record:
        assert isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        inner = optimizer.inner_optimizer
        assert optimizer.dynamic == record["dynamic"]
        scale = float(to_numpy(optimizer.dynamic_scale))
        assert scale == float(expected[f"{name}.loss_scale"])
        if record["dynamic"]:
            counter = int(to_numpy(optimizer.step_counter))
            assert counter == int(expected[f"{name}.dynamic_counter"])
    else:
        assert not isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    assert type(inner).__name__ == record["inner_class"]
    iterations = int(to_numpy(inner.iterations))
    assert iterations == record["iterations"]
    if f"{name}.iterations" in expected:
        assert iterations == int(expected[f"{name}.iterations"])
    slots = [
        v
        for v in inner.variables
        if v is not inner.iterations and v is not inner._learning_rate
    ]
    assert len(slots) == len(record["slots"]) > 0
    for i, slot in enumerate(slots):
        np.testing.assert_array_equal(
            to_numpy(slot), expected[f"{name}.slot.{i}"], err_msg=slot.path
        )
