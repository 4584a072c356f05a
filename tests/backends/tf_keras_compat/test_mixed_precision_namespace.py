"""`keras_dtype_policy.mixed_precision`, tf.keras 2.4+'s namespace.

Its `Policy` as tf-keras' policy_test.py pins it down (test_dtype_attributes,
test_repr, test_config, test_serialization with "_infer", test_global_policy,
test_global_policy_dtype_error), and TensorFlow 2.3's experimental `Policy`
(`mixed_precision.experimental.Policy`, also `kdp.Policy`) as TensorFlow
2.3's experimental/policy_test.py does (test_repr, test_config,
test_serialization). Every fact holds alike on the three backends.
"""

import warnings

import keras
import numpy as np
import pytest
from testing import to_numpy

import keras_dtype_policy as kdp
from keras_dtype_policy import mixed_precision
from keras_dtype_policy.loss_scaling.loss_scale import DynamicLossScale

LEGACY = pytest.mark.filterwarnings("ignore::DeprecationWarning")
ALL_NAMES = ("float16", "float32", "int16", "mixed_float16", "mixed_bfloat16")


def test_the_namespace_holds_what_tf_keras_2_4_exported():
    assert sorted(mixed_precision.__all__) == [
        "LossScaleOptimizer",
        "Policy",
        "experimental",
        "global_policy",
        "set_global_policy",
    ]
    assert mixed_precision.LossScaleOptimizer is kdp.LossScaleOptimizer
    assert mixed_precision.experimental is kdp.experimental
    assert kdp.mixed_precision is mixed_precision
    # The experimental class is a kind of the 2.4+ one, as in tf.keras.
    assert issubclass(kdp.Policy, mixed_precision.Policy)
    assert mixed_precision.experimental.Policy is kdp.Policy


@pytest.mark.parametrize(
    "name, compute, variable",
    [
        ("int32", "int32", "int32"),
        ("bool", "bool", "bool"),
        ("float16", "float16", "float16"),
        ("float32", "float32", "float32"),
        ("mixed_float16", "float16", "float32"),
        ("mixed_bfloat16", "bfloat16", "float32"),
        ("_infer", None, None),
    ],
)
def test_policy_dtypes(name, compute, variable):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no DeprecationWarning, no other
        policy = mixed_precision.Policy(name)
    assert (policy.name, policy.compute_dtype, policy.variable_dtype) == (
        name,
        compute,
        variable,
    )
    assert not hasattr(policy, "loss_scale")


@pytest.mark.parametrize(
    "name", ["float32", "int8", "mixed_float16", "mixed_bfloat16", "_infer"]
)
def test_repr(name):
    assert repr(mixed_precision.Policy(name)) == f'<Policy "{name}">'


def test_bad_names_raise_naming_the_value():
    with pytest.raises(ValueError, match="Received: name='abc'"):
        mixed_precision.Policy("abc")
    with pytest.raises(TypeError, match=r"Received: name=5 \(of type int\)"):
        mixed_precision.Policy(5)
    with pytest.raises(ValueError, match="'mixed_float16' instead"):
        mixed_precision.Policy("float16_with_float32_vars")


@pytest.mark.parametrize("name", [*ALL_NAMES, "_infer"])
def test_config(name):
    policy = mixed_precision.Policy(name)
    revived = mixed_precision.Policy.from_config(policy.get_config())
    assert str(revived) == str(policy)
    assert type(revived) is mixed_precision.Policy


@pytest.mark.parametrize("name", [*ALL_NAMES, "_infer"])
def test_serialization_through_keras(name):
    policy = mixed_precision.Policy(name)
    config = keras.dtype_policies.serialize(policy)
    assert config["class_name"] == "Policy"
    assert config["config"] == {"name": name}
    revived = keras.dtype_policies.deserialize(config)
    assert str(revived) == str(policy)
    assert type(revived) is mixed_precision.Policy
    revived = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(policy)
    )
    assert type(revived) is mixed_precision.Policy


def test_equal_to_the_dtype_policy_of_the_same_name():
    policy = mixed_precision.Policy("mixed_float16")
    assert policy == kdp.DTypePolicy("mixed_float16")
    assert policy == keras.DTypePolicy("mixed_float16")
    assert policy != mixed_precision.Policy("mixed_bfloat16")
    assert len({policy, kdp.DTypePolicy("mixed_float16")}) == 1
    # The experimental policy, which carries a loss scale, is another kind.
    with pytest.warns(DeprecationWarning):
        assert policy != kdp.Policy("mixed_float16")


