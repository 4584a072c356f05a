"""The Keras patches: where they sit, install(), uninstall()."""

import importlib
import inspect
import pathlib

import keras
import numpy as np
import pytest
from keras.src.layers.layer import Layer
from keras.src.ops.operation import Operation

import keras_dtype_policy as kdp
from keras_dtype_policy import patches
from keras_dtype_policy.policies import global_policy
from keras_dtype_policy.policies import keras_internals

BACKEND = keras.backend.backend()
# `Trainer` up to Keras 3.15, `BaseTrainer` from 3.16 (keras_internals).
Trainer = keras_internals.trainer_class()
TRAINER = f"{Trainer.__module__}.{Trainer.__qualname__}"

# What each patched Keras attribute must still accept; a Keras release that
# moves or reshapes one fails here, naming it.
EXPECTED_PARAMETERS = {
    f"{TRAINER}.compile": [
        "self",
        "optimizer",
        "loss",
        "loss_weights",
        "metrics",
        "weighted_metrics",
        "run_eagerly",
        "steps_per_execution",
        "jit_compile",
        "auto_scale_loss",
    ],
    f"{TRAINER}._aggregate_additional_loss": [
        "self",
        "loss",
    ],
    "keras.src.ops.operation.Operation.from_config": ["cls", "config"],
    "keras.src.dtype_policies.get": ["identifier"],
    "keras.src.dtype_policies.deserialize": ["config", "custom_objects"],
    "keras.src.saving.saving_lib._model_from_config": [
        "config_json",
        "custom_objects",
        "compile",
        "safe_mode",
    ],
    "keras.src.legacy.saving.saving_utils.model_from_config": [
        "config",
        "custom_objects",
    ],
    "keras.src.legacy.saving.saving_utils.compile_args_from_training_config": [
        "training_config",
        "custom_objects",
    ],
    "keras.src.legacy.saving.legacy_h5_format.load_model_from_hdf5": [
        "filepath",
        "custom_objects",
        "compile",
        "safe_mode",
    ],
    "keras.src.saving.saving_lib.load_weights_only": [
        "model",
        "filepath",
        "skip_mismatch",
        "objects_to_skip",
    ],
    "keras.src.layers.layer.Layer.__init__": [
        "self",
        "activity_regularizer",
        "trainable",
        "dtype",
        "autocast",
        "name",
        "kwargs",
    ],
    "keras.src.legacy.saving.legacy_h5_format._set_weights": [
        "instance",
        "symbolic_weights",
        "weight_values",
        "name",
        "skip_mismatch",
    ],
    "keras.src.saving.saving_lib.H5IOStore.__getitem__": ["self", "key"],
    "keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer"
    ".from_config": ["cls", "config", "custom_objects"],
    # A property: its setter's parameters.
    "keras.src.layers.layer.Layer.dtype_policy": ["self", "value"],
    "keras.dtype_policies.get": ["identifier"],
    "keras.config.set_dtype_policy": ["policy"],
    "keras.mixed_precision.set_dtype_policy": ["policy"],
    "keras.mixed_precision.set_global_policy": ["policy"],
}
# The public names that Keras binds to its own functions, each patched on
# its module (tf.keras' `config`, `dtype_policies` and `mixed_precision`
# are these modules): a Keras release that binds another function there
# fails here.
PUBLIC_NAMES = {
    "keras.dtype_policies.get": "keras.src.dtype_policies.get",
    **{
        f"{module}.{name}": "keras.src.dtype_policies.dtype_policy"
        ".set_dtype_policy"
        for module in (
            "keras.config",
            "keras.mixed_precision",
        )
        for name in ("set_dtype_policy", "set_global_policy")
        if not (module.endswith("config") and name == "set_global_policy")
    },
}
TARGETS = set(EXPECTED_PARAMETERS)


@pytest.mark.parametrize("target", sorted(EXPECTED_PARAMETERS))
def test_keras_still_defines_what_the_patches_replace(target):
    original = patches.installed_patches()[target][0]
    if isinstance(original, property):
        original = original.fset
    function = getattr(original, "__func__", original)
    parameters = list(inspect.signature(function).parameters)
    assert parameters == EXPECTED_PARAMETERS[target]


@pytest.mark.parametrize("target", sorted(PUBLIC_NAMES))
def test_public_names_are_keras_own_functions(target):
    original = patches.installed_patches()[target][0]
    module_name, _, name = PUBLIC_NAMES[target].rpartition(".")
    defining = importlib.import_module(module_name)
    keras_own = patches.installed_patches().get(PUBLIC_NAMES[target])
    expected = keras_own[0] if keras_own else vars(defining)[name]
    assert original is expected


