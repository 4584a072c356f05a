"""Precision rules: matching, the scope, and rules applied to built models.

Every expectation holds on each backend: the rules only choose policies,
and Keras computes each policy alike on jax, tensorflow and torch.
"""

import keras
import numpy as np
import pytest

import keras_dtype_policy as kdp
from keras_dtype_policy.policies import layer_walk
from keras_dtype_policy.policies import rules_application

RULES = kdp.PrecisionRules("mixed_float16").extend(
    kdp.PrecisionRule("float32", layers="Softmax"),
    kdp.PrecisionRule("float32", names="*logits*"),
)
X = np.random.default_rng(0).standard_normal((4, 6)).astype("float32")


def policies(model):
    return {
        layer.name: layer.dtype_policy.name
        for layer in model._flatten_layers(include_self=False)
        if not isinstance(layer, keras.layers.InputLayer)
    }


def functional():
    inputs = keras.Input((6,))
    x = keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
    x = keras.layers.LayerNormalization(name="norm")(x)
    x = keras.layers.Dense(3, name="logits")(x)
    outputs = keras.layers.Softmax(name="probs")(x)
    return keras.Model(inputs, outputs, name="functional")


def sequential():
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="relu", name="hidden"),
            keras.layers.Dense(3, name="logits"),
            keras.layers.Softmax(name="probs"),
        ]
    )


@keras.saving.register_keras_serializable(package="test_precision_rules")
class Subclassed(keras.Model):
    def __init__(self, units=3, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.hidden = keras.layers.Dense(8, name="hidden")
        self.logits = keras.layers.Dense(units, name="logits")
        self.probs = keras.layers.Softmax(name="probs")

    def call(self, x):
        return self.probs(self.logits(self.hidden(x)))

    def get_config(self):
        return {**super().get_config(), "units": self.units}


def subclassed():
    model = Subclassed()
    model(X)
    return model


EXPECTED = {
    "hidden": "mixed_float16",
    "logits": "float32",
    "probs": "float32",
}


def test_the_last_matching_rule_wins():
    rules = RULES.extend(kdp.PrecisionRule("bfloat16", names="probs"))
    assert rules.policy_for(keras.layers.Softmax(name="probs")).name == (
        "bfloat16"
    )
    assert rules.policy_for(keras.layers.Softmax()).name == "float32"
    assert rules.policy_for(keras.layers.Dense(1)).name == "mixed_float16"


def test_a_rule_matches_class_and_name_together_and_subclasses():
    rule = kdp.PrecisionRule(
        "float32", layers=keras.layers.Dense, names="head_*"
    )
    assert rule.matches(keras.layers.Dense(1, name="head_a"))
    assert not rule.matches(keras.layers.Dense(1, name="body"))
    assert not rule.matches(keras.layers.Softmax(name="head_b"))

    class MyDense(keras.layers.Dense):
        pass

    assert rule.matches(MyDense(1, name="head_c"))


@pytest.mark.parametrize(
    "kwargs, error, fragment",
    [
        ({"policy": "float32"}, ValueError, "needs `layers`, `names`"),
        ({"policy": "int8", "names": "x"}, ValueError, "policy='int8'"),
        ({"policy": "nope", "names": "x"}, ValueError, "policy='nope'"),
        ({"policy": "float32", "layers": [3]}, TypeError, "layers=[3]"),
        ({"policy": "float32", "names": [None]}, TypeError, "names=[None]"),
        ({"policy": "float32", "paths": [1]}, TypeError, "paths=[1]"),
    ],
)
def test_bad_rules_name_the_argument(kwargs, error, fragment):
    with pytest.raises(error, match=fragment.replace("[", r"\[")):
        kdp.PrecisionRule(**kwargs)


def test_a_path_rule_matches_by_place_and_never_without_a_path():
    rule = kdp.PrecisionRule("float32", paths="encoder/*/query")
    query = keras.layers.Dense(1, name="query")
    assert rule.matches(query, "encoder/layer_0/query")
    assert not rule.matches(query, "decoder/layer_0/query")
    assert not rule.matches(query)  # in a scope: no place yet
    both = kdp.PrecisionRule("float32", names="query", paths="encoder/*")
    assert not both.matches(keras.layers.Dense(1, name="key"), "encoder/key")
    rules = kdp.PrecisionRules("mixed_float16", [rule])
    assert rules.uses_paths and not kdp.float16_rules().uses_paths
    again = kdp.PrecisionRules.from_config(rules.get_config())
    assert again == rules and again.rules[0].paths == ("encoder/*/query",)
    assert "paths" not in kdp.float16_rules().get_config()["rules"][0]


def nested_encoder_model():
    def block(name):
        inputs = keras.Input((4,))
        x = keras.layers.Dense(4, name="query")(inputs)
        x = keras.layers.Dense(4, name="out")(x)
        return keras.Model(inputs, x, name=name)

    inputs = keras.Input((4,))
    x = block("layer_0")(inputs)
    x = block("layer_1")(x)
    return keras.Model(inputs, keras.layers.Dense(2, name="query")(x))


def test_apply_rules_matches_paths_inside_nested_models(tmp_path):
    model = nested_encoder_model()
    rules = kdp.PrecisionRules("mixed_float16").extend(
        kdp.PrecisionRule("float32", paths="layer_1/query")
    )
    for copy in (
        kdp.apply_rules(model, rules),
        kdp.load_model(_saved(model, tmp_path), rules=rules),
    ):
        policies = {
            path: layer.dtype_policy.name for path, layer in kdp_paths(copy)
        }
        assert policies == {
            "layer_0": "mixed_float16",
            "layer_0/query": "mixed_float16",
            "layer_0/out": "mixed_float16",
            "layer_1": "mixed_float16",
            "layer_1/query": "float32",
            "layer_1/out": "mixed_float16",
            "query": "mixed_float16",
        }
        x = np.ones((2, 4), "float32")
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(copy(x)).astype("float32"),
            keras.ops.convert_to_numpy(model(x)),
            rtol=1e-2,
            atol=1e-2,
        )


