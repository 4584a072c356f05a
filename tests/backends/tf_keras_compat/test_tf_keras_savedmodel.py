"""tf.keras 2 SavedModel directories: migrate, inspect and load_model.

The directories in tests/fixtures/tf_keras2/savedmodel were written by
tf-keras 2.21 with `model.save(dir)` (savedmodel_fixtures.py there): a small
Conv2D, BatchNormalization, Dense model under mixed_float16 and
mixed_bfloat16, uncompiled and compiled with LossScaleOptimizer(Adam)
dynamic, LossScaleOptimizer(SGD(momentum=0.9)) fixed and plain Adam, the
same layers as a frozen nested model, and one whose metadata carries the
experimental policy's form.

The configs are read without TensorFlow on every backend. The weights and
the optimizer's state are in a TensorFlow checkpoint: where TensorFlow is
installed (tox installs it in the tensorflow environment only) the
directories convert to .keras files with tf-keras' predictions, the
policies as saved, and the optimizer state exact, the loss scale and its
counter included; where it is not (tox's jax and torch environments), the
same commands say in one line that TensorFlow is needed.
"""

import json
import pathlib
import shutil
import sys

import keras
import numpy as np
import pytest
from saved_model_checks import HAS_TENSORFLOW
from saved_model_checks import assert_optimizer_state
from saved_model_checks import loaded_policies
from saved_model_checks import needs_tensorflow
from saved_model_checks import without_tensorflow
from testing import to_numpy

import keras_dtype_policy as kdp
from keras_dtype_policy.tf_keras_compat import migrate
from keras_dtype_policy.tf_keras_compat import model_files
from keras_dtype_policy.tf_keras_compat.model_files import ModelFileError
from keras_dtype_policy.tools import cli
from keras_dtype_policy.tools import model_report

FIXTURES = (
    pathlib.Path(__file__).resolve().parents[2]
    / "fixtures"
    / "tf_keras2"
    / "savedmodel"
)
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())["models"]
EXPECTED = np.load(FIXTURES / "expected.npz")
MODELS = sorted(name for name in MANIFEST if name != "not_keras")
COMPILED = [name for name in MODELS if "optimizer" in MANIFEST[name]]
EPSILON = {"float16": 2.0**-10, "bfloat16": 2.0**-7}
BACKEND = keras.backend.backend()
ERROR = "keras-dtype-policy: error: "


def test_each_backend_has_the_tensorflow_it_is_expected_to_have():
    # The tensorflow backend always has it; tox's jax and torch
    # environments do not install it, where the error tests below run.
    if BACKEND == "tensorflow":
        assert HAS_TENSORFLOW


@pytest.mark.parametrize("name", MODELS)
def test_configs_are_read_without_loading(name):
    source = model_files.read_model_file(FIXTURES / name)
    assert source.format == "savedmodel"
    assert source.from_tf_keras
    assert source.writer == "tf.keras 2.21.0"
    assert source.holds_loss_scale_state
    assert (source.compile_config is not None) == (name in COMPILED)
    changes = [str(change) for change in migrate.config_changes(source)]
    policy = MANIFEST[name]["policy"]
    assert any(
        change.split(": ")[0] in ("conv", "base/conv")
        and f'DTypePolicy "{policy}"' in change
        for change in changes
    ), changes


def assert_converted(model, name):
    record = MANIFEST[name]
    compute = kdp.DTypePolicy(record["policy"]).compute_dtype
    predictions = to_numpy(model([EXPECTED[f"{name}.x"]], training=False))
    np.testing.assert_allclose(
        predictions, EXPECTED[f"{name}.y"], rtol=0, atol=8 * EPSILON[compute]
    )
    assert loaded_policies(model) == {
        path: policy
        for path, policy in record["layer_policies"].items()
        # An InputLayer has its tensor's dtype, not a policy; tf.keras
        # saved none for a nested model (its layers' are compared).
        if path.rsplit("/", 1)[-1] != "image" and path != "base"
    }
    if name in COMPILED:
        assert_optimizer_state(
            model.optimizer, record["optimizer"], EXPECTED, name
        )
    else:
        assert getattr(model, "optimizer", None) is None


