"""tf.keras 2's policy API, as tf-keras' own tests pin it down.

The facts of tf-keras' policy, get_layer_policy and layer tests that can
exist on Keras 3, checked on every backend (they hold alike on all three).
"""

import warnings

import keras
import numpy as np
import pytest
from testing import to_numpy

import keras_dtype_policy as kdp
from keras_dtype_policy import experimental
from keras_dtype_policy import mixed_precision
from keras_dtype_policy.loss_scaling.loss_scale import DynamicLossScale
from keras_dtype_policy.loss_scaling.loss_scale import FixedLossScale

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

LOSS_SCALE_WARNING = "Creating a Policy with a loss scale is only useful"


@pytest.mark.parametrize(
    "name, compute, variable",
    [
        ("float32", "float32", "float32"),
        ("float16", "float16", "float16"),
        ("mixed_float16", "float16", "float32"),
        ("mixed_bfloat16", "bfloat16", "float32"),
        ("_infer", None, None),
    ],
)
def test_policy_dtypes(name, compute, variable):
    policy = kdp.Policy(name)
    assert (policy.name, policy.compute_dtype, policy.variable_dtype) == (
        name,
        compute,
        variable,
    )


def test_policy_bad_names():
    with pytest.raises(ValueError):
        kdp.Policy("not_a_dtype")
    with pytest.raises(TypeError):
        kdp.Policy(1)


def test_infer_policy_on_both_classes_takes_the_input_dtype():
    for policy_class in (kdp.Policy, experimental.Policy):
        layer = keras.layers.Dense(2, dtype=policy_class("_infer"))
        out = layer(np.ones((1, 3), dtype="float16"))
        assert keras.backend.standardize_dtype(out.dtype) == "float16"
        assert layer.dtype_policy.compute_dtype == "float16"


def test_default_loss_scales():
    assert kdp.Policy("float32").loss_scale is None
    assert kdp.Policy("mixed_bfloat16").loss_scale is None
    assert kdp.Policy("mixed_float16").loss_scale == DynamicLossScale()
    assert kdp.Policy("mixed_float16", loss_scale=None).loss_scale is None
    assert kdp.Policy("mixed_float16", loss_scale=2.0).loss_scale == (
        FixedLossScale(2.0)
    )


