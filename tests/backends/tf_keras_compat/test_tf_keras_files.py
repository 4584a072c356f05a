"""Loading what tf.keras 2 saved, from real files, on each backend.

The fixtures in tests/fixtures/tf_keras2 were written by tf-keras 2.21 on
TensorFlow 2.21 (make_fixtures.py there), with the predictions recorded at
save time. Predictions are compared within 8 ulps of the layers' compute
dtype: float16 and bfloat16 arithmetic differs between backends.
"""

import json
import pathlib
import warnings

import h5py
import keras
import numpy as np
import pytest
from testing import dtype_of
from testing import keras_file_with_dtype
from testing import to_numpy

import keras_dtype_policy as kdp
from keras_dtype_policy import DTypePolicy
from keras_dtype_policy import LossScaleOptimizer
from keras_dtype_policy.tf_keras_compat import legacy_policy_configs

FIXTURES = (
    pathlib.Path(__file__).resolve().parents[2] / "fixtures" / "tf_keras2"
)
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())
MODELS = MANIFEST["models"]
EPSILON = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23}


@pytest.fixture(autouse=True)
def fresh_reports():
    legacy_policy_configs._reported_scales.clear()
    yield
    legacy_policy_configs._reported_scales.clear()


def expected_policy_names(model_name, key="layer_dtypes_h5"):
    names = {}
    for layer, dtype in MODELS[model_name][key].items():
        names[layer] = (
            dtype if isinstance(dtype, str) else dtype["config"]["name"]
        )
    return names


def assert_predictions_match(model, model_name):
    recorded = np.load(FIXTURES / f"{model_name}.predictions.npz")
    policy = MODELS[model_name]["policy"]
    tolerance = 8 * EPSILON[DTypePolicy(policy).compute_dtype]
    predictions = to_numpy(model.predict(recorded["x"], verbose=0))
    np.testing.assert_allclose(
        predictions, recorded["y"], rtol=tolerance, atol=tolerance
    )


def assert_policies_match(model, model_name):
    expected = expected_policy_names(model_name)
    loaded = {layer.name: layer.dtype_policy.name for layer in model.layers}
    for name, policy_name in expected.items():
        if name in loaded:
            assert loaded[name] == policy_name, name
    mixed = [n for n, p in expected.items() if p.startswith("mixed_")]
    assert mixed and all(name in loaded for name in mixed)


@pytest.mark.parametrize("suffix", [".h5", ".keras"])
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_saved_models_load_with_policies_and_predictions(model_name, suffix):
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Skipping variable loading")
        model = keras.saving.load_model(FIXTURES / f"{model_name}{suffix}")
    assert_policies_match(model, model_name)
    assert_predictions_match(model, model_name)
    for layer in model.layers:
        for weight in layer.weights:
            if keras.backend.is_float_dtype(weight.dtype):
                assert weight.dtype == layer.dtype_policy.variable_dtype


@pytest.mark.parametrize(
    "model_name", sorted(n for n in MODELS if (FIXTURES / f"{n}.json").exists())
)
def test_model_from_json_reads_tf_keras_architectures(model_name):
    json_string = (FIXTURES / f"{model_name}.json").read_text()
    model = kdp.model_from_json(json_string)
    assert_policies_match(model, model_name)
    model.load_weights(FIXTURES / f"{model_name}_legacy_weights.h5")
    assert_predictions_match(model, model_name)


def test_model_from_json_rejects_bad_input():
    with pytest.raises(TypeError, match="json_string"):
        kdp.model_from_json({"class_name": "Sequential"})
    with pytest.raises(ValueError, match="not valid JSON"):
        kdp.model_from_json("{not json")
    with pytest.raises(ValueError, match="class_name"):
        kdp.model_from_json("[1, 2]")


@pytest.mark.parametrize("suffix", [".h5", ".keras"])
@pytest.mark.parametrize(
    "model_name, dynamic, initial_scale",
    [
        ("dense_mixed_float16_adam_dynamic", True, 32768.0),
        ("dense_mixed_float16_adam_fixed", False, 1024.0),
    ],
)
def test_loss_scale_optimizer_loads_with_its_state(
    model_name, dynamic, initial_scale, suffix
):
    model = keras.saving.load_model(FIXTURES / f"{model_name}{suffix}")
    optimizer = model.optimizer
    assert type(optimizer) is LossScaleOptimizer
    assert optimizer.dynamic is dynamic
    assert optimizer.initial_scale == initial_scale
    # tf.keras files hold no loss-scale state: it starts from the initial one.
    assert optimizer.loss_scale == initial_scale
    state = MODELS[model_name]["optimizer_state"]
    assert int(to_numpy(optimizer.iterations)) == state["iterations"] == 3
    if suffix == ".h5":
        # Keras' .h5 loader builds optimizers with the model's own, empty,
        # variable list; the state waits for the real build, which the first
        # training step does, or this call.
        assert not optimizer.built
        optimizer.build(model.trainable_variables)
    inner = optimizer.inner_optimizer
    assert isinstance(inner, keras.optimizers.Adam)
    first_m, first_v = inner.variables[2], inner.variables[3]
    np.testing.assert_allclose(
        to_numpy(first_m).ravel()[:5], state["first_adam_slots"]["m"]["first5"]
    )
    np.testing.assert_allclose(
        to_numpy(first_v).ravel()[:5], state["first_adam_slots"]["v"]["first5"]
    )
    inputs = np.load(FIXTURES / "inputs.npz")
    x = inputs[f"{model_name}.x_train"][:4] * 1e-2
    y = inputs[f"{model_name}.y_train"][:4]
    model.train_on_batch(x, y)
    steps = int(to_numpy(optimizer.iterations)) + optimizer.skipped_steps
    assert steps == 4
    assert all(np.all(np.isfinite(to_numpy(w))) for w in model.weights)