def _saved(model, folder):
    path = folder / "nested.keras"
    model.save(path)
    return path


def kdp_paths(model):
    return layer_walk.layer_paths(model)


def test_rules_config_round_trip():
    rules = kdp.float16_rules()
    again = kdp.PrecisionRules.from_config(rules.get_config())
    assert again == rules
    assert [rule.why for rule in again] == [rule.why for rule in rules]


def test_default_float16_rules_say_why_each_rule_exists():
    rules = kdp.float16_rules()
    assert rules.default.name == "mixed_float16"
    assert all(rule.why for rule in rules)
    assert rules.policy_for(keras.layers.Softmax()).name == "float32"
    assert rules.policy_for(keras.layers.UnitNormalization()).name == (
        "float32"
    )
    assert rules.policy_for(keras.layers.Dense(2, name="logits")).name == (
        "float32"
    )
    assert rules.policy_for(keras.layers.Dense(2)).name == "mixed_float16"
    assert kdp.float16_rules("float16").default.name == "float16"


@pytest.mark.parametrize("build", [functional, sequential, subclassed])
def test_the_scope_gives_new_layers_their_rule_policy(build):
    with kdp.precision_scope(RULES):
        model = build()
    found = policies(model)
    for name, policy in EXPECTED.items():
        assert found[name] == policy
    # Outside the scope, layers take the global policy again.
    assert keras.layers.Dense(1).dtype_policy.name == "float32"
    assert keras.backend.standardize_dtype(model(X).dtype) == "float32"


def test_the_scope_keeps_an_explicit_dtype():
    with kdp.precision_scope(RULES):
        layer = keras.layers.Softmax(dtype="bfloat16")
        plain = keras.layers.Dense(1)
    assert layer.dtype_policy.name == "bfloat16"
    assert plain.dtype_policy.name == "mixed_float16"


