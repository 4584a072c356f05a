"""The tf.keras API of the seeds: Policy, set_policy, infer policies."""

import warnings

import keras
import numpy as np
import pytest
from testing import classification_data
from testing import dtype_of
from testing import to_numpy

import keras_dtype_policy as kdp
from keras_dtype_policy import DTypePolicy
from keras_dtype_policy import DynamicLossScale
from keras_dtype_policy import FixedLossScale
from keras_dtype_policy import Policy
from keras_dtype_policy import mixed_precision
from keras_dtype_policy.tf_keras_compat import legacy_policy_configs


@pytest.fixture(autouse=True)
def quiet_deprecation_and_fresh_reports():
    legacy_policy_configs._reported_scales.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        yield
    legacy_policy_configs._reported_scales.clear()


@pytest.mark.parametrize(
    "name, loss_scale, expected",
    [
        ("mixed_float16", "auto", DynamicLossScale()),
        ("mixed_bfloat16", "auto", None),
        ("float32", "auto", None),
        ("mixed_float16", 1024, FixedLossScale(1024)),
        ("mixed_float16", 0.5, FixedLossScale(0.5)),
        ("mixed_bfloat16", "dynamic", DynamicLossScale()),
        ("mixed_float16", None, None),
        ("float16", DynamicLossScale(8, 3), DynamicLossScale(8, 3)),
    ],
)
def test_loss_scale_forms(name, loss_scale, expected):
    policy = Policy(name, loss_scale=loss_scale)
    assert policy.loss_scale == expected
    assert policy.name == name
    assert policy == DTypePolicy(name) or policy.name == name


@pytest.mark.parametrize(
    "loss_scale, error",
    [
        ("static", ValueError),
        (-1, ValueError),
        ([2], TypeError),
        (True, TypeError),
    ],
)
def test_bad_loss_scale_is_a_clear_error(loss_scale, error):
    with pytest.raises(error, match="Received: loss_scale="):
        Policy("mixed_float16", loss_scale=loss_scale)


def test_construction_warns_and_points_to_dtype_policy():
    with pytest.warns(
        DeprecationWarning, match="keras_dtype_policy.DTypePolicy"
    ):
        Policy("mixed_float16")


@pytest.mark.parametrize(
    "name, compute, variable, cast",
    [
        ("mixed_float16", "float16", "float32", True),
        ("mixed_bfloat16", "bfloat16", "float32", True),
        ("float32", "float32", "float32", False),
        ("float16", "float16", "float16", False),
    ],
)
def test_properties(name, compute, variable, cast):
    policy = Policy(name)
    assert (policy.compute_dtype, policy.variable_dtype) == (compute, variable)
    assert policy.should_cast_variables is cast
    assert isinstance(policy, keras.DTypePolicy)


def test_experimental_paths_are_the_same_objects():
    from keras_dtype_policy import experimental

    assert experimental.Policy is Policy
    assert experimental.set_policy is kdp.set_policy
    assert experimental.global_policy is kdp.global_policy


def test_as_layer_policy_it_behaves_as_dtype_policy():
    layer = keras.layers.Dense(3, dtype=Policy("mixed_bfloat16"))
    y = layer(np.ones((2, 4), "float32"))
    assert dtype_of(y) == "bfloat16"
    assert dtype_of(layer.kernel.value) == "float32"


def _train(model):
    x, y = classification_data()
    model.fit(x, y, epochs=2, batch_size=16, verbose=0)


def test_model_compiled_under_fixed_scale_policy():
    kdp.set_policy(Policy("mixed_float16", loss_scale=1024))
    model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(8), keras.layers.Dense(3)]
    )
    kdp.set_policy(None)
    model.compile("adam", "sparse_categorical_crossentropy")
    optimizer = model.optimizer
    assert isinstance(optimizer, kdp.LossScaleOptimizer)
    assert optimizer.dynamic is False
    assert optimizer.loss_scale == 1024.0
    _train(model)
    assert optimizer.loss_scale == 1024.0
    assert int(to_numpy(optimizer.iterations)) > 0


def test_loss_scale_none_trains_without_scaling_even_for_float16():
    kdp.set_policy(Policy("mixed_float16", loss_scale=None))
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    kdp.set_policy(None)
    model.compile("adam", "sparse_categorical_crossentropy")
    assert not isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    _train(model)


def test_dynamic_scale_on_a_bfloat16_policy():
    with kdp.policy_scope(Policy("mixed_bfloat16", loss_scale="dynamic")):
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    model.compile("sgd", "sparse_categorical_crossentropy")
    assert model.optimizer.dynamic is True


def test_config_carries_the_loss_scale_and_from_config_restores_it():
    policy = Policy("mixed_float16", loss_scale=256)
    config = policy.get_config()
    assert config == {
        "name": "mixed_float16",
        "loss_scale": {
            "class_name": "FixedLossScale",
            "config": {"loss_scale_value": 256.0},
        },
    }
    revived = Policy.from_config(config)
    assert type(revived) is Policy
    assert revived == policy
    assert Policy.from_config({"name": "mixed_float16"}).loss_scale == (
        DynamicLossScale()
    )


