"""The loss-scale values of the tf.keras API and get_loss_scale."""

import math

import pytest

from keras_dtype_policy import DynamicLossScale
from keras_dtype_policy import FixedLossScale
from keras_dtype_policy import get_loss_scale
from keras_dtype_policy.loss_scaling.loss_scale import deserialize_loss_scale
from keras_dtype_policy.loss_scaling.loss_scale import serialize_loss_scale


def test_fixed_loss_scale():
    scale = FixedLossScale(1024)
    assert scale.initial_scale == 1024.0
    assert not scale.dynamic
    assert scale.get_config() == {"loss_scale_value": 1024.0}
    assert FixedLossScale.from_config(scale.get_config()) == scale
    assert repr(scale) == "FixedLossScale(loss_scale_value=1024.0)"


def test_dynamic_loss_scale_defaults_are_the_seeds():
    scale = DynamicLossScale()
    assert scale.dynamic
    assert scale.get_config() == {
        "initial_loss_scale": 2.0**15,
        "increment_period": 2000,
        "multiplier": 2.0,
    }
    assert DynamicLossScale.from_config(scale.get_config()) == scale
    assert DynamicLossScale(4, 10, 3.0).initial_scale == 4.0


def test_values_compare_and_hash_by_config():
    assert FixedLossScale(8) == FixedLossScale(8.0)
    assert FixedLossScale(8) != FixedLossScale(16)
    assert FixedLossScale(8) != DynamicLossScale(8)
    assert len({DynamicLossScale(), DynamicLossScale()}) == 1


@pytest.mark.parametrize(
    "spec, expected",
    [
        (None, None),
        (1024, FixedLossScale(1024)),
        (0.5, FixedLossScale(0.5)),
        ("dynamic", DynamicLossScale()),
        (DynamicLossScale(8, 5), DynamicLossScale(8, 5)),
        (
            {
                "class_name": "FixedLossScale",
                "config": {"loss_scale_value": 64},
            },
            FixedLossScale(64),
        ),
        (
            {
                "class_name": "DynamicLossScale",
                "config": {
                    "initial_loss_scale": 256.0,
                    "increment_period": 100,
                    "multiplier": 4.0,
                },
            },
            DynamicLossScale(256, 100, 4.0),
        ),
    ],
)
def test_get_loss_scale_accepts_every_spec(spec, expected):
    assert get_loss_scale(spec) == expected


def test_a_loss_scale_object_is_used_as_it_is():
    scale = FixedLossScale(2)
    assert get_loss_scale(scale) is scale


@pytest.mark.parametrize("scale", [FixedLossScale(3), DynamicLossScale(16, 7)])
def test_legacy_serialized_form_round_trip(scale):
    config = serialize_loss_scale(scale)
    assert config == {
        "class_name": type(scale).__name__,
        "config": scale.get_config(),
    }
    assert deserialize_loss_scale(config) == scale
    assert serialize_loss_scale(None) is None


@pytest.mark.parametrize(
    "spec, error",
    [
        (True, TypeError),
        ([1024], TypeError),
        (object(), TypeError),
        ("auto", ValueError),
        ("static", ValueError),
        (0, ValueError),
        (-2.0, ValueError),
        (math.inf, ValueError),
        (math.nan, ValueError),
        ({"class_name": "Unknown", "config": {}}, ValueError),
        ({"class_name": "FixedLossScale", "config": {}}, ValueError),
        ({"class_name": "FixedLossScale", "config": {"x": 1}}, ValueError),
        ({"class_name": "FixedLossScale", "config": [1]}, TypeError),
    ],
)
def test_bad_specs_raise_naming_the_value(spec, error):
    with pytest.raises(error, match="Received"):
        get_loss_scale(spec)


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        ({"initial_loss_scale": 0}, "initial_loss_scale"),
        ({"increment_period": 0}, "increment_period"),
        ({"increment_period": 2.5}, "increment_period"),
        ({"multiplier": 1.0}, "multiplier"),
        ({"multiplier": "2"}, "multiplier"),
    ],
)
def test_dynamic_loss_scale_checks_its_arguments(kwargs, argument):
    with pytest.raises((TypeError, ValueError), match=f"{argument}="):
        DynamicLossScale(**kwargs)