@pytest.mark.parametrize("build", [functional, sequential, subclassed])
def test_applied_rules_keep_weights_and_survive_save_and_load(build, tmp_path):
    model = build()
    expected = keras.ops.convert_to_numpy(model(X))
    new = kdp.apply_rules(model, RULES)
    assert new is not model
    for name, policy in EXPECTED.items():
        assert policies(new)[name] == policy
    assert all(p == "float32" for p in policies(model).values())
    for old, fresh in zip(model.weights, new.weights, strict=True):
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(old), keras.ops.convert_to_numpy(fresh)
        )
    # float16 hidden layer: close to the float32 model, not equal to it.
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(new(X)), expected, atol=2e-2
    )
    path = tmp_path / "model.keras"
    new.save(path)
    if build is subclassed:
        # Its sublayers' policies come from its code, not its config: the
        # rules are given again on loading.
        loaded = kdp.load_model(path, rules=RULES)
    else:
        loaded = keras.saving.load_model(path)
    assert policies(loaded) == policies(new)
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(loaded(X)),
        keras.ops.convert_to_numpy(new(X)),
        rtol=1e-6,
        atol=1e-6,
    )


def test_a_pure_float16_policy_casts_the_weights():
    model = functional()
    new = kdp.apply_rules(model, "float16")
    kernel = new.get_layer("hidden").kernel
    assert keras.backend.standardize_dtype(kernel.dtype) == "float16"
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(kernel),
        keras.ops.convert_to_numpy(model.get_layer("hidden").kernel).astype(
            "float16"
        ),
    )


def test_a_weight_beyond_float16_is_refused_not_made_infinite():
    model = functional()
    layer = model.get_layer("hidden")
    layer.kernel.assign(np.full(layer.kernel.shape, 1e6, "float32"))
    with pytest.raises(ValueError, match="beyond the range of float16"):
        kdp.apply_rules(model, "float16")


@pytest.mark.filterwarnings("ignore::keras_dtype_policy.SlowFloat16Warning")
def test_float32_pinned_layers_stay_unless_told_otherwise():
    with kdp.policy_scope("mixed_float16"):
        inputs = keras.Input((6,))
        x = keras.layers.Dense(8, name="a")(inputs)
        x = keras.layers.Dense(8, name="b")(x)
        outputs = keras.layers.Activation(
            "softmax", dtype="float32", name="out"
        )(x)
        model = keras.Model(inputs, outputs)
    kept = kdp.apply_rules(model, "mixed_bfloat16")
    assert policies(kept) == {
        "a": "mixed_bfloat16",
        "b": "mixed_bfloat16",
        "out": "float32",
    }
    told = kdp.apply_rules(model, "mixed_bfloat16", keep_float32=False)
    assert set(policies(told).values()) == {"mixed_bfloat16"}


def test_a_compiled_model_is_compiled_again_with_loss_scaling():
    model = functional()
    model.compile("adam", "mse")
    new = kdp.apply_rules(model, RULES)
    assert isinstance(new.optimizer, kdp.LossScaleOptimizer)
    back = kdp.apply_rules(new, "float32", keep_float32=False)
    assert not isinstance(back.optimizer, keras.optimizers.LossScaleOptimizer)


def test_apply_rules_rejects_what_it_cannot_copy():
    with pytest.raises(TypeError, match="model=3"):
        kdp.apply_rules(3, RULES)
    with pytest.raises(TypeError, match="rules=3"):
        kdp.apply_rules(functional(), 3)
    unbuilt = keras.Sequential([keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="must be built"):
        kdp.apply_rules(unbuilt, RULES)


def test_the_layer_init_patch_needs_keras_signature():
    def other(self, *, name=None):
        pass

    with pytest.raises(RuntimeError, match="cannot patch Layer.__init__"):
        rules_application.make_layer_init(other)
