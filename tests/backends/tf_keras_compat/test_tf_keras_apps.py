"""tf.keras 2 applications and a text model, loaded on each backend.

The files in tests/fixtures/tf_keras2/applications were written by tf-keras
2.21 (application_fixtures.py there): MobileNetV2, ResNet50,
EfficientNetB0 and DenseNet121 at 32x32, flat and nested as a frozen layer
of a functional model, and a text model (Embedding, bidirectional LSTM and
GRU, MultiHeadAttention), under mixed_float16 and mixed_bfloat16. Every
backend gives tf-keras' predictions within 8 units in the last place of
the compute dtype (float16 and bfloat16 arithmetic differs between
backends), the policies per layer as saved, and the optimizer as saved.
"""

import json
import pathlib
import warnings

import keras
import numpy as np
import pytest
from testing import to_numpy

import keras_dtype_policy as kdp
from keras_dtype_policy.tf_keras_compat import migrate
from keras_dtype_policy.tf_keras_compat.bridge import model_from_json
from keras_dtype_policy.tools import model_report

FIXTURES = (
    pathlib.Path(__file__).resolve().parents[2]
    / "fixtures"
    / "tf_keras2"
    / "applications"
)
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())["models"]
PREDICTIONS = np.load(FIXTURES / "predictions.npz")
EPSILON = {"float16": 2.0**-10, "bfloat16": 2.0**-7}
# The file of each model that every run loads: every architecture, policy
# and format at least once. The model's other files are marked slow: each
# of these large models takes tens of seconds to load and run on a CPU.
CORE = {
    "densenet121_flat_mixed_float16": ".keras",
    "densenet121_nested_mixed_bfloat16": ".h5",
    "efficientnetb0_flat_mixed_float16": ".json",
    "efficientnetb0_nested_mixed_float16": ".keras",
    "mobilenetv2_flat_mixed_bfloat16": ".keras",
    "mobilenetv2_nested_mixed_float16": ".h5",
    "resnet50_flat_mixed_float16": ".json",
    "resnet50_nested_mixed_bfloat16": ".keras",
    "text_mixed_bfloat16": ".json",
    "text_mixed_float16": ".keras",
}
# DenseNet121 and EfficientNetB0 take a minute or two each to run eagerly
# on jax (each op compiles): all their files are marked slow.
LARGE = ("densenet121", "efficientnetb0")


def is_slow(name, file_name):
    return name.startswith(LARGE) or file_name != f"{name}{CORE[name]}"


# The others rotate across the backends in the default runs (CI time: on
# JAX, which runs a loaded model's first predictions op by op, they took
# 75 s of one worker); `tox -e full-<backend>` runs each on every backend.
CASES = [
    pytest.param(
        name,
        file_name,
        marks=pytest.mark.slow
        if is_slow(name, file_name)
        else pytest.mark.rotated,
    )
    for name, record in sorted(MANIFEST.items())
    for file_name in sorted(record["files"])
    if not file_name.endswith(".weights.h5")
]


def load(name, file_name):
    path = FIXTURES / file_name
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Skipping variable loading")
        if path.suffix == ".json":
            model = model_from_json(path.read_text())
            model.load_weights(FIXTURES / f"{name}.weights.h5")
            return model
        return keras.saving.load_model(path)


def assert_predictions_match(model, name):
    compute = kdp.DTypePolicy(MANIFEST[name]["policy"]).compute_dtype
    tolerance = 8 * EPSILON[compute]
    x = PREDICTIONS[f"{name}.x"]
    if name.startswith("text"):
        # Called eagerly: under jit, JAX on a CPU refuses the float16
        # attention einsum that accumulates in float32 ("precision
        # 'F16_F16_F32' is not supported by dot_general on CPU"), in Keras
        # alone too.
        predictions = to_numpy(model([x], training=False))
    else:
        # predict() compiles the whole model once; on JAX an eager call
        # compiles each op, several times slower for these models.
        predictions = to_numpy(model.predict(x, batch_size=len(x), verbose=0))
    np.testing.assert_allclose(
        predictions, PREDICTIONS[f"{name}.y"], rtol=0, atol=tolerance
    )


