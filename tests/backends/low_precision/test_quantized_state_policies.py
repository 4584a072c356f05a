"""The policy names of 8-bit and 4-bit optimizer state.

`"stochastic_bfloat16_8bit"` and its kin are the low-precision update
policies with block-wise quantized optimizer state: bfloat16 (or float16)
compute and weights, and a compiled model gets a `LowPrecisionOptimizer`
with that `update` and `state_dtype` (inside a `LossScaleOptimizer` for the
float16 forms, as the plain float16 forms get it).
"""

import json

import keras
import numpy as np
import pytest
from testing import assert_serialization_round_trip

import keras_dtype_policy as kdp
from keras_dtype_policy import LossScaleOptimizer
from keras_dtype_policy import LowPrecisionOptimizer
from keras_dtype_policy.policies import names

QUANTIZED = {
    name: entry
    for name, entry in names.LOW_PRECISION_UPDATE_POLICIES.items()
    if entry[2] is not None
}


def as_float32(x):
    return keras.ops.convert_to_numpy(keras.ops.cast(x, "float32"))


def small_model():
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(128, activation="tanh"),
            keras.layers.Dense(1),
        ]
    )


def regression_data(samples=64):
    rng = np.random.RandomState(0)
    x = rng.randn(samples, 64).astype("float32")
    return x, (x[:, :1] * 0.5).astype("float32")


def test_the_names():
    expected = {
        f"{update}_{dtype}_{bits}"
        for update in ("kahan", "stochastic")
        for dtype in ("bfloat16", "float16")
        for bits in ("8bit", "4bit")
    }
    assert set(QUANTIZED) == expected
    for name, (dtype, update, state_dtype) in QUANTIZED.items():
        plain = name.rsplit("_", 1)[0]
        assert names.LOW_PRECISION_UPDATE_POLICIES[plain] == (
            dtype,
            update,
            None,
        )
        assert name.endswith(state_dtype)


@pytest.mark.parametrize("name", sorted(QUANTIZED))
def test_policy_dtypes_and_lookups(name):
    dtype = QUANTIZED[name][0]
    policy = kdp.DTypePolicy(name)
    assert (policy.name, policy.compute_dtype, policy.variable_dtype) == (
        name,
        dtype,
        dtype,
    )
    assert keras.dtype_policies.get(name) == policy
    layer = keras.layers.Dense(4, dtype=name)
    assert layer.dtype_policy == policy
    assert layer.compute_dtype == layer.variable_dtype == dtype
    revived = assert_serialization_round_trip(policy)
    assert revived.name == name


@pytest.mark.filterwarnings("ignore::keras_dtype_policy.SlowFloat16Warning")
@pytest.mark.parametrize("name", sorted(QUANTIZED))
def test_compile_installs_the_state_dtype(name):
    dtype, update, state_dtype = QUANTIZED[name]
    kdp.set_dtype_policy(name)
    model = small_model()
    adam = keras.optimizers.Adam(0.01)
    model.compile(adam, "mse")
    optimizer = model.optimizer
    if dtype == "float16":
        assert isinstance(optimizer, LossScaleOptimizer)
        optimizer = optimizer.inner_optimizer
    else:
        assert not isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    assert isinstance(optimizer, LowPrecisionOptimizer)
    assert optimizer.inner_optimizer is adam
    assert (optimizer.update, optimizer.state_dtype) == (update, state_dtype)


@pytest.mark.parametrize(
    "name", ["stochastic_bfloat16_8bit", "kahan_bfloat16_4bit"]
)
def test_a_saved_model_comes_back_with_its_state_dtype(name, tmp_path):
    kdp.set_dtype_policy(name)
    model = small_model()
    model.compile(keras.optimizers.Adam(0.01), "mse")
    x, y = regression_data()
    model.fit(x, y, batch_size=16, verbose=0)
    model.save(tmp_path / "model.keras")
    kdp.set_dtype_policy("float32")
    restored = keras.saving.load_model(tmp_path / "model.keras")
    assert [layer.dtype_policy.name for layer in restored.layers] == [
        name,
        name,
    ]
    optimizer = restored.optimizer
    assert isinstance(optimizer, LowPrecisionOptimizer)
    assert optimizer.state_dtype == QUANTIZED[name][2]
    config = json.loads(json.dumps(keras.saving.serialize_keras_object(model)))
    assert config["config"]["layers"][1]["config"]["dtype"]["config"] == {
        "name": name
    }
    coded = [
        (before, after)
        for before, after in zip(
            model.optimizer.variables, optimizer.variables, strict=True
        )
        if before.path.endswith(("_codes", "_scales"))
    ]
    assert len(coded) == 4  # the kernel's two moments, codes and scales
    for before, after in coded:
        assert after.path.endswith(before.path[-20:])
        np.testing.assert_array_equal(as_float32(before), as_float32(after))
