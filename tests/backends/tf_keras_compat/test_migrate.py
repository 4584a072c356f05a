"""`migrate`: real tf.keras 2 files rewritten as Keras 3 `.keras` files.

The migrated file must load without this package's patches (its registered
classes still need the package imported) and predict exactly what the
original predicts once loaded with them, on the backend of this run.
"""

import json
import pathlib
import warnings
import zipfile

import keras
import numpy as np
import pytest
from testing import keras_file_with_dtype
from testing import to_numpy

import keras_dtype_policy as kdp
from keras_dtype_policy import LossScaleOptimizer
from keras_dtype_policy.tf_keras_compat import legacy_policy_configs
from keras_dtype_policy.tf_keras_compat import migrate
from keras_dtype_policy.tf_keras_compat.model_files import ModelFileError
from keras_dtype_policy.tools.migration_report import format_migration

FIXTURES = (
    pathlib.Path(__file__).resolve().parents[2] / "fixtures" / "tf_keras2"
)
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())
MODELS = MANIFEST["models"]
COMPILED = {
    "dense_mixed_float16_adam_dynamic": (True, 32768.0),
    "dense_mixed_float16_adam_fixed": (False, 1024.0),
}


@pytest.fixture(autouse=True)
def fresh_reports():
    legacy_policy_configs._reported_scales.clear()
    yield
    legacy_policy_configs._reported_scales.clear()


def load_without_patches(path):
    kdp.uninstall()
    try:
        return keras.saving.load_model(path)
    finally:
        kdp.install()


def predict(model, x):
    return to_numpy(model.predict(x, verbose=0))


@pytest.mark.parametrize("suffix", [".h5", ".keras"])
@pytest.mark.parametrize(
    "model_name",
    [
        "dense_mixed_float16_adam_dynamic",
        "dense_mixed_float16_adam_fixed",
        "conv_mixed_bfloat16_adam",
        "lstm_mixed_float16",
        "dense_mixed_bfloat16",
    ],
)
def test_migrated_file_loads_alone_and_predicts_the_same(
    model_name, suffix, tmp_path
):
    old = FIXTURES / f"{model_name}{suffix}"
    new = tmp_path / "migrated.keras"
    result = migrate.migrate(old, new)
    assert result.target == new and new.exists()
    original = keras.saving.load_model(old)
    migrated = load_without_patches(new)
    x = np.load(FIXTURES / f"{model_name}.predictions.npz")["x"]
    np.testing.assert_array_equal(predict(migrated, x), predict(original, x))
    policies = {
        layer.name: layer.dtype_policy.name for layer in migrated.layers
    }
    for name, dtype in MODELS[model_name]["layer_dtypes_h5"].items():
        expected = dtype if isinstance(dtype, str) else dtype["config"]["name"]
        if name in policies:
            assert policies[name] == expected
    with zipfile.ZipFile(new) as archive:
        config = archive.read("config.json").decode()
        metadata = json.loads(archive.read("metadata.json"))
    assert "tf_keras" not in config and "LossScaleOptimizerV3" not in config
    assert metadata["keras_version"].startswith("3.")


@pytest.mark.parametrize("suffix", [".h5", ".keras"])
@pytest.mark.parametrize("model_name", sorted(COMPILED))
def test_optimizer_and_its_state_are_kept(model_name, suffix, tmp_path):
    new = tmp_path / "migrated.keras"
    result = migrate.migrate(FIXTURES / f"{model_name}{suffix}", new)
    assert result.optimizer_values > 0
    migrated = load_without_patches(new)
    optimizer = migrated.optimizer
    dynamic, initial_scale = COMPILED[model_name]
    assert type(optimizer) is LossScaleOptimizer
    assert optimizer.dynamic is dynamic
    assert optimizer.loss_scale == initial_scale
    state = MODELS[model_name]["optimizer_state"]
    assert int(to_numpy(optimizer.iterations)) == state["iterations"]
    inner = optimizer.inner_optimizer
    np.testing.assert_allclose(
        to_numpy(inner.variables[2]).ravel()[:5],
        state["first_adam_slots"]["m"]["first5"],
    )
    if dynamic:
        assert any("restarts at initial_scale 32768" in n for n in result.notes)


