"""This package's policy names wherever Keras takes a dtype.

With the package imported, Keras' public lookups (`keras.dtype_policies.get`,
`keras.config.set_dtype_policy` and their `keras.mixed_precision`
spellings; tf.keras' modules are these) and a layer's `dtype=` give this
package's names their `keras_dtype_policy.DTypePolicy`; Keras' own names
give what Keras alone gives, unknown names Keras' own error, and
`uninstall()` brings Keras' behaviour back. A float8 policy set on a model
whose float8 layers already train in float8 gives the model its source
policy, where Keras would quantize those layers again.
"""

import keras
import numpy as np
import pytest

import keras_dtype_policy as kdp
from keras_dtype_policy.policies import names
from keras_dtype_policy.policies.float8 import Float8SourcePolicy

PACKAGE_NAMES = sorted(names.LOW_PRECISION_UPDATE_POLICIES)
KERAS_NAMES = [
    "float32",
    "bfloat16",
    "float16",
    "mixed_float16",
    "mixed_bfloat16",
    "float8_from_mixed_bfloat16",
    "float8_from_float32",
    "int8_from_float32",
    "int4_from_mixed_bfloat16",
]
UNKNOWN_NAMES = ["kahan_float32", "stochastic_bfloat8", "nonsense"]
FLOAT8 = "float8_from_mixed_bfloat16"

GETS = {
    "keras.dtype_policies.get": lambda: keras.dtype_policies.get,
}
SETTERS = {
    "keras.config.set_dtype_policy": lambda: keras.config.set_dtype_policy,
    "keras.mixed_precision.set_dtype_policy": (
        lambda: keras.mixed_precision.set_dtype_policy
    ),
    "keras.mixed_precision.set_global_policy": (
        lambda: keras.mixed_precision.set_global_policy
    ),
}


def looked_up(name):
    """What each lookup, setter and `Dense(dtype=)` gives for `name`:
    `(type, name, compute dtype, variable dtype)` or the error's type and
    message."""

    def describe(make):
        try:
            policy = make()
        except Exception as error:
            return type(error), str(error)
        return (
            type(policy),
            policy.name,
            policy.compute_dtype,
            policy.variable_dtype,
        )

    def set_then_read(setter):
        try:
            setter(name)
            return keras.config.dtype_policy()
        finally:
            keras.config.set_dtype_policy("float32")

    found = {}
    for spelling, get in GETS.items():
        found[spelling] = describe(lambda get=get: get()(name))
    for spelling, setter in SETTERS.items():
        found[spelling] = describe(
            lambda setter=setter: set_then_read(setter())
        )
    found["Dense(dtype=)"] = describe(
        lambda: keras.layers.Dense(4, dtype=name).dtype_policy
    )
    return found


def keras_alone(function, *args):
    kdp.uninstall()
    try:
        return function(*args)
    finally:
        kdp.install()


@pytest.mark.parametrize("name", PACKAGE_NAMES)
@pytest.mark.parametrize("spelling", sorted(GETS))
def test_get_gives_the_packages_policy(spelling, name):
    policy = GETS[spelling]()(name)
    assert type(policy) is kdp.DTypePolicy
    assert policy == kdp.DTypePolicy(name)
    expected = kdp.DTypePolicy(name)
    assert (policy.compute_dtype, policy.variable_dtype) == (
        expected.compute_dtype,
        expected.variable_dtype,
    )


@pytest.mark.parametrize("name", PACKAGE_NAMES)
@pytest.mark.parametrize("spelling", sorted(SETTERS))
def test_set_dtype_policy_sets_the_packages_policy(spelling, name):
    SETTERS[spelling]()(name)
    assert type(keras.config.dtype_policy()) is kdp.DTypePolicy
    assert keras.config.dtype_policy() == kdp.DTypePolicy(name)
    assert kdp.dtype_policy() == kdp.DTypePolicy(name)
    layer = keras.layers.Dense(4)
    assert layer.dtype_policy == kdp.DTypePolicy(name)


