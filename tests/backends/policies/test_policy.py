"""DTypePolicy: names, properties, equality, hashing, copies and errors."""

import copy
import pickle

import keras
import pytest

from keras_dtype_policy import DTypePolicy

NAME_CASES = [
    ("float16", "float16", "float16"),
    ("bfloat16", "bfloat16", "bfloat16"),
    ("float32", "float32", "float32"),
    ("float64", "float64", "float64"),
    ("mixed_float16", "float16", "float32"),
    ("mixed_bfloat16", "bfloat16", "float32"),
    ("int32", "int32", "int32"),
    ("bool", "bool", "bool"),
]


@pytest.mark.parametrize("name, compute_dtype, variable_dtype", NAME_CASES)
def test_names_give_compute_and_variable_dtypes(
    name, compute_dtype, variable_dtype
):
    policy = DTypePolicy(name)
    assert policy.name == name
    assert policy.compute_dtype == compute_dtype
    assert policy.variable_dtype == variable_dtype
    assert policy.quantization_mode is None
    keras_policy = keras.DTypePolicy(name)
    assert (policy.compute_dtype, policy.variable_dtype) == (
        keras_policy.compute_dtype,
        keras_policy.variable_dtype,
    )


def test_none_takes_the_global_policy_name():
    keras.config.set_dtype_policy("mixed_bfloat16")
    assert DTypePolicy().name == "mixed_bfloat16"
    assert DTypePolicy(None).compute_dtype == "bfloat16"


def test_is_a_keras_policy_that_layers_accept():
    policy = DTypePolicy("mixed_float16")
    assert isinstance(policy, keras.DTypePolicy)
    layer = keras.layers.Dense(3, dtype=policy)
    assert layer.dtype_policy is policy
    assert layer.compute_dtype == "float16"
    assert layer.variable_dtype == "float32"


@pytest.mark.parametrize(
    "attribute", ["name", "compute_dtype", "variable_dtype"]
)
def test_properties_are_read_only(attribute):
    policy = DTypePolicy("mixed_float16")
    with pytest.raises(AttributeError):
        setattr(policy, attribute, "float32")
    assert policy.name == "mixed_float16"


@pytest.mark.parametrize("name", ["mixed_float16", "float32", "bfloat16"])
def test_repr_matches_keras(name):
    assert repr(DTypePolicy(name)) == f'<DTypePolicy "{name}">'
    assert repr(DTypePolicy(name)) == repr(keras.DTypePolicy(name))


def test_equality_by_name_in_both_directions():
    ours = DTypePolicy("mixed_float16")
    assert ours == DTypePolicy("mixed_float16")
    assert ours == keras.DTypePolicy("mixed_float16")
    assert keras.DTypePolicy("mixed_float16") == ours
    assert ours == keras.dtype_policies.FloatDTypePolicy("mixed_float16")
    assert not ours != keras.DTypePolicy("mixed_float16")
    assert ours != DTypePolicy("mixed_bfloat16")
    assert keras.DTypePolicy("float32") != ours
    assert ours != "mixed_float16"


def test_keras_float_alias_decides_its_own_direction():
    # FloatDTypePolicy is not a base class of ours, so Python asks Keras'
    # __eq__ first, and Keras compares only its own two classes.
    alias = keras.dtype_policies.FloatDTypePolicy("mixed_float16")
    assert (alias == DTypePolicy("mixed_float16")) is False
    assert DTypePolicy("mixed_float16") == alias


def test_not_equal_to_policies_of_another_kind():
    ours = DTypePolicy("float32")
    quantized = keras.dtype_policies.QuantizedDTypePolicy("int8", "float32")
    policy_map = keras.dtype_policies.DTypePolicyMap(default_policy="float32")
    assert ours != quantized
    assert quantized != ours
    assert ours != policy_map


def test_hashable_and_usable_as_dict_keys():
    table = {
        DTypePolicy("mixed_float16"): "half",
        DTypePolicy("float32"): "full",
    }
    assert table[DTypePolicy("mixed_float16")] == "half"
    assert len({DTypePolicy("float32"), DTypePolicy("float32")}) == 1
    assert hash(DTypePolicy("bfloat16")) == hash(DTypePolicy("bfloat16"))


@pytest.mark.parametrize(
    "duplicate",
    [copy.copy, copy.deepcopy, lambda p: pickle.loads(pickle.dumps(p))],
    ids=["copy", "deepcopy", "pickle"],
)
def test_copies_are_equal(duplicate):
    policy = DTypePolicy("mixed_bfloat16")
    duplicated = duplicate(policy)
    assert type(duplicated) is DTypePolicy
    assert duplicated == policy
    assert duplicated.compute_dtype == "bfloat16"
    assert duplicated.variable_dtype == "float32"


@pytest.mark.parametrize(
    "name", [1, 16.0, True, b"float32", ["float32"], object()]
)
def test_non_string_name_is_a_type_error(name):
    # Keras' own wording first, as in keras.DTypePolicy.
    with pytest.raises(TypeError, match="^'name' must be a string") as info:
        DTypePolicy(name)
    assert "Received: name=" in str(info.value)


@pytest.mark.parametrize(
    "name",
    ["mixed_float32", "float33", "", "mixed", "Float16 ", "int8_from_float32"],
)
def test_unknown_name_is_a_value_error_listing_accepted_forms(name):
    with pytest.raises(ValueError) as info:
        DTypePolicy(name)
    message = str(info.value)
    # Keras' own wording first, as in keras.DTypePolicy.
    assert message.startswith(f"Cannot convert {name!r}")
    with pytest.raises(ValueError, match="^Cannot convert"):
        keras.DTypePolicy(name)
    assert "'mixed_float16', 'mixed_bfloat16'" in message
    assert f"Received: name={name!r}" in message


def test_config_round_trip():
    policy = DTypePolicy("mixed_float16")
    assert policy.get_config() == {"name": "mixed_float16"}
    assert DTypePolicy.from_config(policy.get_config()) == policy