@pytest.mark.parametrize("suffix", [".h5", ".keras"])
def test_plain_optimizer_state_carries_over_too(suffix):
    model = keras.saving.load_model(
        FIXTURES / f"conv_mixed_bfloat16_adam{suffix}"
    )
    assert isinstance(model.optimizer, keras.optimizers.Adam)
    assert int(to_numpy(model.optimizer.iterations)) == 3
    inputs = np.load(FIXTURES / "inputs.npz")
    x = inputs["conv_mixed_bfloat16_adam.x_train"][:4]
    y = inputs["conv_mixed_bfloat16_adam.y_train"][:4]
    model.train_on_batch(x, y)  # Keras alone fails here for .h5 files
    assert int(to_numpy(model.optimizer.iterations)) == 4


LEGACY_FORMS = json.loads((FIXTURES / "legacy_layer_configs.json").read_text())


def _form(form_id):
    return next(f for f in LEGACY_FORMS if f["id"] == form_id)


@pytest.mark.parametrize("form", LEGACY_FORMS, ids=lambda f: f["id"])
def test_legacy_layer_configs_load_through_from_config(form):
    config = json.loads(json.dumps(form["config"]))
    dtype = config["dtype"]
    loss_scale = isinstance(dtype, dict) and "loss_scale" in dtype["config"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer = keras.layers.Dense.from_config(config)
    dropped = [w for w in caught if "dropped" in str(w.message)]
    assert len(dropped) == (1 if loss_scale else 0)
    if loss_scale:
        scale_class = dtype["config"]["loss_scale"]["class_name"]
        assert scale_class in str(dropped[0].message)
    y = layer(np.ones((2, 5), "float32"))
    if form["expected_policy_name"] is not None:
        assert layer.dtype_policy.name == form["expected_policy_name"]
        assert layer.compute_dtype == "float16"
        assert layer.variable_dtype == "float32"
    elif dtype is None:
        assert layer.dtype_policy.name == "float32"  # Keras: the global
    else:
        assert layer.dtype_policy.name == "float32"  # inferred from input
    assert dtype_of(y) == layer.compute_dtype


def _h5_file_with_dtype(dtype, path):
    model = keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(3, name="dense")]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save(path)
    with h5py.File(path, "r+") as f:
        config = json.loads(f.attrs["model_config"])
        config["config"]["layers"][1]["config"]["dtype"] = dtype
        f.attrs["model_config"] = json.dumps(config)
    return model


@pytest.mark.parametrize("suffix", [".keras", ".h5"])
@pytest.mark.parametrize(
    "form_id",
    [
        "policy_class_name_config",
        "policy_v1_dynamic_loss_scale",
        "policy_v1_fixed_loss_scale",
        "policy_tf213_plus_real",
        "policy_tf23_with_loss_scale",
    ],
)
def test_legacy_dtype_forms_load_through_load_model(form_id, suffix, tmp_path):
    dtype = _form(form_id)["config"]["dtype"]
    path = tmp_path / f"model{suffix}"
    writer = (
        keras_file_with_dtype if suffix == ".keras" else _h5_file_with_dtype
    )
    original = writer(dtype, path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        loaded = keras.saving.load_model(path)
    layer = loaded.get_layer("dense")
    assert layer.dtype_policy.name == "mixed_float16"
    x = np.ones((2, 5), "float32")
    np.testing.assert_allclose(
        to_numpy(layer(x)).astype("float32"),
        to_numpy(original(x)),
        rtol=1e-2,
        atol=1e-2,
    )


@pytest.mark.parametrize("suffix", [".keras", ".h5"])
@pytest.mark.parametrize("form_id", ["null", "infer_string"])
def test_null_and_infer_forms_load_through_load_model(
    form_id, suffix, tmp_path
):
    dtype = _form(form_id)["config"]["dtype"]
    path = tmp_path / f"model{suffix}"
    writer = (
        keras_file_with_dtype if suffix == ".keras" else _h5_file_with_dtype
    )
    writer(dtype, path)
    kdp.set_dtype_policy("mixed_bfloat16")
    loaded = keras.saving.load_model(path)
    layer = loaded.get_layer("dense")
    # A file Keras 3 wrote: null means the global policy at load time, as in
    # Keras; "_infer" takes the dtype of the first input (float32 here).
    expected = "bfloat16" if dtype is None else "float32"
    assert dtype_of(loaded(np.ones((2, 5), "float32"))) == expected
    assert layer.compute_dtype == expected
