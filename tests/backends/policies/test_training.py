"""Training under the mixed policies: float32 variables, half compute."""

import keras
import numpy as np
import pytest
from testing import MIXED_POLICIES
from testing import assert_layer_precision
from testing import classification_data
from testing import dtype_of
from testing import small_mlp

import keras_dtype_policy as kdp


@pytest.mark.parametrize("policy_name", MIXED_POLICIES)
def test_fit_under_global_mixed_policy(policy_name):
    keras.utils.set_random_seed(1)
    kdp.set_dtype_policy(policy_name)
    model = small_mlp()
    kdp.set_dtype_policy("float32")
    half = policy_name.removeprefix("mixed_")
    model.compile("adam", "sparse_categorical_crossentropy")
    x, y = classification_data()
    history = model.fit(x, y, epochs=3, batch_size=16, verbose=0)
    losses = history.history["loss"]
    assert all(np.isfinite(losses))
    assert losses[-1] < losses[0]
    for weight in model.weights:
        assert dtype_of(weight.value) == "float32"
    dense, head = model.layers[0], model.layers[-1]
    assert dtype_of(dense(x)) == half
    assert dtype_of(model(x)) == "float32"
    assert head.compute_dtype == "float32"
    assert dtype_of(model.predict(x, verbose=0)) == "float32"


@pytest.mark.parametrize(
    "policy_name", ["mixed_float16", "mixed_bfloat16", "bfloat16"]
)
@pytest.mark.parametrize(
    "make_layer",
    [
        lambda p: keras.layers.Dense(4, dtype=p),
        lambda p: keras.layers.Conv1D(2, 2, dtype=p),
        lambda p: keras.layers.LayerNormalization(dtype=p),
    ],
    ids=["Dense", "Conv1D", "LayerNormalization"],
)
def test_layer_precision(policy_name, make_layer):
    policy = kdp.DTypePolicy(policy_name)
    inputs = np.ones((2, 3, 5), dtype="float32")
    assert_layer_precision(make_layer(policy), inputs, policy)
