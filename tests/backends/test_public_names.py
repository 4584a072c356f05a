"""One name, one meaning: the top level's names and their aliases.

Keras 3's names and meanings at the top level; tf.keras' in their
namespaces (`mixed_precision`: tf.keras 2.4+; `experimental`, also
`mixed_precision.experimental`: TensorFlow 2.3). A top-level name kept for
tf.keras code is the same object as its namespace's (docs/
tf-keras-migration.md lists them), and every spelling of before still runs.
"""

import warnings

import keras
import pytest

import keras_dtype_policy as kdp
from keras_dtype_policy import experimental
from keras_dtype_policy import mixed_precision
from keras_dtype_policy.policies import hardware
from keras_dtype_policy.policies.hardware import Device

LEGACY = pytest.mark.filterwarnings("ignore::DeprecationWarning")
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    SCALED = kdp.Policy("mixed_float16", loss_scale=1024)

# (alias, the object it is), as paths under the package.
ALIASES = [
    ("global_policy", "dtype_policy"),
    ("Policy", "experimental.Policy"),
    ("set_policy", "experimental.set_policy"),
    ("get_layer_policy", "experimental.get_layer_policy"),
    ("experimental.global_policy", "dtype_policy"),
    ("experimental.DynamicLossScale", "DynamicLossScale"),
    ("experimental.FixedLossScale", "FixedLossScale"),
    ("mixed_precision.experimental", "experimental"),
    ("mixed_precision.LossScaleOptimizer", "LossScaleOptimizer"),
]


def _resolve(path):
    """The object at `path` under the package."""
    value = kdp
    for part in path.split("."):
        value = getattr(value, part)
    return value


@pytest.mark.parametrize("alias, target", ALIASES, ids=[a for a, _ in ALIASES])
def test_each_alias_is_its_namespaces_object(alias, target):
    assert _resolve(alias) is _resolve(target)


def test_the_top_level_follows_keras_3s_own_aliases():
    # Keras 3: keras.mixed_precision's global-policy names are
    # keras.config's functions; the package does the same.
    assert keras.mixed_precision.global_policy is keras.config.dtype_policy
    assert (
        keras.mixed_precision.set_global_policy is keras.config.set_dtype_policy
    )
    assert kdp.global_policy is kdp.dtype_policy
    # set_global_policy is set_dtype_policy that also takes None (tf.keras
    # took it; Keras' set_dtype_policy refuses it, and so does the
    # package's, so Keras' own tests pass when pointed at the package).
    kdp.set_global_policy("mixed_bfloat16")
    assert kdp.dtype_policy() == keras.DTypePolicy("mixed_bfloat16")
    kdp.set_global_policy(None)
    assert kdp.dtype_policy() == kdp.DTypePolicy(keras.config.floatx())
    with pytest.raises(ValueError, match="Invalid `policy` argument"):
        kdp.set_dtype_policy(None)


def test_all_lists_keras_3_names_and_the_packages_own():
    for name in ("Policy", "set_policy", "get_layer_policy"):
        assert name not in kdp.__all__
        assert hasattr(kdp, name)
    for name in (
        "dtype_policy",
        "set_dtype_policy",
        "global_policy",
        "shard_optimizer_state",
        "plan",
        "save_for_keras",
        "export_for_serving",
    ):
        assert name in kdp.__all__
    assert all(hasattr(kdp, name) for name in kdp.__all__)
    assert len(set(kdp.__all__)) == len(kdp.__all__)


def test_the_top_level_global_policy_is_keras_3s():
    kdp.set_global_policy("mixed_float16")
    assert type(kdp.global_policy()) is type(kdp.dtype_policy())
    assert type(kdp.global_policy()) is kdp.DTypePolicy
    assert kdp.global_policy() is keras.config.dtype_policy()


def test_mixed_precision_global_policy_is_tf_keras_2_4s():
    kdp.set_global_policy("mixed_float16")
    policy = mixed_precision.global_policy()
    assert type(policy) is mixed_precision.Policy
    assert not isinstance(policy, kdp.Policy)
    assert repr(policy) == '<Policy "mixed_float16">'
    assert policy == kdp.global_policy()


def test_non_float_names_follow_keras_at_the_top_level_only():
    # As keras.mixed_precision.set_global_policy does, the top level takes
    # any Keras policy name; tf.keras' names keep tf.keras' refusal.
    kdp.set_global_policy("int32")
    assert kdp.global_policy().name == "int32"
    for tf_keras_setter in (
        experimental.set_policy,
        mixed_precision.set_global_policy,
    ):
        with pytest.raises(ValueError, match="got policy: bool"):
            tf_keras_setter("bool")
    assert kdp.global_policy().name == "int32"


@LEGACY
@pytest.mark.parametrize(
    "setter",
    [kdp.set_global_policy, kdp.set_policy],
    ids=["set_global_policy", "set_policy"],
)
@pytest.mark.parametrize(
    "policy, name",
    [
        ("mixed_float16", "mixed_float16"),
        ("infer", "infer"),
        ("_infer", "_infer"),
        ("infer_with_float32_vars", "infer_with_float32_vars"),
        (kdp.DTypePolicy("mixed_bfloat16"), "mixed_bfloat16"),
        (keras.DTypePolicy("float16"), "float16"),
        (SCALED, "mixed_float16"),
        (mixed_precision.Policy("_infer"), "_infer"),
    ],
    ids=lambda value: repr(value),
)
def test_every_setter_takes_what_set_global_policy_took(setter, policy, name):
    setter(policy)
    assert kdp.global_policy().name == name
    assert experimental.global_policy().name == name
    if not isinstance(policy, str):
        assert kdp.global_policy() is policy
    if name.endswith("infer") or name.startswith("infer"):
        assert kdp.global_policy().compute_dtype is None
        assert isinstance(kdp.global_policy(), mixed_precision.Policy)
    setter(None)
    assert kdp.global_policy() == kdp.DTypePolicy(keras.config.floatx())


def test_set_global_policy_warns_of_slow_float16_at_the_caller(monkeypatch):
    hardware.clear_cache()
    cpu = Device("cpu:0", "cpu", "Xeon", cpu_flags=frozenset({"avx512_bf16"}))
    monkeypatch.setattr(hardware, "list_devices", lambda backend=None: (cpu,))
    try:
        with pytest.warns(kdp.SlowFloat16Warning) as caught:
            kdp.set_global_policy("mixed_float16")
        assert [w.filename for w in caught] == [__file__]
    finally:
        hardware.clear_cache()


@LEGACY
def test_the_spellings_of_before_still_run():
    layer = keras.layers.Dense(2, dtype="mixed_bfloat16")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        policy = kdp.Policy("mixed_float16", loss_scale=2.0)
    assert policy.loss_scale == kdp.FixedLossScale(2.0)
    assert kdp.get_layer_policy(layer) is layer.dtype_policy
    assert experimental.get_layer_policy(layer) is layer.dtype_policy
    kdp.set_policy(policy)
    assert kdp.global_policy() is policy
    assert experimental.global_policy() is policy
    experimental.set_policy(None)
    mixed_precision.set_global_policy("mixed_bfloat16")
    assert type(kdp.global_policy()) is mixed_precision.Policy
    mixed_precision.set_global_policy(None)
    kdp.set_dtype_policy("mixed_float16")
    assert kdp.dtype_policy().name == "mixed_float16"
    with kdp.policy_scope("mixed_bfloat16"):
        assert kdp.global_policy().name == "mixed_bfloat16"
    assert mixed_precision.experimental.Policy("float32").loss_scale is None
