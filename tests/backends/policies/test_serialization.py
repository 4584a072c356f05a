"""Keras serialization of policies and of models that use them."""

import keras
import numpy as np
import pytest
from testing import assert_serialization_round_trip
from testing import to_numpy

from keras_dtype_policy import DTypePolicy


@pytest.mark.parametrize("name", ["mixed_float16", "mixed_bfloat16", "float32"])
def test_policy_round_trip_through_keras_serialization(name):
    policy = DTypePolicy(name)
    config = keras.saving.serialize_keras_object(policy)
    assert config["registered_name"] == "keras_dtype_policy>DTypePolicy"
    assert config["config"] == {"name": name}
    revived = assert_serialization_round_trip(policy)
    assert revived == policy
    assert keras.dtype_policies.deserialize(config) == policy


def test_layer_config_keeps_the_policy_class():
    layer = keras.layers.Dense(3, dtype=DTypePolicy("mixed_bfloat16"))
    revived = keras.layers.Dense.from_config(layer.get_config())
    assert type(revived.dtype_policy) is DTypePolicy
    assert revived.dtype_policy == layer.dtype_policy
    lstm = keras.layers.LSTM(2, dtype=DTypePolicy("mixed_float16"))
    revived_lstm = keras.layers.LSTM.from_config(lstm.get_config())
    assert type(revived_lstm.dtype_policy) is DTypePolicy


class Subclassed(keras.Model):
    """A subclassed model whose layers follow the model's own policy."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(
            8, activation="relu", dtype=self.dtype_policy, name="hidden"
        )
        self.out = keras.layers.Dense(
            2, dtype=DTypePolicy("float32"), name="out"
        )

    def call(self, x):
        return self.out(self.hidden(x))


def sequential():
    return keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, dtype=DTypePolicy("mixed_float16")),
            keras.layers.BatchNormalization(
                dtype=DTypePolicy("mixed_bfloat16")
            ),
            keras.layers.Dense(2, dtype="float32"),
        ]
    )


def functional():
    inputs = keras.Input((4,))
    x = keras.layers.Dense(8, dtype=DTypePolicy("mixed_bfloat16"))(inputs)
    x = keras.layers.Dense(2, dtype=DTypePolicy("mixed_float16"))(x)
    outputs = keras.layers.Activation("linear", dtype="float32")(x)
    return keras.Model(inputs, outputs)


def subclassed():
    return Subclassed(dtype=DTypePolicy("mixed_bfloat16"))


keras.saving.register_keras_serializable("kdp_tests")(Subclassed)


def policies_of(model):
    return [
        (model.name, type(model.dtype_policy).__name__, model.dtype_policy.name)
    ] + [
        (
            layer.name,
            type(layer.dtype_policy).__name__,
            layer.dtype_policy.name,
            layer.compute_dtype,
            layer.variable_dtype,
        )
        for layer in model.layers
    ]


@pytest.mark.parametrize(
    "make_model", [sequential, functional, subclassed], ids=lambda f: f.__name__
)
def test_saved_model_keeps_policies_and_predictions(make_model, tmp_path):
    model = make_model()
    x = np.random.default_rng(0).normal(size=(5, 4)).astype("float32")
    expected = to_numpy(model(x))
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert policies_of(loaded) == policies_of(model)
    assert any(
        isinstance(layer.dtype_policy, DTypePolicy) for layer in loaded.layers
    )
    np.testing.assert_array_equal(to_numpy(loaded(x)), expected)