def test_changes_are_listed_object_by_object(tmp_path):
    result = migrate.migrate(
        FIXTURES / "dense_mixed_float16_adam_dynamic.h5",
        tmp_path / "migrated.keras",
    )
    changes = [str(change) for change in result.changes]
    for expected in (
        "dense: Policy(mixed_float16) -> "
        'keras_dtype_policy.DTypePolicy "mixed_float16"',
        "input_1: batch_input_shape renamed batch_shape",
        "batch_normalization: axis [1] -> 1",
        "optimizer: LossScaleOptimizerV3 -> "
        "keras_dtype_policy.LossScaleOptimizer",
        "optimizer.inner_optimizer: removed jit_compile=false, "
        "is_legacy_optimizer=false",
    ):
        assert expected in changes
    assert result.dropped_loss_scales == []
    migrated = load_without_patches(tmp_path / "migrated.keras")
    assert migrated.get_layer("dense").dtype_policy.name == "mixed_float16"
    reloaded = keras.saving.load_model(tmp_path / "migrated.keras")
    assert type(reloaded.get_layer("dense").dtype_policy) is kdp.DTypePolicy


def test_keras_files_report_their_compile_config_changes(tmp_path):
    result = migrate.migrate(
        FIXTURES / "dense_mixed_float16_adam_dynamic.keras",
        tmp_path / "migrated.keras",
    )
    changes = [str(change) for change in result.changes]
    assert "compile: steps_per_execution null -> 1" in changes
    assert any(c.startswith("model: Functional (tf_keras.") for c in changes)


def test_a_keras_3_file_needs_no_changes(tmp_path):
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(2, dtype="mixed_float16")]
    )
    model.compile("adam", "mse")
    model.save(tmp_path / "k3.keras")
    result = migrate.migrate(tmp_path / "k3.keras", tmp_path / "new.keras")
    changes = [str(change) for change in result.changes]
    if keras.backend.backend() == "torch":
        # The torch backend saves its own Adam subclass, which the
        # translation names by its public class for the other backends.
        # The compile config records the user's optimizer, not the
        # loss-scale wrapper that compile put around it.
        assert changes == [
            "optimizer: Adam "
            "(keras.src.backend.torch.optimizers.torch_adam) -> "
            "keras.optimizers.Adam"
        ]
    else:
        assert changes == []
        assert "  none" in format_migration(result)


def test_dropped_loss_scales_are_listed(tmp_path):
    forms = json.loads((FIXTURES / "legacy_layer_configs.json").read_text())
    form = next(f for f in forms if f["id"] == "policy_v1_fixed_loss_scale")
    keras_file_with_dtype(form["config"]["dtype"], tmp_path / "old.keras")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        result = migrate.migrate(tmp_path / "old.keras", tmp_path / "new.keras")
    assert len(result.dropped_loss_scales) == 1
    line = result.dropped_loss_scales[0]
    assert line.startswith("dense: PolicyV1(mixed_float16, loss_scale=")
    assert "FixedLossScale" in line
    lines = format_migration(result)
    assert lines[lines.index("loss scales dropped:") + 1] == f"  {line}"


def test_refuses_to_overwrite_or_write_elsewhere_than_keras(tmp_path):
    old = FIXTURES / "dense_mixed_bfloat16.h5"
    with pytest.raises(ModelFileError, match="must end in .keras"):
        migrate.migrate(old, tmp_path / "new.h5")
    existing = tmp_path / "existing.keras"
    existing.write_text("keep me")
    with pytest.raises(ModelFileError, match="--force"):
        migrate.migrate(old, existing)
    assert existing.read_text() == "keep me"
    migrate.migrate(old, existing, overwrite=True)
    assert zipfile.is_zipfile(existing)
    with pytest.raises(ModelFileError, match="no such file"):
        migrate.migrate(tmp_path / "missing.h5", tmp_path / "x.keras")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing.keras"]
