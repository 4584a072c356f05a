"""DTypePolicy.convert_input on every kind of input, on each backend."""

import keras
import numpy as np
import pytest
from testing import BACKEND
from testing import dtype_of
from testing import to_numpy

from keras_dtype_policy import DTypePolicy

POLICY = DTypePolicy("mixed_float16")


@pytest.mark.parametrize("target", ["float16", "bfloat16", "float64"])
def test_backend_float_tensor_is_cast(target):
    x = keras.ops.ones((2, 3), dtype="float32")
    y = POLICY.convert_input(x, True, target)
    assert keras.ops.is_tensor(y)
    expected = "float32" if target == "float64" and BACKEND == "jax" else target
    # jax without x64 keeps float64 requests in float32.
    assert dtype_of(y) == expected
    np.testing.assert_array_equal(
        to_numpy(y).astype("float32"), np.ones((2, 3))
    )


def test_tensor_already_in_dtype_is_the_same_object():
    x = keras.ops.ones((2,), dtype="float16")
    assert POLICY.convert_input(x, True, "float16") is x


def test_no_cast_without_autocast():
    x = keras.ops.ones((2,), dtype="float32")
    assert POLICY.convert_input(x, False, "float16") is x


@pytest.mark.parametrize("dtype", ["int32", "bool", "uint8"])
def test_non_float_tensors_pass_through(dtype):
    x = keras.ops.zeros((3,), dtype=dtype)
    assert POLICY.convert_input(x, True, "float16") is x


def test_keras_tensor_is_cast_symbolically():
    x = keras.KerasTensor((None, 4), dtype="float32")
    y = POLICY.convert_input(x, True, "float16")
    assert keras.backend.is_keras_tensor(y)
    assert y.dtype == "float16"
    assert y.shape == (None, 4)
    same = keras.KerasTensor((None, 4), dtype="float16")
    assert POLICY.convert_input(same, True, "float16") is same
    ints = keras.KerasTensor((None, 4), dtype="int32")
    assert POLICY.convert_input(ints, True, "float16") is ints


def test_numpy_float_array_becomes_a_tensor_in_dtype():
    x = np.arange(4, dtype="float32")
    y = POLICY.convert_input(x, True, "float16")
    assert keras.ops.is_tensor(y)
    assert dtype_of(y) == "float16"
    np.testing.assert_array_equal(to_numpy(y), x)


@pytest.mark.parametrize("dtype", ["int32", "bool", "uint8"])
def test_numpy_non_float_array_keeps_its_dtype(dtype):
    x = np.zeros((3,), dtype=dtype)
    y = POLICY.convert_input(x, True, "float16")
    assert dtype_of(y) == dtype
    np.testing.assert_array_equal(to_numpy(y), x)


def test_numpy_string_array_passes_through():
    x = np.array(["a", "bc"])
    assert POLICY.convert_input(x, True, "float16") is x


def test_python_values():
    y = POLICY.convert_input(2.5, True, "float16")
    assert dtype_of(y) == "float16"
    assert float(to_numpy(y)) == 2.5
    assert POLICY.convert_input(2.5, False, "float16") == 2.5
    assert POLICY.convert_input(3, True, "float16") == 3
    assert POLICY.convert_input("text", True, "float16") == "text"
    assert POLICY.convert_input(None, True, "float16") is None


def test_nested_structures_cast_only_floating_leaves():
    floats = keras.ops.ones((2,), dtype="float32")
    ints = keras.ops.ones((2,), dtype="int32")
    done = keras.ops.ones((2,), dtype="float16")
    inputs = {"a": [floats, (ints, done)], "b": np.ones(2, "float32"), "c": "s"}
    outputs = POLICY.convert_input(inputs, True, "float16")
    assert set(outputs) == {"a", "b", "c"}
    assert dtype_of(outputs["a"][0]) == "float16"
    assert outputs["a"][1][0] is ints
    assert outputs["a"][1][1] is done
    assert isinstance(outputs["a"][1], tuple)
    assert dtype_of(outputs["b"]) == "float16"
    assert outputs["c"] == "s"


def test_layer_call_casts_through_the_policy():
    layer = keras.layers.Dense(2, dtype=POLICY)
    y = layer(np.ones((1, 3), dtype="float32"))
    assert dtype_of(y) == "float16"
    assert dtype_of(layer.kernel.value) == "float32"
    ids = keras.layers.Embedding(5, 2, dtype=POLICY)(np.array([[1, 2]]))
    assert dtype_of(ids) == "float16"
