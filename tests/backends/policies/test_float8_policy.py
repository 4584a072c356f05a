"""float8 as a policy: set globally, in a scope, by rules and at load time.

Keras trains `Dense` and `EinsumDense` in float8 on every backend, one
layer at a time; a global float8 policy fails in Keras alone on the first
call of the model (keras #23479). With the package, a float8 policy reaches
the layers that can train in float8 and every other layer, models
included, gets its source policy. Every expectation holds on each backend
(Keras emulates float8 with the same scaling rules on jax, tensorflow and
torch); the float8 scaling state is compared bit for bit.
"""

import os

import keras
import numpy as np
import pytest

import keras_dtype_policy as kdp
from keras_dtype_policy.policies import float8
from keras_dtype_policy.policies import layer_walk
from keras_dtype_policy.tf_keras_compat import migrate

RNG = np.random.default_rng(0)
X = RNG.standard_normal((64, 6)).astype("float32")
Y = RNG.standard_normal((64, 3)).astype("float32")
SOURCES = {
    "float8_from_mixed_bfloat16": ("mixed_bfloat16", "bfloat16"),
    "float8_from_mixed_float16": ("mixed_float16", "float16"),
    "float8_from_float32": ("float32", "float32"),
}


@keras.saving.register_keras_serializable(package="test_float8_policy")
class Block(keras.layers.Layer):
    """A layer holding a Dense: the block cannot train in float8, its
    Dense can."""

    def __init__(self, units=4, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.inner = keras.layers.Dense(units, name="inner")

    def call(self, x):
        return keras.ops.relu(self.inner(x))

    def get_config(self):
        return {**super().get_config(), "units": self.units}


class ScaledDense(keras.layers.Dense):
    """A Dense whose call differs: the float8 path would skip it."""

    def call(self, inputs, training=None):
        return super().call(inputs) * 2.0


class NamedDense(keras.layers.Dense):
    """A Dense subclass that changes no computation."""


def nested_model():
    inner_inputs = keras.Input((4,))
    inner_outputs = keras.layers.Dense(4, name="nested_dense")(inner_inputs)
    inner = keras.Model(inner_inputs, inner_outputs, name="nested")
    inputs = keras.Input((6,))
    x = keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
    x = keras.layers.LayerNormalization(name="norm")(x)
    x = keras.layers.Activation("tanh", name="drop")(x)
    x = Block(4, name="block")(x)
    x = inner(x)
    x = keras.layers.EinsumDense("ab,bc->ac", output_shape=3, name="ein")(x)
    return keras.Model(inputs, x, name="outer")


def policies(model):
    return {
        path: layer.dtype_policy.name
        for path, layer in layer_walk.layer_paths(model)
    }


def array(variable):
    return keras.ops.convert_to_numpy(variable.value)


def float8_state(model):
    return {
        weight.path: array(weight)
        for weight in model.weights
        if getattr(weight, "overwrite_with_gradient", False)
    }


def expected_policies(float8_name, source):
    return {
        "hidden": float8_name,
        "norm": source,
        "drop": source,
        "block": source,
        "block/inner": float8_name,
        "nested": source,
        "nested/nested_dense": float8_name,
        "ein": float8_name,
    }


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_global_float8_policy_reaches_only_float8_layers(name):
    source, compute_dtype = SOURCES[name]
    kdp.set_dtype_policy(name)
    assert kdp.dtype_policy().name == name
    model = nested_model()
    assert model.dtype_policy.name == source
    assert policies(model) == expected_policies(name, source)
    assert model.get_layer("hidden").compute_dtype == compute_dtype
    # The float8 layers hold Keras' float8 scaling state.
    assert len(model.get_layer("hidden").weights) == 8
    outputs = model(X[:4])
    assert keras.backend.standardize_dtype(outputs.dtype) == compute_dtype


def keras_release():
    return tuple(int(part) for part in keras.__version__.split(".")[:2])


def test_keras_alone_fails_where_the_package_does_not():
    """keras #23479, with the patches undone. Keras 3.12 to 3.15 accept a
    float8 global policy and the model, which takes it too, fails on its
    first call (it has no float8 path); Keras 3.16 refuses the global
    policy. The package holds it as its source policy on every release."""
    kdp.uninstall()
    try:
        if keras_release() >= (3, 16):
            with pytest.raises(ValueError, match="cannot be quantized"):
                keras.config.set_dtype_policy("float8_from_mixed_bfloat16")
            return
        keras.config.set_dtype_policy("float8_from_mixed_bfloat16")
        model = nested_model()
        assert model.dtype_policy.name == "float8_from_mixed_bfloat16"
        with pytest.raises(Exception, match="_float8_call"):
            model(X[:4])
    finally:
        keras.config.set_dtype_policy("float32")
        kdp.install()


def test_keras_global_holds_the_source_of_a_float8_policy():
    kdp.set_dtype_policy("float8_from_mixed_float16")
    held = keras.config.dtype_policy()
    assert isinstance(held, float8.Float8SourcePolicy)
    assert held.name == "mixed_float16"
    assert kdp.dtype_policy().name == "float8_from_mixed_float16"
    # Keras' own float8 policy without a source takes the global's.
    quantized = keras.dtype_policies.QuantizedFloat8DTypePolicy("float8")
    assert quantized.name == "float8_from_mixed_float16"


def test_explicit_float8_dtype_on_other_layers_gives_the_source():
    layer = keras.layers.LayerNormalization(dtype="float8_from_mixed_bfloat16")
    assert layer.dtype_policy.name == "mixed_bfloat16"
    dense = keras.layers.Dense(3, dtype="float8_from_mixed_bfloat16")
    assert dense.dtype_policy.name == "float8_from_mixed_bfloat16"


def test_subclasses_train_in_float8_only_with_keras_float8_path():
    with kdp.policy_scope("float8_from_mixed_bfloat16"):
        scaled = ScaledDense(3)
        named = NamedDense(3)
    assert scaled.dtype_policy.name == "mixed_bfloat16"
    assert named.dtype_policy.name == "float8_from_mixed_bfloat16"
    assert not float8.trains_in_float8(keras.layers.Layer())
    assert float8.trains_in_float8(keras.layers.EinsumDense("ab,bc->ac", 2))


def test_policy_scope_restores_the_previous_policy():
    with kdp.policy_scope("float8_from_mixed_bfloat16") as policy:
        assert float8.is_float8_policy(policy)
        model = nested_model()
    assert kdp.dtype_policy().name == "float32"
    assert policies(model) == expected_policies(
        "float8_from_mixed_bfloat16", "mixed_bfloat16"
    )
    assert keras.layers.Dense(2).dtype_policy.name == "float32"


@pytest.mark.parametrize(
    "name, wrapped",
    [
        ("float8_from_mixed_bfloat16", False),
        ("float8_from_mixed_float16", True),
        ("float8_from_float32", False),
    ],
)
def test_training_under_a_float8_policy(name, wrapped):
    """The compile hook follows the source policy: loss scaling for a
    float16 source, none for bfloat16 or float32."""
    kdp.set_dtype_policy(name)
    model = nested_model()
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    assert isinstance(model.optimizer, kdp.LossScaleOptimizer) is wrapped
    before = model.evaluate(X, Y, verbose=0)
    state_before = float8_state(model)
    model.fit(X, Y, batch_size=16, epochs=4, verbose=0)
    after = model.evaluate(X, Y, verbose=0)
    assert after < before
    for weight in model.weights:
        assert np.all(np.isfinite(array(weight))), weight.path
    # The float8 scaling state moved with training.
    changed = [
        path
        for path, value in float8_state(model).items()
        if not np.array_equal(value, state_before[path])
    ]
    assert any(path.endswith("inputs_amax_history") for path in changed)


def trained_float8_model():
    kdp.set_dtype_policy("float8_from_mixed_bfloat16")
    model = nested_model()
    model.compile(optimizer="adam", loss="mse")
    model.fit(X, Y, batch_size=16, epochs=2, verbose=0)
    return model


def assert_same_weights(expected, actual):
    assert [w.path for w in expected.weights] == [
        w.path for w in actual.weights
    ]
    for left, right in zip(expected.weights, actual.weights, strict=True):
        np.testing.assert_array_equal(array(left), array(right), left.path)


def test_float8_model_saved_and_reloaded_exactly(tmp_path):
    model = trained_float8_model()
    path = os.path.join(tmp_path, "float8.keras")
    model.save(path)
    # `Block` makes its Dense in code, from the global policy, as Keras
    # layers do; its saved policy brings the float8 policy back for that.
    kdp.set_dtype_policy("float32")
    reloaded = keras.saving.load_model(path)
    # Functional models save no policy of their own and report the global
    # one after loading, as in Keras; they cast nothing with it.
    functional = ("nested",)
    assert {
        path: name
        for path, name in policies(reloaded).items()
        if path not in functional
    } == {
        path: name
        for path, name in policies(model).items()
        if path not in functional
    }
    assert_same_weights(model, reloaded)
    assert float8_state(reloaded)
    np.testing.assert_array_equal(
        model.predict(X, verbose=0), reloaded.predict(X, verbose=0)
    )
    # Optimizer state too: one more step from each gives the same weights.
    for each in (model, reloaded):
        each.fit(X[:16], Y[:16], epochs=1, shuffle=False, verbose=0)
    assert_same_weights(model, reloaded)


def test_float8_weights_file_into_a_fresh_float8_model(tmp_path):
    model = trained_float8_model()
    path = os.path.join(tmp_path, "float8.weights.h5")
    model.save_weights(path)
    with kdp.policy_scope("float8_from_mixed_bfloat16"):
        fresh = nested_model()
    fresh.load_weights(path)
    assert_same_weights(model, fresh)


def test_rules_put_chosen_layers_in_float8():
    rules = kdp.PrecisionRules("mixed_bfloat16").extend(
        kdp.PrecisionRule("float8", layers="Dense"),
        kdp.PrecisionRule("float8", names="ein"),
        kdp.PrecisionRule("float8", layers="LayerNormalization"),
    )
    with kdp.precision_scope(rules):
        model = nested_model()
    found = policies(model)
    assert found["hidden"] == "float8_from_mixed_bfloat16"
    assert found["block/inner"] == "float8_from_mixed_bfloat16"
    assert found["ein"] == "float8_from_mixed_bfloat16"
    # A rule cannot put a layer without a float8 path in float8.
    assert found["norm"] == "mixed_bfloat16"
    assert found["drop"] == "mixed_bfloat16"


def test_float32_islands_stay_float32_under_a_float8_default():
    rules = kdp.float16_rules(default="float8_from_mixed_float16")
    with kdp.precision_scope(rules):
        inputs = keras.Input((6,))
        x = keras.layers.Dense(8, name="hidden")(inputs)
        x = keras.layers.Dense(3, name="logits")(x)
        outputs = keras.layers.Softmax(name="probs")(x)
        model = keras.Model(inputs, outputs)
    assert policies(model) == {
        "hidden": "float8_from_mixed_float16",
        "logits": "float32",
        "probs": "float32",
    }
    model.compile(optimizer="adam", loss="mse")
    assert isinstance(model.optimizer, kdp.LossScaleOptimizer)
    model.fit(X, Y, batch_size=16, verbose=0)


def test_rules_with_float8_round_trip_their_config():
    rules = kdp.PrecisionRules("float8_from_mixed_bfloat16").extend(
        kdp.PrecisionRule("float32", names="*logits*"),
        kdp.PrecisionRule("float8", names="*proj*"),
    )
    config = rules.get_config()
    assert config["default"] == "float8_from_mixed_bfloat16"
    assert config["rules"][1]["policy"] == "float8"
    again = kdp.PrecisionRules.from_config(config)
    assert again == rules
    assert hash(again) == hash(rules)
    proj = keras.layers.Dense(2, name="out_proj")
    assert again.policy_for(proj).name == "float8_from_mixed_bfloat16"
    assert again.policy_for(keras.layers.Softmax()).name == "mixed_bfloat16"


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: kdp.PrecisionRules("float8"), "float8_from_mixed_bfloat16"),
        (
            lambda: kdp.PrecisionRules("kahan_bfloat16").extend(
                kdp.PrecisionRule("float8", layers="Dense")
            ),
            "kahan_bfloat16",
        ),
        (
            lambda: kdp.PrecisionRule("float8_from_int8", layers="Dense"),
            "float8_from_int8",
        ),
        (lambda: kdp.PrecisionRule("int8_from_float32", names="x"), "int8"),
    ],
)
def test_bad_float8_rules_name_what_they_received(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def float32_model():
    model = nested_model()
    model.compile(optimizer="adam", loss="mse")
    model.fit(X, Y, batch_size=16, epochs=1, verbose=0)
    return model


def kernels(model):
    return {
        w.path: array(w) for w in model.weights if w.path.endswith("kernel")
    }


def test_load_model_under_a_float8_policy(tmp_path):
    model = float32_model()
    path = os.path.join(tmp_path, "float32.keras")
    model.save(path)
    loaded = kdp.load_model(path, policy="float8_from_mixed_bfloat16")
    assert policies(loaded) == expected_policies(
        "float8_from_mixed_bfloat16", "mixed_bfloat16"
    )
    # Float32 weights are kept as they are; the float8 scaling state
    # starts where Keras starts it.
    for key, value in kernels(model).items():
        np.testing.assert_array_equal(kernels(loaded)[key], value)
    assert not isinstance(loaded.optimizer, kdp.LossScaleOptimizer)
    loaded.fit(X, Y, batch_size=16, verbose=0)
    # Back to float32: the scaling state is left behind, the weights kept.
    back = kdp.apply_rules(loaded, "float32")
    assert not float8_state(back)
    for key, value in kernels(loaded).items():
        np.testing.assert_array_equal(kernels(back)[key], value)


def test_apply_rules_between_float8_policies_keeps_the_scaling_state():
    model = trained_float8_model()
    again = kdp.apply_rules(model, "float8_from_mixed_bfloat16")
    assert_same_weights(model, again)


def test_migrate_command_accepts_a_float8_policy(tmp_path):
    model = float32_model()
    old = os.path.join(tmp_path, "old.keras")
    new = os.path.join(tmp_path, "new.keras")
    model.save(old)
    migrate.migrate(old, new, policy="float8_from_mixed_bfloat16")
    migrated = keras.saving.load_model(new)
    assert policies(migrated)["hidden"] == "float8_from_mixed_bfloat16"
    assert policies(migrated)["norm"] == "mixed_bfloat16"
    assert isinstance(
        migrated.get_layer("norm").dtype_policy, float8.Float8SourcePolicy
    )


def test_float8_source_policy_computes_and_compares_as_its_source():
    policy = float8.Float8SourcePolicy("float8_from_mixed_float16", 16)
    assert policy == kdp.DTypePolicy("mixed_float16")
    assert (policy.compute_dtype, policy.variable_dtype) == (
        "float16",
        "float32",
    )
    assert policy.float8_policy.amax_history_length == 16
    again = keras.dtype_policies.deserialize(
        keras.dtype_policies.serialize(policy)
    )
    assert isinstance(again, float8.Float8SourcePolicy)
    assert again.float8_policy == policy.float8_policy
    # A layer that trains in float8 given it gets the float8 policy.
    dense = keras.layers.Dense(2, dtype=policy)
    assert dense.dtype_policy.name == "float8_from_mixed_float16"
    assert dense.dtype_policy.amax_history_length == 16


@pytest.mark.parametrize("value", ["mixed_bfloat16", None, "float8_from_x"])
def test_float8_source_policy_names_a_bad_argument(value):
    with pytest.raises(ValueError, match="float8_policy"):
        float8.Float8SourcePolicy(value)


def test_saving_leaves_the_global_float8_policy_alone(tmp_path):
    model = trained_float8_model()
    model.save(os.path.join(tmp_path, "model.keras"))
    assert kdp.dtype_policy().name == "float8_from_mixed_bfloat16"
    assert model.get_layer("hidden").dtype_policy is not kdp.dtype_policy()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"policy": "float8_from_mixed_bfloat16"},
        {
            "rules": kdp.PrecisionRules("mixed_bfloat16").extend(
                kdp.PrecisionRule("float8", layers="Dense")
            )
        },
    ],
)
def test_the_audit_refuses_float8_naming_the_argument(kwargs):
    model = nested_model()
    argument = next(iter(kwargs))
    with pytest.raises(ValueError, match=f"does not audit float8.*{argument}="):
        kdp.audit(model, x=X[:8], **kwargs)


def test_find_nonfinite_walks_a_float8_model():
    kdp.set_dtype_policy("float8_from_mixed_bfloat16")
    model = nested_model()
    report = kdp.find_nonfinite(model, X[:8])
    assert report.all_finite
    # The float8 layers around it run as they do in training.
    model.get_layer("norm").gamma.assign(np.full((8,), np.nan, "float32"))
    report = kdp.find_nonfinite(model, X[:8])
    assert not report.all_finite
    assert report.layer.path.endswith("norm")


def test_a_float8_policy_whose_name_keras_cleared_keeps_its_source():
    """Keras clears the names of the policies a DTypePolicyMap serializes
    (keras-hub saves its float8 layers so); their dtypes tell the source."""
    for name, (source, _) in SOURCES.items():
        policy = keras.dtype_policies.QuantizedFloat8DTypePolicy(
            "float8", name.split("_from_")[1]
        )
        policy._name = None
        assert float8.source_name(policy) == source
        assert float8.policy_for_layer(policy, keras.layers.Softmax()) == (
            kdp.DTypePolicy(source)
        )