@pytest.mark.parametrize("name", ["mixed_float16", "mixed_bfloat16"])
def test_layers_compute_in_it_and_it_survives_a_keras_file(name, tmp_path):
    policy = mixed_precision.Policy(name)
    inputs = keras.Input((3,))
    outputs = keras.layers.Dense(2, dtype=policy, name="dense")(inputs)
    model = keras.Model(inputs, outputs)
    x = np.ones((2, 3), dtype="float32")
    out = model(x)
    assert keras.backend.standardize_dtype(out.dtype) == policy.compute_dtype
    assert all(v.dtype == "float32" for v in model.weights)
    model.save(tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    layer = loaded.get_layer("dense")
    assert type(layer.dtype_policy) is mixed_precision.Policy
    assert repr(layer.dtype_policy) == f'<Policy "{name}">'
    np.testing.assert_array_equal(to_numpy(loaded(x)), to_numpy(out))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_infer_layers_take_the_dtype_of_their_first_input(dtype):
    policy = mixed_precision.Policy("_infer")
    first = keras.layers.Dense(2, dtype=policy)
    second = keras.layers.Dense(2, dtype=policy)
    out = first(np.ones((1, 3), dtype=dtype))
    assert keras.backend.standardize_dtype(out.dtype) == dtype
    assert first.dtype_policy.name == dtype
    assert [v.dtype for v in first.weights] == [dtype, dtype]
    assert type(first.dtype_policy) is mixed_precision.Policy
    # Each layer infers for itself; the shared policy is left unresolved.
    assert policy.name == "_infer" and second.dtype_policy.infers
    second(np.ones((1, 3), dtype="float32"))
    assert second.dtype_policy.name == "float32"


def test_global_policy():
    assert mixed_precision.global_policy().name == "float32"
    assert repr(mixed_precision.global_policy()) == '<Policy "float32">'
    mixed_precision.set_global_policy("mixed_float16")
    assert repr(mixed_precision.global_policy()) == '<Policy "mixed_float16">'
    assert keras.layers.Dense(2).dtype_policy.name == "mixed_float16"
    mixed_precision.set_global_policy("_infer")
    assert mixed_precision.global_policy().name == "_infer"
    layer = keras.layers.Dense(2)
    layer(np.ones((1, 3), dtype="float16"))
    assert layer.compute_dtype == "float16"
    assert mixed_precision.global_policy().name == "_infer"
    policy = mixed_precision.Policy("mixed_bfloat16")
    mixed_precision.set_global_policy(policy)
    assert mixed_precision.global_policy() is policy
    mixed_precision.set_global_policy(None)
    assert repr(mixed_precision.global_policy()) == '<Policy "float32">'


@pytest.mark.parametrize("name", ["int32", "complex64"])
def test_global_policy_dtype_error(name):
    for policy in (name, mixed_precision.Policy(name)):
        with pytest.raises(ValueError) as error:
            mixed_precision.set_global_policy(policy)
        assert str(error.value) == (
            "set_global_policy can only be used to set the global policy "
            'to floating-point policies, such as "float32" and '
            f'"mixed_float16", but got policy: {name}'
        )
    assert mixed_precision.global_policy().name == "float32"


def test_set_global_policy_refuses_other_types():
    with pytest.raises(TypeError, match=r"Received: policy=5 \(of type int"):
        mixed_precision.set_global_policy(5)


def test_a_float16_global_policy_gets_loss_scaling_without_a_policy_scale():
    mixed_precision.set_global_policy("mixed_float16")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.1), "mse")
    assert isinstance(model.optimizer, mixed_precision.LossScaleOptimizer)
    assert model.optimizer.dynamic


# TensorFlow 2.3's experimental Policy, through both of its doors.
EXPERIMENTAL = [kdp.Policy, mixed_precision.experimental.Policy]


@LEGACY
@pytest.mark.parametrize("policy_class", EXPERIMENTAL)
def test_experimental_repr(policy_class):
    for name in ("float32", "int8", "mixed_bfloat16", "_infer"):
        assert repr(policy_class(name)) == f'<Policy "{name}", loss_scale=None>'
    assert repr(policy_class("float16", loss_scale=2)) == (
        '<Policy "float16", loss_scale=FixedLossScale(2.0)>'
    )
    assert repr(policy_class("mixed_float16")).startswith(
        '<Policy "mixed_float16", loss_scale=DynamicLossScale('
    )


@LEGACY
@pytest.mark.parametrize(
    "arguments",
    [
        *[(name,) for name in (*ALL_NAMES, "_infer")],
        *[
            (name, loss_scale)
            for name in ("float32", "mixed_float16", "mixed_bfloat16")
            for loss_scale in (2.0, None)
        ],
    ],
)
def test_experimental_config(arguments):
    # Policy.from_config keeps the loss scale, default or not.
    with warnings.catch_warnings():
        # A scale on a policy that is not float16 warns (tested elsewhere).
        warnings.simplefilter("ignore", UserWarning)
        policy = kdp.Policy(*arguments)
        revived = mixed_precision.experimental.Policy.from_config(
            policy.get_config()
        )
    assert str(revived) == str(policy)


@LEGACY
def test_experimental_serialization_writes_tf_2_3_configs():
    policy = kdp.Policy("mixed_float16", loss_scale=2.0)
    config = keras.dtype_policies.serialize(policy)
    assert config["class_name"] == "Policy"
    assert config["config"] == {
        "name": "mixed_float16",
        "loss_scale": {
            "class_name": "FixedLossScale",
            "config": {"loss_scale_value": 2.0},
        },
    }
    assert keras.dtype_policies.serialize(kdp.Policy("mixed_bfloat16"))[
        "config"
    ] == {"name": "mixed_bfloat16"}
    # Keras' own deserialization gives the 2.4+ policy, and says the loss
    # scale is dropped (tf.keras 2.4+ did likewise; listed in the README).
    with pytest.warns(UserWarning, match="loss scale"):
        revived = keras.dtype_policies.deserialize(config)
    assert revived == mixed_precision.Policy("mixed_float16")
    assert not isinstance(revived, kdp.Policy)


@LEGACY
def test_experimental_policy_keeps_its_default_loss_scale():
    assert kdp.Policy("mixed_float16").loss_scale == DynamicLossScale()
    assert mixed_precision.experimental.Policy("float32").loss_scale is None
