"""Loading a model file under another policy: `kdp.load_model` and
`migrate --policy`, on tf.keras 2 files (the committed fixtures) and on
Keras 3 files. The expectations are the same on every backend.
"""

import pathlib

import keras
import numpy as np
import pytest

import keras_dtype_policy as kdp
from keras_dtype_policy.tf_keras_compat import migrate
from keras_dtype_policy.tf_keras_compat.model_files import ModelFileError

FIXTURES = (
    pathlib.Path(__file__).resolve().parents[2] / "fixtures" / "tf_keras2"
)
INPUTS = np.load(FIXTURES / "inputs.npz")
MODELS = ["dense_mixed_float16", "conv_mixed_bfloat16", "lstm_mixed_float16"]
# The layer each fixture model pins to float32.
PINNED = {
    "dense_mixed_float16": "activation",
    "conv_mixed_bfloat16": "activation",
    "lstm_mixed_float16": "dense",
}


def layer_policies(model):
    return {
        layer.name: layer.dtype_policy.name
        for layer in model.layers
        if not isinstance(layer, keras.layers.InputLayer)
    }


def float32_reference(model):
    """The saved model computed in float32, through Keras' clone_model."""

    def clone(layer):
        return layer.__class__.from_config(
            {**layer.get_config(), "dtype": "float32"}
        )

    reference = keras.models.clone_model(model, clone_function=clone)
    reference.set_weights(model.get_weights())
    return reference


def predict(model, x):
    return np.asarray(model.predict(x, verbose=0), dtype="float32")


@pytest.mark.parametrize("suffix", [".h5", ".keras"])
@pytest.mark.parametrize("name", MODELS)
def test_a_float32_override_computes_the_saved_model_in_float32(name, suffix):
    path = FIXTURES / f"{name}{suffix}"
    saved = kdp.load_model(path)
    model = kdp.load_model(path, policy="float32")
    assert set(layer_policies(model).values()) == {"float32"}
    for weight in model.weights:
        assert keras.backend.standardize_dtype(weight.dtype) in (
            "float32",
            "int64",
            "int32",
        )
    for a, b in zip(saved.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    x = INPUTS[name]
    expected = predict(float32_reference(saved), x)
    np.testing.assert_allclose(
        predict(model, x), expected, rtol=1e-5, atol=1e-6
    )
    # The saved (mixed) predictions differ from float32 by rounding only.
    mixed = np.load(FIXTURES / f"{name}.predictions.npz")["y"]
    np.testing.assert_allclose(predict(model, x), mixed, atol=5e-2)


@pytest.mark.parametrize("name", MODELS)
def test_pinned_float32_layers_stay_unless_told_otherwise(name):
    path = FIXTURES / f"{name}.keras"
    kept = layer_policies(kdp.load_model(path, policy="mixed_bfloat16"))
    assert kept.pop(PINNED[name]) == "float32"
    assert set(kept.values()) == {"mixed_bfloat16"}
    told = kdp.load_model(path, policy="mixed_bfloat16", keep_float32=False)
    assert set(layer_policies(told).values()) == {"mixed_bfloat16"}


def test_rules_decide_per_layer_on_load():
    rules = kdp.PrecisionRules("float32").extend(
        kdp.PrecisionRule("mixed_bfloat16", layers="Conv2D")
    )
    model = kdp.load_model(
        FIXTURES / "conv_mixed_bfloat16.h5", rules=rules, keep_float32=False
    )
    policies = layer_policies(model)
    assert policies.pop("conv2d") == "mixed_bfloat16"
    assert set(policies.values()) == {"float32"}


def test_a_pure_float16_override_casts_the_variables(tmp_path):
    model = kdp.load_model(FIXTURES / "dense_mixed_float16.keras")
    new = kdp.load_model(
        FIXTURES / "dense_mixed_float16.keras",
        policy="float16",
        keep_float32=False,
    )
    kernel = new.get_layer("dense").kernel
    assert keras.backend.standardize_dtype(kernel.dtype) == "float16"
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(kernel),
        keras.ops.convert_to_numpy(model.get_layer("dense").kernel).astype(
            "float16"
        ),
    )


def test_a_compiled_file_comes_back_compiled_for_its_new_policy():
    path = FIXTURES / "dense_mixed_float16_adam_dynamic.h5"
    assert isinstance(kdp.load_model(path).optimizer, kdp.LossScaleOptimizer)
    model = kdp.load_model(path, policy="float32")
    assert isinstance(model.optimizer, keras.optimizers.Adam)
    assert not isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)


def test_bad_arguments_name_themselves(tmp_path):
    path = FIXTURES / "dense_mixed_float16.keras"
    with pytest.raises(ValueError, match="not both"):
        kdp.load_model(path, policy="float32", rules=kdp.float16_rules())
    with pytest.raises(ValueError, match="policy='int8'"):
        kdp.load_model(path, policy="int8")
    with pytest.raises(TypeError, match="rules='float32'"):
        kdp.load_model(path, rules="float32")
    with pytest.raises(ModelFileError, match="no such file"):
        kdp.load_model(tmp_path / "missing.keras", policy="float32")


def test_migrate_with_a_policy_writes_the_new_policies(tmp_path):
    new = tmp_path / "float32.keras"
    migration = migrate.migrate(
        FIXTURES / "dense_mixed_float16_adam_dynamic.h5",
        new,
        policy="float32",
    )
    assert any("(--policy)" in change.text for change in migration.changes)
    assert any("--policy" in note for note in migration.notes)
    reloaded = keras.saving.load_model(new)
    assert set(layer_policies(reloaded).values()) == {"float32"}
    with pytest.raises(ModelFileError, match="--policy"):
        migrate.migrate(
            FIXTURES / "dense_mixed_float16.h5",
            tmp_path / "bad.keras",
            policy="int8",
        )