@pytest.mark.parametrize("config", [{}, {"name": "x", "extra": 1}, "float32"])
def test_from_config_rejects_bad_configs(config):
    with pytest.raises(ValueError, match="Received: config="):
        Policy.from_config(config)


def test_keras_functions_yield_the_2_4_policy_and_warn_once():
    policy = Policy("mixed_float16", loss_scale=512)
    serialized = keras.saving.serialize_keras_object(policy)
    with pytest.warns(
        UserWarning, match=r"FixedLossScale\(loss_scale_value=512"
    ):
        revived = keras.saving.deserialize_keras_object(serialized)
    # tf.keras 2.4+ revived its non-experimental `Policy`.
    assert type(revived) is mixed_precision.Policy
    assert revived.name == "mixed_float16"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        keras.saving.deserialize_keras_object(serialized)  # already said


def test_layer_from_config_and_load_model_drop_the_scale(tmp_path):
    layer = keras.layers.Dense(2, dtype=Policy("mixed_float16", loss_scale=64))
    with pytest.warns(UserWarning, match="dropped"):
        revived = keras.layers.Dense.from_config(layer.get_config())
    assert type(revived.dtype_policy) is mixed_precision.Policy
    assert revived.dtype_policy.name == "mixed_float16"
    model = keras.Sequential([keras.Input((3,)), layer])
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    assert type(loaded.layers[0].dtype_policy) is mixed_precision.Policy


def test_set_policy_and_global_policy_as_the_seeds_use_them():
    kdp.set_policy("mixed_float16")
    assert kdp.global_policy().name == "mixed_float16"
    assert keras.layers.Dense(10).compute_dtype == "float16"
    kdp.experimental.set_policy(None)
    assert kdp.global_policy().name == "float32"
    assert keras.layers.Dense(10).compute_dtype == "float32"
    with pytest.raises(TypeError, match="Received: policy=3"):
        kdp.set_policy(3)


@pytest.mark.parametrize("spelling", ["infer", "_infer"])
@pytest.mark.parametrize("input_dtype", ["float16", "bfloat16", "float32"])
def test_infer_takes_the_first_inputs_dtype(spelling, input_dtype):
    layer = keras.layers.Dense(3, dtype=spelling)
    assert layer.dtype_policy.compute_dtype is None
    y = layer(keras.ops.ones((2, 4), dtype=input_dtype))
    assert dtype_of(y) == input_dtype
    assert dtype_of(layer.kernel.value) == input_dtype
    assert layer.dtype_policy.name == input_dtype
    y2 = layer(keras.ops.ones((2, 4), dtype="float32"))
    assert dtype_of(y2) == input_dtype


def test_infer_policy_object_and_global_infer_are_per_layer():
    kdp.set_policy("infer")
    shared = kdp.global_policy()
    first, second = keras.layers.Dense(2), keras.layers.Dense(2)
    kdp.set_policy(None)
    first(keras.ops.ones((1, 3), dtype="float16"))
    second(keras.ops.ones((1, 3), dtype="bfloat16"))
    assert first.compute_dtype == "float16"
    assert second.compute_dtype == "bfloat16"
    assert shared.compute_dtype is None
    assert shared.name == "infer"
    policy = Policy("infer")
    a, b = (
        keras.layers.Dense(2, dtype=policy),
        keras.layers.Dense(2, dtype=policy),
    )
    a(keras.ops.ones((1, 3), dtype="float16"))
    b(keras.ops.ones((1, 3), dtype="float32"))
    assert (a.compute_dtype, b.compute_dtype) == ("float16", "float32")
    assert policy.compute_dtype is None


@pytest.mark.parametrize(
    "input_dtype, name",
    [
        ("float16", "mixed_float16"),
        ("bfloat16", "mixed_bfloat16"),
        ("float32", "float32"),
    ],
)
def test_infer_with_float32_vars(input_dtype, name):
    layer = keras.layers.Dense(3, dtype="infer_with_float32_vars")
    y = layer(keras.ops.ones((2, 4), dtype=input_dtype))
    assert dtype_of(y) == input_dtype
    assert dtype_of(layer.kernel.value) == "float32"
    assert layer.dtype_policy.name == name
    assert layer.dtype_policy.variable_dtype == "float32"


def test_infer_in_a_functional_model_resolves_symbolically():
    inputs = keras.Input((4,), dtype="float16")
    outputs = keras.layers.Dense(2, dtype="infer")(inputs)
    model = keras.Model(inputs, outputs)
    assert model.layers[-1].compute_dtype == "float16"
    assert dtype_of(model(np.ones((1, 4), "float16"))) == "float16"


@pytest.mark.parametrize(
    "removed, replacement",
    [
        ("float16_with_float32_vars", "mixed_float16"),
        ("bfloat16_with_float32_vars", "mixed_bfloat16"),
    ],
)
def test_removed_names_name_their_replacement(removed, replacement):
    for make in (
        lambda: DTypePolicy(removed),
        lambda: Policy(removed),
        lambda: keras.layers.Dense(2, dtype=removed),
        lambda: kdp.set_policy(removed),
    ):
        with pytest.raises(ValueError, match=replacement):
            make()
