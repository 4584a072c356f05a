"""What tf.keras 2.4+ gave back for TensorFlow 2.3's objects, on Keras 3.

Cases of tf-keras' own tests (mixed_precision/policy_test.py,
layer_test.py, model_test.py, loss_scale_optimizer_test.py), written anew
through `keras_dtype_policy.mixed_precision`: a `PolicyV1` config revives
as the non-experimental `Policy`, a `LossScaleOptimizerV1` config as the
non-experimental `LossScaleOptimizer`, and `FixedLossScale.update` answers
Python `True`, as TensorFlow's did.
"""

import json

import keras
import numpy as np
import pytest

import keras_dtype_policy as kdp
from keras_dtype_policy import experimental
from keras_dtype_policy import mixed_precision
from keras_dtype_policy.loss_scaling.loss_scale import FixedLossScale

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

V1_CONFIGS = [
    {"class_name": "PolicyV1", "config": {"name": "mixed_float16"}},
    {
        "class_name": "PolicyV1",
        "config": {"name": "mixed_float16", "loss_scale": None},
    },
    {"class_name": "Policy", "config": {"name": "mixed_bfloat16"}},
]


@pytest.mark.parametrize("config", V1_CONFIGS)
def test_layer_from_config_revives_the_non_experimental_policy(config):
    layer_config = keras.layers.Dense(2).get_config()
    layer_config["dtype"] = config
    layer = keras.layers.Dense.from_config(layer_config)
    assert type(layer.dtype_policy) is mixed_precision.Policy
    assert layer.dtype_policy.name == config["config"]["name"]


@pytest.mark.parametrize("config", V1_CONFIGS)
def test_dtype_argument_takes_the_non_experimental_policy(config):
    layer = keras.layers.Dense(2, dtype=config)
    assert type(layer.dtype_policy) is mixed_precision.Policy
    assert repr(layer.dtype_policy) == f'<Policy "{config["config"]["name"]}">'


def test_a_v1_policy_with_a_loss_scale_revives_without_it():
    config = {
        "class_name": "PolicyV1",
        "config": {
            "name": "mixed_float16",
            "loss_scale": {
                "class_name": "FixedLossScale",
                "config": {"loss_scale_value": 8.0},
            },
        },
    }
    layer_config = keras.layers.Dense(2).get_config()
    layer_config["dtype"] = config
    with pytest.warns(UserWarning, match="dropped"):
        layer = keras.layers.Dense.from_config(layer_config)
    assert type(layer.dtype_policy) is mixed_precision.Policy
    assert not hasattr(layer.dtype_policy, "loss_scale")


def test_a_model_saved_with_a_v1_policy_loads_with_the_2_4_policy(tmp_path):
    layer = keras.layers.Dense(
        2, dtype=experimental.Policy("mixed_float16", loss_scale=None)
    )
    model = keras.Sequential([keras.Input((3,)), layer])
    model.save(tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    assert type(loaded.layers[0].dtype_policy) is mixed_precision.Policy
    assert loaded.layers[0].dtype_policy.name == "mixed_float16"


def test_model_from_json_with_a_v1_policy():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    config = json.loads(model.to_json())
    dense = config["config"]["layers"][-1]
    dense["config"]["dtype"] = V1_CONFIGS[0]
    revived = keras.models.model_from_json(json.dumps(config))
    assert type(revived.layers[-1].dtype_policy) is mixed_precision.Policy


def _v1_config(optimizer):
    config = keras.optimizers.serialize(optimizer)
    # TensorFlow 2.3's class, in the layout it shares with the 2.4+ one.
    config["class_name"] = "LossScaleOptimizerV1"
    config.pop("registered_name", None)
    config.pop("module", None)
    return config


def test_a_v1_loss_scale_optimizer_config_revives_as_the_2_4_one():
    optimizer = mixed_precision.LossScaleOptimizer(
        keras.optimizers.SGD(2.0, momentum=0.5),
        initial_scale=2.0,
        dynamic_growth_steps=3,
    )
    revived = keras.optimizers.deserialize(_v1_config(optimizer))
    assert type(revived) is mixed_precision.LossScaleOptimizer
    assert float(keras.ops.convert_to_numpy(revived.learning_rate)) == 2.0
    assert revived.inner_optimizer.momentum == 0.5
    assert revived.loss_scale == 2.0
    assert revived.dynamic_growth_steps == 3
    assert revived.dynamic


def test_the_experimental_optimizer_deserializes_as_the_2_4_one():
    optimizer = experimental.LossScaleOptimizer(
        keras.optimizers.SGD(2.0, momentum=0.5), loss_scale=4
    )
    config = keras.optimizers.serialize(optimizer)
    revived = keras.optimizers.deserialize(json.loads(json.dumps(config)))
    assert type(revived) is mixed_precision.LossScaleOptimizer
    assert not revived.dynamic
    assert revived.loss_scale == 4.0
    # The class's own from_config keeps the class, as in tf.keras.
    direct = experimental.LossScaleOptimizer.from_config(optimizer.get_config())
    assert type(direct) is experimental.LossScaleOptimizer


def test_a_model_compiled_with_the_v1_optimizer_loads_with_the_2_4_one(
    tmp_path,
):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(
        experimental.LossScaleOptimizer(keras.optimizers.SGD(), "dynamic"),
        "mse",
    )
    x = np.ones((4, 3), "float32")
    model.fit(x, x[:, :1], epochs=1, verbose=0)
    model.save(tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    assert type(loaded.optimizer) is kdp.LossScaleOptimizer
    assert loaded.optimizer.loss_scale == model.optimizer.loss_scale


@pytest.mark.parametrize("bad", [None, np.nan, np.inf])
def test_fixed_loss_scale_update_returns_python_true(bad):
    loss_scale = FixedLossScale(8.0)
    values = np.ones((2,), "float32")
    if bad is not None:
        values[0] = bad
    update_op, should_apply = loss_scale.update(
        [keras.ops.convert_to_tensor(values)]
    )
    assert update_op is None
    assert should_apply is True
    assert float(keras.ops.convert_to_numpy(loss_scale())) == 8.0