def test_loss_scale_on_a_non_float16_policy_warns_in_tf_keras_words():
    with pytest.warns(UserWarning, match=LOSS_SCALE_WARNING) as record:
        kdp.Policy("float32", loss_scale=2.0)
    messages = [str(w.message) for w in record]
    assert messages[-1] == (
        "Creating a Policy with a loss scale is only useful for float16 "
        "policies. You passed loss_scale=2.0 for policy float32. Consider "
        "not passing any loss_scale instead."
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kdp.Policy("float16", loss_scale=2.0)
        kdp.Policy("mixed_float16", loss_scale=2.0)
        kdp.Policy("float32")
    assert not [w for w in caught if LOSS_SCALE_WARNING in str(w.message)]


def test_config_leaves_a_default_loss_scale_out():
    assert kdp.Policy("mixed_float16").get_config() == {"name": "mixed_float16"}
    assert kdp.Policy("float32").get_config() == {"name": "float32"}
    assert kdp.Policy("mixed_float16", loss_scale=None).get_config() == {
        "name": "mixed_float16",
        "loss_scale": None,
    }
    assert kdp.Policy("mixed_float16", loss_scale=2.0).get_config() == {
        "name": "mixed_float16",
        "loss_scale": {
            "class_name": "FixedLossScale",
            "config": {"loss_scale_value": 2.0},
        },
    }


@pytest.mark.parametrize(
    "policy",
    [
        ("mixed_float16",),
        ("mixed_float16", None),
        ("float16", 4.0),
        ("mixed_float16", DynamicLossScale(8.0, 10, 4.0)),
        ("_infer",),
    ],
)
def test_config_round_trip(policy):
    original = kdp.Policy(*policy)
    revived = kdp.Policy.from_config(original.get_config())
    assert revived == original
    assert revived.get_config() == original.get_config()


def test_global_policy_set_and_restored():
    assert kdp.global_policy().name == "float32"
    kdp.set_global_policy("mixed_float16")
    assert kdp.global_policy().name == "mixed_float16"
    policy = kdp.Policy("mixed_bfloat16")
    experimental.set_policy(policy)
    assert experimental.global_policy() is policy
    kdp.set_policy(None)
    assert kdp.global_policy().name == keras.config.floatx()


@pytest.mark.parametrize("policy", ["int32", "complex64", "bool"])
def test_global_policy_must_be_floating(policy):
    with pytest.raises(ValueError) as error:
        experimental.set_policy(policy)
    assert str(error.value) == (
        "set_global_policy can only be used to set the global policy to "
        'floating-point policies, such as "float32" and "mixed_float16", '
        f"but got policy: {policy}"
    )
    assert kdp.global_policy().name == "float32"


@pytest.mark.parametrize("name", ["_infer", "infer"])
def test_scope_and_setter_take_infer_names(name):
    with kdp.policy_scope(name):
        assert kdp.global_policy().name == name
        layer = keras.layers.Dense(2)
    assert kdp.global_policy().name == "float32"
    layer(np.ones((1, 3), dtype="float16"))
    assert layer.compute_dtype == "float16"
    kdp.set_dtype_policy(name)
    assert kdp.global_policy().name == name


def test_get_layer_policy():
    layer = keras.layers.Dense(2, dtype="mixed_float16")
    assert kdp.get_layer_policy(layer) is layer.dtype_policy
    assert experimental.get_layer_policy(layer).name == "mixed_float16"
    with kdp.policy_scope("mixed_bfloat16"):
        assert kdp.get_layer_policy(keras.layers.Dense(2)).name == (
            "mixed_bfloat16"
        )
    with pytest.raises(ValueError, match="get_policy can only be called on"):
        kdp.get_layer_policy(1)


@pytest.mark.parametrize("name", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_layer_casts_inputs_and_keeps_float32_variables(name):
    layer = keras.layers.Dense(2, dtype=kdp.Policy(name))
    out = layer(np.ones((1, 3), dtype="float32"))
    compute = name.removeprefix("mixed_")
    assert keras.backend.standardize_dtype(out.dtype) == compute
    assert all(v.dtype == "float32" for v in layer.weights)
    np.testing.assert_allclose(
        to_numpy(out).astype("float32"),
        np.ones((1, 3)) @ to_numpy(layer.kernel) + to_numpy(layer.bias),
        rtol=1e-2,
        atol=1e-2,
    )


def test_policy_loss_scale_reaches_compile():
    with kdp.policy_scope(kdp.Policy("mixed_float16", loss_scale=64.0)):
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    assert model.optimizer.dynamic is False
    assert model.optimizer.loss_scale == 64.0


# tf-keras' layer_test with a V1 (experimental) policy: the layer's config
# holds the policy's name and loss scale; a layer revived from it has
# tf.keras 2.4+'s `Policy` of that name (the loss scale dropped, as
# tf.keras 2.4+ dropped it), and shows as that `Policy`.

FIXED_2 = {"class_name": "FixedLossScale", "config": {"loss_scale_value": 2.0}}


@pytest.mark.filterwarnings("ignore:The policy:UserWarning")
@pytest.mark.parametrize("loss_scale, saved", [(None, None), (2.0, FIXED_2)])
def test_layer_config_with_an_experimental_policy(loss_scale, saved):
    policy = experimental.Policy("mixed_float16", loss_scale=loss_scale)
    layer = keras.layers.Dense(2, dtype=policy)
    dtype = layer.get_config()["dtype"]
    # tf.keras 2.4+ wrote class_name "PolicyV1"; Keras 3 names the class.
    assert dtype["registered_name"] == "keras_dtype_policy>Policy"
    assert dtype["config"] == {"name": "mixed_float16", "loss_scale": saved}
    revived = keras.layers.Dense.from_config(layer.get_config())
    assert type(revived.dtype_policy) is mixed_precision.Policy
    assert repr(revived.dtype_policy) == '<Policy "mixed_float16">'
    out = revived(np.ones((1, 3), dtype="float32"))
    assert keras.backend.standardize_dtype(out.dtype) == "float16"
    assert revived.kernel.dtype == "float32"
    again = revived.get_config()["dtype"]
    assert again["registered_name"] == (
        "keras_dtype_policy>mixed_precision.Policy"
    )
    assert again["config"] == {"name": "mixed_float16"}


INFER_V1_CONFIGS = {
    "tf_keras": {
        "class_name": "PolicyV1",
        "config": {"name": "_infer", "loss_scale": FIXED_2},
    },
    "tf_keras_2_13": {
        "module": "keras.mixed_precision",
        "class_name": "PolicyV1",
        "config": {"name": "_infer", "loss_scale": None},
        "registered_name": None,
    },
    "this_package": keras.dtype_policies.serialize(
        experimental.Policy.create("_infer", loss_scale=2.0)
    ),
}


@pytest.mark.filterwarnings("ignore:The policy:UserWarning")
@pytest.mark.parametrize("key", sorted(INFER_V1_CONFIGS))
def test_an_infer_v1_policy_revives_as_the_2_4_policy(key):
    # The `"_infer"` case of tf-keras' test_from_config_policy_v1: the
    # layer infers its dtype from its first input, with tf.keras 2.4+'s
    # `Policy`, shown as `<Policy "float16">` once it has inferred.
    config = keras.layers.Dense(2).get_config()
    config["dtype"] = INFER_V1_CONFIGS[key]
    layer = keras.layers.Dense.from_config(config)
    assert type(layer.dtype_policy) is mixed_precision.Policy
    assert layer.dtype_policy.compute_dtype is None
    out = layer(np.ones((1, 3), dtype="float16"))
    assert keras.backend.standardize_dtype(out.dtype) == "float16"
    assert layer.kernel.dtype == "float16"
    assert repr(layer.dtype_policy) == '<Policy "float16">'
    again = keras.layers.Dense.from_config(config)
    assert repr(again.dtype_policy) == '<Policy "_infer">'
    assert again.dtype_policy is not layer.dtype_policy


def test_an_infer_name_gives_the_2_4_policy():
    # tf.keras 2.4+: `dtype="_infer"` built its non-experimental `Policy`.
    layer = keras.layers.Dense(2, dtype="_infer")
    assert type(layer.dtype_policy) is mixed_precision.Policy
    layer(np.ones((1, 3), dtype="float16"))
    assert repr(layer.dtype_policy) == '<Policy "float16">'


def test_experimental_from_config_keeps_the_class_and_tf_2_3_repr():
    # TensorFlow 2.3's `Policy.from_config` (and tf.keras 2.4+'s
    # `PolicyV1.from_config`) kept the experimental class and its scale.
    policy = experimental.Policy("float16", loss_scale=None)
    revived = experimental.Policy.from_config(policy.get_config())
    assert type(revived) is experimental.Policy
    assert repr(revived) == '<Policy "float16", loss_scale=None>'
    assert repr(policy) == repr(revived)