def loaded_policies(model):
    policies = {}
    for layer in model.layers:
        if isinstance(layer, keras.Model):
            # tf.keras saved no policy for a model (the global policy of
            # its construction): only its layers' policies are compared.
            for inner in layer.layers:
                key = f"{layer.name}/{inner.name}"
                policies[key] = inner.dtype_policy.name
        elif not isinstance(layer, keras.layers.InputLayer):
            # An InputLayer has its tensor's dtype, not a policy.
            policies[layer.name] = layer.dtype_policy.name
    return policies


def expected_policies(model, name):
    """The saved policies, under the names Keras 3 gives the layers."""
    nested = {layer.name for layer in model.layers if hasattr(layer, "layers")}
    inputs = {
        layer.name
        for layer in model.layers
        if isinstance(layer, keras.layers.InputLayer)
    }
    expected = {}
    for key, policy in MANIFEST[name]["layer_policies"].items():
        outer, _, inner = key.partition("/")
        if key in nested or key in inputs:
            continue
        if inner and outer in nested:
            key = f"{outer}/{inner.replace('/', '_')}"
        else:
            key = key.replace("/", "_")
        expected[key] = policy
    return expected


@pytest.mark.parametrize("name, file_name", CASES)
def test_loads_with_policies_predictions_and_optimizer(name, file_name):
    record = MANIFEST[name]
    model = load(name, file_name)
    assert loaded_policies(model) == expected_policies(model, name)
    assert_predictions_match(model, name)
    saved = record.get("optimizer")
    if saved is None or file_name.endswith(".json"):
        # JSON and an uncompiled save hold no optimizer.
        assert getattr(model, "optimizer", None) is None
        return
    optimizer = model.optimizer
    if saved["python_class"].startswith("LossScaleOptimizer"):
        assert isinstance(optimizer, kdp.LossScaleOptimizer)
        assert optimizer.dynamic == saved["dynamic"]
        inner = optimizer.inner_optimizer
        if not saved["dynamic"]:
            scale = float(to_numpy(optimizer.loss_scale))
            assert scale == saved["loss_scale"]
    else:
        inner = optimizer
    assert type(inner).__name__ == saved["inner_class"]
    if not inner.built:
        inner.build(model.trainable_variables)
    assert int(to_numpy(inner.iterations)) == saved["iterations"]


def test_nested_application_trains_its_head_only():
    name = "mobilenetv2_nested_mixed_float16"
    model = load(name, f"{name}.keras")
    base = model.get_layer("mobilenetv2_0.35_32")
    assert not base.trainable
    before = [to_numpy(w) for w in base.weights]
    x = PREDICTIONS[f"{name}.x"]
    y = np.eye(5, dtype="float32")[[0, 1]]
    model.fit(x, y, epochs=1, verbose=0)
    after = [to_numpy(w) for w in base.weights]
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    for weight in model.weights:
        assert np.all(np.isfinite(to_numpy(weight)))


def test_inspect_reports_nested_layers_and_attention():
    report = model_report.build_report(
        FIXTURES / "mobilenetv2_nested_mixed_float16.h5"
    )
    assert report["written_by"].startswith("tf.keras 2.")
    paths = [row["path"] for row in report["layers"]]
    assert "mobilenetv2_0.35_32/Conv1" in paths
    assert report["optimizer"]["loss_scaling"]["settings"]["dynamic"]
    text = model_report.build_report(FIXTURES / "text_mixed_bfloat16.keras")
    rows = {row["path"]: row for row in text["layers"]}
    assert rows["multi_head_attention"]["policy"] == "mixed_bfloat16"


@pytest.mark.parametrize(
    "file_name",
    ["text_mixed_float16.h5", "mobilenetv2_nested_mixed_float16.h5"],
)
def test_migrate_writes_a_file_keras_3_loads_alone(file_name, tmp_path):
    name = file_name.split(".")[0]
    target = tmp_path / "migrated.keras"
    migration = migrate.migrate(FIXTURES / file_name, target)
    assert migration.weights > 0
    model = keras.saving.load_model(target)
    assert_predictions_match(model, name)