@needs_tensorflow
@pytest.mark.parametrize("name", MODELS)
def test_migrate_gives_a_keras_3_file_with_weights_and_state(name, tmp_path):
    target = tmp_path / f"{name}.keras"
    migration = migrate.migrate(FIXTURES / name, target)
    assert migration.source.format == "savedmodel"
    assert migration.weights == MANIFEST[name]["weights"]
    assert (migration.optimizer_values > 0) == (name in COMPILED)
    assert not any("restarts at initial_scale" in n for n in migration.notes)
    if name == "conv_experimental_policy":
        assert len(migration.dropped_loss_scales) == 7
    else:
        assert migration.dropped_loss_scales == []
    keras.utils.clear_session()
    model = keras.saving.load_model(target)
    assert_converted(model, name)


@needs_tensorflow
def test_load_model_reads_a_directory():
    name = "conv_mixed_float16_lso_dynamic"
    assert_converted(kdp.load_model(FIXTURES / name), name)


@needs_tensorflow
def test_load_model_under_another_policy():
    model = kdp.load_model(FIXTURES / "conv_mixed_float16", policy="float32")
    assert model.get_layer("conv").dtype_policy.name == "float32"
    predictions = to_numpy(model([EXPECTED["conv_mixed_float16.x"]]))
    np.testing.assert_allclose(
        predictions, EXPECTED["conv_mixed_float16.y"], atol=8 * 2.0**-10
    )


