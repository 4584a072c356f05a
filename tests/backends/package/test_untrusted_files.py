"""Untrusted and broken inputs: nothing runs, nothing half-loads."""

import json
import sys
import warnings

import h5py
import keras
import pytest
from testing import rewrite_keras_archive

import keras_dtype_policy as kdp
from keras_dtype_policy import LossScaleOptimizer
from keras_dtype_policy import Policy
from keras_dtype_policy import get_loss_scale
from keras_dtype_policy.tf_keras_compat import config_translation

SENTINEL = "kdp_sentinel_module"


@pytest.fixture
def sentinel(tmp_path, monkeypatch):
    """A module that records being imported; named by hostile configs."""
    marker = tmp_path / "imported"
    (tmp_path / f"{SENTINEL}.py").write_text(
        f"open({str(marker)!r}, 'w').write('imported')\nclass Evil:\n"
        "    @classmethod\n    def from_config(cls, config):\n"
        "        raise SystemExit('executed')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield marker
    assert not marker.exists(), "a config made Python import its module"
    assert SENTINEL not in sys.modules


HOSTILE = {"module": SENTINEL, "class_name": "Evil", "config": {}}


def test_configs_naming_other_modules_import_nothing(sentinel):
    for read in (
        lambda: keras.layers.Dense(2, dtype=HOSTILE),
        lambda: keras.layers.Dense(
            2, dtype={**HOSTILE, "class_name": "Policy", "config": {"name": 1}}
        ),
        lambda: get_loss_scale(HOSTILE),
        lambda: LossScaleOptimizer.from_config({"inner_optimizer": HOSTILE}),
        lambda: kdp.model_from_json(json.dumps(HOSTILE)),
    ):
        with pytest.raises((TypeError, ValueError)):
            read()
    # The translation of saved configs only rewrites; it never resolves.
    config_translation.translate_model_config(
        {"class_name": "Functional", "config": {"layers": [HOSTILE]}}
    )


def _model_with_lambda():
    return keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(2, dtype=kdp.DTypePolicy("mixed_float16")),
            keras.layers.Lambda(lambda x: x * 2),
        ]
    )


@pytest.mark.parametrize("suffix", [".keras", ".h5"])
def test_safe_mode_is_respected(suffix, tmp_path):
    path = tmp_path / f"lambda{suffix}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _model_with_lambda().save(path)
    with pytest.raises(ValueError, match="safe_mode"):
        keras.saving.load_model(path)
    loaded = keras.saving.load_model(path, safe_mode=False)
    assert loaded.layers[0].dtype_policy.name == "mixed_float16"


def _saved_model(tmp_path, suffix):
    with kdp.policy_scope("mixed_float16"):
        model = keras.Sequential(
            [keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)]
        )
    model.compile("adam", "mse")
    path = tmp_path / f"model{suffix}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save(path)
    return path


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _wrong_layers(members):
    config = json.loads(members["config.json"])
    config["config"]["layers"] = [5, "x"]
    members["config.json"] = json.dumps(config).encode()


def _missing_weights(members):
    del members["model.weights.h5"]


def _truncated_weights(members):
    weights = members["model.weights.h5"]
    members["model.weights.h5"] = weights[: len(weights) // 2]


@pytest.mark.parametrize(
    "suffix, damage",
    [
        (".keras", _truncate),
        (".h5", _truncate),
        (".keras", lambda p: p.write_bytes(b"not a model")),
        (".keras", lambda p: rewrite_keras_archive(p, _wrong_layers)),
        (".keras", lambda p: rewrite_keras_archive(p, _missing_weights)),
        (".keras", lambda p: rewrite_keras_archive(p, _truncated_weights)),
        (
            ".keras",
            lambda p: rewrite_keras_archive(
                p, lambda m: m.update({"config.json": b"[]"})
            ),
        ),
    ],
    ids=[
        "truncated_keras",
        "truncated_h5",
        "not_a_model",
        "layers_of_the_wrong_shape",
        "no_weights",
        "truncated_weights",
        "config_is_a_list",
    ],
)
def test_broken_files_raise_a_clear_error(suffix, damage, tmp_path):
    path = _saved_model(tmp_path, suffix)
    damage(path)
    with pytest.raises((ValueError, TypeError, OSError)) as info:
        keras.saving.load_model(path)
    assert str(info.value)


def test_a_file_missing_one_layers_weights_is_refused(tmp_path):
    path = _saved_model(tmp_path, ".keras")

    def drop_a_layer(members):
        weights = tmp_path / "w.h5"
        weights.write_bytes(members["model.weights.h5"])
        with h5py.File(weights, "r+") as f:
            del f["layers/dense_1"]
        members["model.weights.h5"] = weights.read_bytes()

    rewrite_keras_archive(path, drop_a_layer)
    with pytest.raises(ValueError, match="could not be loaded"):
        keras.saving.load_model(path)


@pytest.mark.parametrize(
    "config",
    [
        {"name": "mixed_float16", "loss_scale": {"class_name": "Fixed"}},
        {"name": ["mixed_float16"]},
        {"name": "mixed_float16", "loss_scale": "sometimes"},
    ],
)
def test_policy_configs_of_the_wrong_shape(config):
    with pytest.raises((TypeError, ValueError), match="Received"):
        Policy.from_config(config)