def test_the_docs_list_every_patch():
    page = (
        pathlib.Path(__file__).resolve().parents[3]
        / "docs"
        / "how-it-touches-keras.md"
    ).read_text()
    for patch in patches.PATCHES:
        short_name = ".".join(patch.target.split(".")[-2:])
        # The page names the trainer `Trainer`, as Keras 3.12 to 3.15 do.
        short_name = short_name.replace(f"{Trainer.__name__}.", "Trainer.")
        assert f"| `{short_name}` |" in page, patch.target
    assert f"{len(patches.PATCHES)} Keras internals are patched" in page


def test_model_compile_is_the_trainers():
    # load_model skips compile_from_config for a model class whose compile
    # differs from Trainer.compile: the hook must sit on Trainer.compile.
    assert keras.Model.compile is Trainer.compile
    assert keras.Sequential.compile is Trainer.compile


def test_import_installs_every_patch():
    assert kdp.is_installed()
    assert set(patches.installed_patches()) == TARGETS
    for original, replacement in patches.installed_patches().values():
        assert original is not replacement
    assert (
        Trainer.__dict__["compile"]
        is patches.installed_patches()[f"{TRAINER}.compile"][1]
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
        assert Trainer.__dict__["compile"] is originals[f"{TRAINER}.compile"]
        assert (
            Operation.__dict__["from_config"]
            is originals["keras.src.ops.operation.Operation.from_config"]
        )
        kdp.uninstall()
        assert Trainer.__dict__["compile"] is originals[f"{TRAINER}.compile"]
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


def test_without_the_layer_init_patch_a_precision_scope_does_nothing():
    init = patches.installed_patches()["keras.src.layers.layer.Layer.__init__"]
    assert Layer.__dict__["__init__"] is init[1]
    # The replacement keeps Keras' signature: Keras reads it for configs.
    assert inspect.signature(init[1]) == inspect.signature(init[0])
    rules = kdp.PrecisionRules("mixed_bfloat16")
    kdp.uninstall()
    try:
        assert Layer.__dict__["__init__"] is init[0]
        with kdp.precision_scope(rules):
            layer = keras.layers.Dense(1)
        assert layer.dtype_policy.name == "float32"
    finally:
        kdp.install()
    with kdp.precision_scope(rules):
        layer = keras.layers.Dense(1)
    assert layer.dtype_policy.name == "mixed_bfloat16"


def test_install_refuses_a_moved_target(monkeypatch):
    kdp.uninstall()
    try:
        monkeypatch.delattr(Trainer, "compile")
        with pytest.raises(
            RuntimeError, match="cannot patch compile: .*Trainer"
        ):
            kdp.install()
    finally:
        monkeypatch.undo()
        kdp.uninstall()
        kdp.install()
    assert set(patches.installed_patches()) == TARGETS


def test_a_refused_install_leaves_nothing_patched(monkeypatch):
    # The last target missing: the patches applied before it are undone.
    from keras.src.saving import saving_lib

    originals = {t: o for t, (o, _) in patches.installed_patches().items()}
    kdp.uninstall()
    try:
        monkeypatch.delattr(saving_lib.H5IOStore, "__getitem__")
        with pytest.raises(RuntimeError, match="H5IOStore.__getitem__"):
            kdp.install()
        assert not kdp.is_installed()
        assert Trainer.__dict__["compile"] is originals[f"{TRAINER}.compile"]
    finally:
        monkeypatch.undo()
        kdp.uninstall()
        kdp.install()
    assert set(patches.installed_patches()) == TARGETS


def test_install_refuses_when_the_trainer_class_is_gone(monkeypatch):
    # A Keras that moved the shared trainer out of its module: the lookup
    # finds nothing, and install() says what it looked for, and where.
    kdp.uninstall()
    try:
        trainer_module = importlib.import_module(keras_internals.TRAINER_MODULE)
        monkeypatch.delattr(trainer_module, Trainer.__name__)
        with pytest.raises(RuntimeError) as raised:
            kdp.install()
        message = str(raised.value)
        assert "cannot patch compile" in message
        assert keras_internals.TRAINER_MODULE in message
        assert keras.__version__ in message
        assert not kdp.is_installed()
    finally:
        monkeypatch.undo()
        kdp.uninstall()
        kdp.install()
    assert set(patches.installed_patches()) == TARGETS


def test_the_trainer_is_found_by_what_it_defines():
    # Keras 3.12 to 3.15 call it Trainer; 3.16 renamed it BaseTrainer.
    major, minor = (int(part) for part in keras.__version__.split(".")[:2])
    expected = "BaseTrainer" if (major, minor) >= (3, 16) else "Trainer"
    assert Trainer.__name__ == expected
    assert Trainer.__module__ == "keras.src.trainers.trainer"
    assert issubclass(keras.Model, Trainer)
    assert "_aggregate_additional_loss" in vars(Trainer)


def test_quantized_names_follow_keras_own_modes():
    modes = keras_internals.quantization_modes()
    # Modes every Keras of the tested range knows; 3.16 adds "ternary".
    assert {"int8", "float8", "int4", "gptq"} <= set(modes)
    assert keras_internals.is_quantized_policy_name("int8_from_float32")
    assert not keras_internals.is_quantized_policy_name("mixed_bfloat16")
    policy = global_policy.as_policy("int8_from_mixed_bfloat16")
    assert policy.quantization_mode == "int8"
    assert type(policy) is not kdp.DTypePolicy


def test_keras_float8_layers_keep_the_float8_path_the_package_reads():
    """`float8.trains_in_float8` asks `keras_internals.float8_path_owner`:
    if a Keras release moves the float8 path again, no layer would train in
    float8 under a float8 policy."""
    dense = keras.layers.Dense(2)
    einsum = keras.layers.EinsumDense("ab,bc->ac", 2)
    assert keras_internals.float8_path_owner(dense) is keras.layers.Dense
    assert keras_internals.float8_path_owner(einsum) is keras.layers.EinsumDense
    for layer in (
        keras.layers.Layer(),
        keras.layers.LayerNormalization(),
        keras.layers.Embedding(4, 2),
    ):
        assert keras_internals.float8_path_owner(layer) is None, layer
    base = vars(keras.layers.Layer)
    if keras_release() >= (3, 16):
        assert keras_internals.QUANTIZATION_GEOMETRY in base
    else:
        assert keras_internals.FLOAT8_CALL in base


def test_a_moved_float8_path_fails_loudly(monkeypatch):
    for name in (
        keras_internals.FLOAT8_CALL,
        keras_internals.QUANTIZATION_GEOMETRY,
    ):
        monkeypatch.delattr(keras.layers.Layer, name, raising=False)
    with pytest.raises(keras_internals.KerasInternalsError) as raised:
        keras_internals.float8_path_owner(keras.layers.Dense(2))
    assert "_float8_call" in str(raised.value)
    assert "_quantization_geometry" in str(raised.value)


def keras_release():
    return tuple(int(part) for part in keras.__version__.split(".")[:2])


def test_quantization_modes_missing_everywhere_fail_loudly(monkeypatch):
    from keras.src.dtype_policies import dtype_policy

    # Keras 3.12 to 3.15 have the tuple only, 3.16 the registry only.
    monkeypatch.delattr(dtype_policy, "QUANTIZATION_MODES", raising=False)
    try:
        from keras.src.quantizers import strategy_registry
    except ImportError:
        strategy_registry = None
    if strategy_registry is not None:
        monkeypatch.delattr(strategy_registry, "registered_modes")
    with pytest.raises(keras_internals.KerasInternalsError) as raised:
        keras_internals.quantization_modes()
    assert "QUANTIZATION_MODES" in str(raised.value)
    assert "registered_modes" in str(raised.value)


def regularized_mixed_model():
    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(
                4,
                activity_regularizer="l2",
                kernel_regularizer="l2",
                dtype="mixed_float16",
            ),
            keras.layers.Dense(1, dtype="mixed_float16"),
        ]
    )
    model.compile("sgd", "mse", auto_scale_loss=False)
    return model


def test_regularization_losses_are_summed_in_float32():
    # tensorflow: Keras alone refuses to sum a float16 activity loss with a
    # float32 weight loss; jax and torch promote the dtypes themselves.
    x, y = np.ones((8, 3)), np.ones((8, 1))
    model = regularized_mixed_model()
    history = model.fit(x, y, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    kdp.uninstall()
    try:
        model = regularized_mixed_model()
        if BACKEND == "tensorflow":
            with pytest.raises(TypeError, match="float16"):
                model.fit(x, y, verbose=0)
        else:
            model.fit(x, y, verbose=0)
    finally:
        kdp.install()
