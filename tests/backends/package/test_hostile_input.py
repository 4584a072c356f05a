"""Hostile input: every input gives a valid policy or a clear error.

Property-based (hypothesis) over policy names, loss-scale specs and whole
configs. The only errors allowed are TypeError and ValueError, and their
message must show the bad value; a policy that comes back must be the one
the input named.
"""

import keras
import numpy as np
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import keras_dtype_policy as kdp
from keras_dtype_policy import DTypePolicy
from keras_dtype_policy import LossScale
from keras_dtype_policy import Policy
from keras_dtype_policy import get_loss_scale
from keras_dtype_policy.policies import names as policy_names
from keras_dtype_policy.tf_keras_compat.legacy_policy import INFER_POLICIES

SETTINGS = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
KNOWN_NAMES = [
    "mixed_float16",
    "mixed_bfloat16",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "int32",
    "bool",
    "infer",
    "_infer",
    "infer_with_float32_vars",
    "float16_with_float32_vars",
    "int8_from_float32",
]
names = st.one_of(
    st.sampled_from(KNOWN_NAMES),
    st.text(max_size=20),
    st.sampled_from(KNOWN_NAMES).map(lambda n: n.upper()),
    st.sampled_from(KNOWN_NAMES).map(lambda n: f" {n}"),
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["dynamic", "auto", "float32", "mixed_float16"]),
)
json_values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.text(max_size=12), children, max_size=4),
    ),
    max_leaves=12,
)
loss_scale_configs = st.fixed_dictionaries(
    {
        "class_name": st.one_of(
            st.sampled_from(["FixedLossScale", "DynamicLossScale"]), st.text()
        ),
        "config": st.one_of(
            json_values,
            st.dictionaries(
                st.sampled_from(
                    [
                        "loss_scale_value",
                        "initial_loss_scale",
                        "increment_period",
                        "multiplier",
                        "other",
                    ]
                ),
                scalars,
                max_size=4,
            ),
        ),
    }
)
loss_scale_specs = st.one_of(json_values, loss_scale_configs)
policy_configs = st.one_of(
    json_values,
    st.fixed_dictionaries(
        {
            "class_name": st.sampled_from(
                ["Policy", "PolicyV1", "DTypePolicy", "Nonexistent", ""]
            ),
            "config": st.one_of(
                json_values,
                st.fixed_dictionaries(
                    {"name": names},
                    optional={"loss_scale": loss_scale_specs, "extra": scalars},
                ),
            ),
        },
        optional={
            "module": st.sampled_from(
                ["keras", "keras.mixed_precision", "os", "keras_dtype_policy"]
            ),
            "registered_name": st.sampled_from(
                [None, "keras_dtype_policy>DTypePolicy", "Policy"]
            ),
        },
    ),
)


def assert_clear_error(error, value):
    assert isinstance(error, (TypeError, ValueError)), repr(error)
    assert "Received" in str(error) or repr(value)[:20] in str(error), str(
        error
    )


def check_policy_named(policy, name):
    compute, variable = policy_names.parse_policy_name(name)
    assert policy.name == name
    assert (policy.compute_dtype, policy.variable_dtype) == (compute, variable)


@SETTINGS
@given(name=st.one_of(names, scalars))
def test_dtype_policy_names(name):
    if name is None:
        return  # None is the global policy's name; tested elsewhere.
    try:
        policy = DTypePolicy(name)
    except Exception as error:  # noqa: BLE001 - the property itself
        assert_clear_error(error, name)
        return
    check_policy_named(policy, name)


@SETTINGS
@given(name=names, loss_scale=st.one_of(st.just("auto"), loss_scale_specs))
def test_legacy_policy_names_and_loss_scales(name, loss_scale):
    try:
        policy = Policy.create(name, loss_scale)
    except Exception as error:  # noqa: BLE001
        assert_clear_error(error, loss_scale)
        return
    assert policy.name == name
    assert policy.loss_scale is None or isinstance(policy.loss_scale, LossScale)


@SETTINGS
@given(spec=loss_scale_specs)
def test_loss_scale_specs(spec):
    try:
        loss_scale = get_loss_scale(spec)
    except Exception as error:  # noqa: BLE001
        assert_clear_error(error, spec)
        return
    assert loss_scale is None or isinstance(loss_scale, LossScale)
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        assert loss_scale.initial_scale == float(spec)
    if loss_scale is not None:
        assert np.isfinite(loss_scale.initial_scale)
        assert loss_scale.initial_scale > 0


@SETTINGS
@given(config=policy_configs)
def test_whole_policy_configs(config):
    inner = config.get("config") if isinstance(config, dict) else None
    reads = [
        (lambda c: keras.layers.Dense(2, dtype=c).dtype_policy, config),
        (DTypePolicy.from_config, inner),
        (Policy.from_config, inner),
    ]
    for read, value in reads:
        try:
            policy = read(value)
        except Exception as error:  # noqa: BLE001
            assert_clear_error(error, value)
            continue
        assert isinstance(policy, keras.DTypePolicy)
        name = inner.get("name") if isinstance(inner, dict) else None
        if isinstance(name, str) and value is not None:
            assert policy.name == name or (
                name in INFER_POLICIES and policy.infers
            )


@SETTINGS
@given(policy=st.one_of(names, scalars))
def test_set_dtype_policy_leaves_the_global_alone_on_error(policy):
    kdp.set_dtype_policy("mixed_bfloat16")
    try:
        kdp.set_dtype_policy(policy)
    except Exception as error:  # noqa: BLE001
        assert_clear_error(error, policy)
        assert kdp.dtype_policy().name == "mixed_bfloat16"
    finally:
        kdp.set_dtype_policy("float32")