@needs_tensorflow
def test_inspect_lists_layers_policies_and_the_loss_scale(capsys):
    directory = FIXTURES / "conv_mixed_float16_lso_dynamic"
    assert cli.main(["inspect", str(directory), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["format"] == "savedmodel"
    assert report["written_by"] == "tf.keras 2.21.0"
    rows = {row["path"]: row for row in report["layers"]}
    saved = MANIFEST["conv_mixed_float16_lso_dynamic"]["layer_policies"]
    assert {path: rows[path]["policy"] for path in rows} == saved
    scaling = report["optimizer"]["loss_scaling"]
    assert scaling["state"] == {
        "loss_scale": 8192.0,
        "dynamic_counter": 1,
        "skipped_steps": 0,
    }
    assert report["optimizer"]["iterations"] == 7
    assert not any("no loss-scale state" in note for note in report["notes"])
    assert cli.main(["inspect", str(directory)]) == 0
    text = capsys.readouterr().out
    assert "(SavedModel directory, written by tf.keras 2.21.0)" in text
    assert "conv_bn    BatchNormalization  mixed_float16" in text
    assert "state    loss_scale                8192 (2^13)" in text


@needs_tensorflow
def test_migrate_command(tmp_path, capsys):
    directory = FIXTURES / "conv_mixed_float16_lso_fixed"
    target = tmp_path / "fixed.keras"
    assert cli.main(["migrate", str(directory), str(target)]) == 0
    out = capsys.readouterr().out
    assert f"migrated {directory} (tf.keras 2.21.0) -> {target}" in out
    assert "optimizer: LossScaleOptimizerV3 -> " in out
    assert "loads with the same 14 weights and" in out


@needs_tensorflow
def test_a_checkpoint_that_does_not_match_is_reported(tmp_path):
    directory = tmp_path / "mixed"
    shutil.copytree(FIXTURES / "conv_mixed_float16", directory)
    shutil.rmtree(directory / "variables")
    shutil.copytree(
        FIXTURES / "conv_mixed_bfloat16_adam" / "variables",
        directory / "variables",
    )
    with pytest.raises(ModelFileError, match=f"^{directory}: its checkpoint"):
        migrate.migrate(directory, tmp_path / "mixed.keras")


@needs_tensorflow
def test_a_compiled_model_without_optimizer_state_starts_afresh(tmp_path):
    # As saved with include_optimizer=False: a training config, no
    # optimizer in the checkpoint.
    directory = tmp_path / "no_optimizer"
    shutil.copytree(FIXTURES / "conv_mixed_float16", directory)
    shutil.copy(
        FIXTURES / "conv_mixed_float16_lso_dynamic" / "keras_metadata.pb",
        directory,
    )
    report = model_report.build_report(directory)
    assert any("holds no optimizer state" in n for n in report["notes"])
    assert report["optimizer"]["iterations"] == 0
    assert report["optimizer"]["loss_scaling"]["state"]["loss_scale"] == 1024


def tensorflow_error(directory):
    return (
        f"{directory}: reading a SavedModel directory needs TensorFlow, "
        "which is not installed: pip install tensorflow-cpu"
    )


@without_tensorflow
@pytest.mark.parametrize("command", ["inspect", "migrate"])
def test_without_tensorflow_the_commands_say_so(command, tmp_path, capsys):
    directory = FIXTURES / "conv_mixed_float16_lso_dynamic"
    args = [command, str(directory)]
    if command == "migrate":
        args.append(str(tmp_path / "new.keras"))
    assert cli.main(args) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(ERROR + tensorflow_error(directory))
    assert captured.err.count("\n") == 1
    assert not (tmp_path / "new.keras").exists()


def test_the_missing_tensorflow_error_on_every_backend(monkeypatch, tmp_path):
    # Where TensorFlow is installed, its absence is simulated.
    monkeypatch.setitem(sys.modules, "tensorflow", None)
    directory = FIXTURES / "conv_mixed_float16"
    with pytest.raises(ModelFileError) as caught:
        migrate.migrate(directory, tmp_path / "new.keras")
    assert str(caught.value).startswith(tensorflow_error(directory))
    with pytest.raises(ModelFileError, match="needs TensorFlow"):
        kdp.load_model(directory)


def encode_metadata(nodes):
    """A `keras_metadata.pb` holding `(node_path, metadata JSON)` nodes."""

    def varint(value):
        out = bytearray()
        while True:
            byte = value & 0x7F
            value >>= 7
            out.append(byte | (0x80 if value else 0))
            if not value:
                return bytes(out)

    def field(number, payload):
        return varint(number << 3 | 2) + varint(len(payload)) + payload

    data = b""
    for node_id, (path, metadata) in enumerate(nodes):
        node = varint(2 << 3) + varint(node_id)
        node += field(3, path.encode()) + field(4, b"_tf_keras_network")
        node += field(5, metadata.encode())
        data += field(1, node)
    return data


def broken_copy(tmp_path, metadata):
    directory = tmp_path / "model"
    shutil.copytree(FIXTURES / "conv_mixed_float16", directory)
    (directory / "keras_metadata.pb").write_bytes(metadata)
    return directory


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda tmp: tmp, "is a directory, but no SavedModel"),
        (
            lambda tmp: FIXTURES / "not_keras",
            "a SavedModel that Keras did not write (it holds no "
            "keras_metadata.pb); Keras 3 can only call it, with "
            "keras.layers.TFSMLayer",
        ),
        (
            lambda tmp: broken_copy(tmp, b"\x0a\xff\xff\xff\xff\x0f"),
            "not Keras metadata (a SavedMetadata protobuf): truncated",
        ),
        (
            lambda tmp: broken_copy(tmp, b"\x0f\x01"),
            "not Keras metadata (a SavedMetadata protobuf)",
        ),
        (
            lambda tmp: broken_copy(
                tmp, encode_metadata([("root.layer-0", "{}")])
            ),
            "its Keras metadata has no root node",
        ),
        (
            lambda tmp: broken_copy(
                tmp, encode_metadata([("root", '{"class_name": ')])
            ),
            "its root metadata is not JSON",
        ),
        (
            lambda tmp: broken_copy(
                tmp,
                encode_metadata([("root", '{"class_name": "MyModel"}')]),
            ),
            "holds a subclassed MyModel with no config to rebuild it from",
        ),
    ],
    ids=[
        "no-savedmodel",
        "not-keras",
        "truncated-metadata",
        "garbage-metadata",
        "no-root",
        "root-not-json",
        "subclassed",
    ],
)
def test_bad_directories_are_named_in_one_line(
    make, fragment, tmp_path, capsys
):
    directory = make(tmp_path)
    with pytest.raises(ModelFileError) as caught:
        model_files.read_model_file(directory)
    assert str(caught.value).startswith(f"{directory}")
    assert fragment in str(caught.value)
    assert cli.main(["inspect", str(directory)]) == 1
    captured = capsys.readouterr()
    assert captured.err.startswith(f"{ERROR}{directory}")
    assert captured.err.count("\n") == 1