@pytest.mark.parametrize("name", PACKAGE_NAMES)
def test_a_layer_takes_the_name(name):
    layer = keras.layers.Dense(4, dtype=name)
    assert type(layer.dtype_policy) is kdp.DTypePolicy
    assert layer.dtype_policy == kdp.DTypePolicy(name)
    layer.build((None, 3))
    dtype = names.LOW_PRECISION_UPDATE_POLICIES[name][0]
    assert layer.kernel.dtype == dtype
    assert keras.ops.convert_to_numpy(layer(np.ones((2, 3)))).shape == (2, 4)


@pytest.mark.parametrize("name", KERAS_NAMES)
def test_keras_names_give_what_keras_alone_gives(name):
    assert looked_up(name) == keras_alone(looked_up, name)


@pytest.mark.parametrize("name", UNKNOWN_NAMES)
def test_unknown_names_keep_keras_error(name):
    # The layers' lookup (`keras.src.dtype_policies.get`, patched for
    # tf.keras' names) adds the received dtype to Keras' message.
    found, alone = looked_up(name), keras_alone(looked_up, name)
    assert found.keys() == alone.keys()
    for spelling, (error_type, message) in alone.items():
        assert error_type is ValueError
        assert found[spelling][0] is error_type, spelling
        assert found[spelling][1].startswith(message), spelling
    with pytest.raises(ValueError, match="Cannot convert"):
        keras.dtype_policies.get(name)
    with pytest.raises(ValueError, match="Cannot convert"):
        keras.config.set_dtype_policy(name)
    assert keras.config.dtype_policy().name == "float32"


def test_other_identifiers_give_what_keras_alone_gives():
    identifiers = [
        None,
        {"class_name": "DTypePolicy", "config": {"name": "mixed_bfloat16"}},
        keras.DTypePolicy("float16"),
    ]
    for identifier in identifiers:
        assert keras.dtype_policies.get(identifier) == keras_alone(
            keras.dtype_policies.get, identifier
        )


@pytest.mark.parametrize("name", PACKAGE_NAMES)
def test_uninstall_brings_keras_behaviour_back(name):
    kdp.uninstall()
    try:
        for get in GETS.values():
            with pytest.raises(ValueError, match="Cannot convert"):
                get()(name)
        for setter in SETTERS.values():
            with pytest.raises(ValueError, match="Cannot convert"):
                setter()(name)
    finally:
        kdp.install()
    assert keras.dtype_policies.get(name) == kdp.DTypePolicy(name)
    keras.config.set_dtype_policy(name)
    assert keras.config.dtype_policy() == kdp.DTypePolicy(name)


def float8_model():
    """A model whose float8 layers were made with the float8 `dtype`, as a
    keras-hub backbone makes its layers."""
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(8, dtype=FLOAT8)(inputs)
    hidden = keras.layers.LayerNormalization(dtype=FLOAT8)(hidden)
    outputs = keras.layers.Dense(2, dtype=FLOAT8)(hidden)
    return keras.Model(inputs, outputs)


def test_a_float8_model_takes_its_float8_policy_without_a_second_quantize():
    model = float8_model()
    model.dtype_policy = FLOAT8
    assert isinstance(model.dtype_policy, Float8SourcePolicy)
    assert model.dtype_policy.float8_policy.name == FLOAT8
    modes = [layer.quantization_mode for layer in model.layers[1:]]
    assert modes == ["float8", None, "float8"]
    outputs = model(np.ones((4, 8), "float32"))
    assert keras.ops.convert_to_numpy(outputs).shape == (4, 2)


def test_keras_alone_quantizes_the_float8_model_again():
    def set_policy():
        with pytest.raises(ValueError, match="already quantized"):
            float8_model().dtype_policy = FLOAT8

    keras_alone(set_policy)


def test_a_float_model_given_a_float8_policy_is_quantized_as_by_keras():
    def quantized_modes():
        inputs = keras.Input((8,))
        outputs = keras.layers.Dense(2)(keras.layers.Dense(8)(inputs))
        model = keras.Model(inputs, outputs)
        model.dtype_policy = FLOAT8
        return (
            type(model.dtype_policy),
            [layer.dtype_policy.name for layer in model.layers[1:]],
        )

    assert quantized_modes() == keras_alone(quantized_modes)
    assert quantized_modes()[1] == ["float8_from_float32"] * 2
