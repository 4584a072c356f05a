"""The Keras patches: where they sit, install(), uninstall()."""

import inspect

import keras
import pytest
from keras.src.ops.operation import Operation
from keras.src.trainers.trainer import Trainer

import keras_dtype_policy as kdp
from keras_dtype_policy import patches

TARGETS = {
    "keras.src.trainers.trainer.Trainer.compile",
    "keras.src.ops.operation.Operation.from_config",
}


def test_keras_still_defines_what_the_patches_replace():
    # If a Keras release moves these, this test names what moved.
    original_compile = patches.installed_patches()[
        "keras.src.trainers.trainer.Trainer.compile"
    ][0]
    parameters = inspect.signature(original_compile).parameters
    assert {"self", "optimizer", "auto_scale_loss"} <= set(parameters)
    assert keras.Model.compile is Trainer.compile
    from_config = patches.installed_patches()[
        "keras.src.ops.operation.Operation.from_config"
    ][0]
    assert isinstance(from_config, classmethod)
    assert list(inspect.signature(from_config.__func__).parameters) == [
        "cls",
        "config",
    ]


def test_import_installs_every_patch():
    assert kdp.is_installed()
    assert set(patches.installed_patches()) == TARGETS
    for original, replacement in patches.installed_patches().values():
        assert original is not replacement
    assert (
        Trainer.__dict__["compile"]
        is patches.installed_patches()[
            "keras.src.trainers.trainer.Trainer.compile"
        ][1]
    )


def test_install_is_idempotent():
    before = patches.installed_patches()
    kdp.install()
    kdp.install()
    assert patches.installed_patches() == before


def test_uninstall_restores_keras_exactly():
    originals = {t: o for t, (o, _) in patches.installed_patches().items()}
    kdp.uninstall()
    try:
        assert not kdp.is_installed()
        assert (
            Trainer.__dict__["compile"]
            is originals["keras.src.trainers.trainer.Trainer.compile"]
        )
        assert (
            Operation.__dict__["from_config"]
            is originals["keras.src.ops.operation.Operation.from_config"]
        )
        kdp.uninstall()
        assert (
            Trainer.__dict__["compile"]
            is originals["keras.src.trainers.trainer.Trainer.compile"]
        )
    finally:
        kdp.install()


def test_without_the_hook_keras_rules_again():
    kdp.uninstall()
    try:
        model = keras.Sequential(
            [keras.Input((2,)), keras.layers.Dense(1, dtype="mixed_float16")]
        )
        model.compile("sgd", "mse")
        assert isinstance(model.optimizer, keras.optimizers.SGD)
        assert not isinstance(
            model.optimizer, keras.optimizers.LossScaleOptimizer
        )
        layer = keras.layers.Dense(2, dtype=kdp.DTypePolicy("mixed_bfloat16"))
        revived = keras.layers.Dense.from_config(layer.get_config())
        assert type(revived.dtype_policy) is keras.DTypePolicy
    finally:
        kdp.install()
    model.compile("sgd", "mse")
    assert isinstance(model.optimizer, kdp.LossScaleOptimizer)


def test_install_refuses_a_moved_target(monkeypatch):
    kdp.uninstall()
    try:
        monkeypatch.delattr(Trainer, "compile")
        with pytest.raises(RuntimeError, match="Trainer.compile"):
            kdp.install()
    finally:
        monkeypatch.undo()
        kdp.uninstall()
        kdp.install()
    assert set(patches.installed_patches()) == TARGETS
