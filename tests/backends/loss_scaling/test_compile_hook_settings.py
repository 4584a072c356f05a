"""The compile hook keeps every setting the user chose, or says so.

An optimizer's `loss_scale_factor` under a model that asks for loss
scaling becomes the fixed scale of the package's wrapper (Keras' own
wrapper drops it; left alone, Keras' fixed path has no finiteness check).
Every other optimizer and compile setting passes through unchanged.
"""

import warnings

import keras
import numpy as np
import pytest
from testing import to_numpy

import keras_dtype_policy as kdp
from keras_dtype_policy import Policy


def mlp(policy="float32"):
    with kdp.policy_scope(policy):
        return keras.Sequential(
            [
                keras.Input((3,)),
                keras.layers.Dense(4),
                keras.layers.Dense(1, dtype="float32"),
            ]
        )


def legacy_policy(loss_scale):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return Policy("mixed_float16", loss_scale=loss_scale)


@pytest.mark.parametrize("policy", ["float16", "mixed_float16"])
def test_loss_scale_factor_becomes_the_fixed_scale(policy):
    model = mlp(policy)
    model.compile(keras.optimizers.Adam(0.01, loss_scale_factor=128), "mse")
    optimizer = model.optimizer
    assert isinstance(optimizer, kdp.LossScaleOptimizer)
    assert optimizer.dynamic is False
    assert optimizer.loss_scale == 128.0
    # The wrapper scales once: the inner optimizer no longer does.
    assert optimizer.inner_optimizer.loss_scale_factor is None
    # The compile config names the user's optimizer, factor included, so a
    # reloaded model is wrapped the same way.
    config = model.get_compile_config()["optimizer"]
    assert config["class_name"] == "Adam"
    assert config["config"]["loss_scale_factor"] == 128

    x = np.ones((8, 3), "float32")
    x[4] = np.inf  # the second step overflows: skipped, not applied
    model.fit(x, x[:, :1], batch_size=4, shuffle=False, verbose=0)
    assert optimizer.loss_scale == 128.0
    assert optimizer.skipped_steps == 1
    for weight in model.weights:
        assert np.isfinite(to_numpy(weight)).all()


def test_loss_scale_factor_reloads_as_the_same_fixed_scale(tmp_path):
    model = mlp("mixed_float16")
    model.compile(keras.optimizers.Adam(0.01, loss_scale_factor=64), "mse")
    model.save(tmp_path / "model.keras")
    optimizer = keras.saving.load_model(tmp_path / "model.keras").optimizer
    assert isinstance(optimizer, kdp.LossScaleOptimizer)
    assert (optimizer.dynamic, optimizer.loss_scale) == (False, 64.0)


def test_loss_scale_factor_wins_over_a_policy_loss_scale_with_a_warning():
    model = mlp(legacy_policy(256))
    with pytest.warns(UserWarning, match=r"loss_scale_factor=128 .*policy"):
        model.compile(keras.optimizers.Adam(loss_scale_factor=128), "mse")
    assert model.optimizer.loss_scale == 128.0
    assert model.optimizer.dynamic is False


def test_a_policy_loss_scale_equal_to_the_factor_warns_nothing():
    model = mlp(legacy_policy(128))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model.compile(keras.optimizers.Adam(loss_scale_factor=128), "mse")
    assert model.optimizer.loss_scale == 128.0


def test_a_policy_loss_scale_is_recorded_with_its_wrapper():
    # A legacy policy's loss scale is not saved with the policy: the file
    # names the wrapper, which brings the scale back.
    model = mlp(legacy_policy(256))
    model.compile("adam", "mse")
    config = model.get_compile_config()["optimizer"]
    assert config["registered_name"] == "keras_dtype_policy>LossScaleOptimizer"


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_loss_scale_factor_without_float16_is_keras_own(policy):
    # Nothing asks for the wrapper: Keras' own fixed scaling, as without
    # the package.
    optimizer = keras.optimizers.Adam(loss_scale_factor=128)
    model = mlp(policy)
    model.compile(optimizer, "mse")
    assert model.optimizer is optimizer
    assert optimizer.loss_scale_factor == 128


def test_auto_wrapped_compile_config_names_the_users_optimizer():
    model = mlp("mixed_float16")
    model.compile(keras.optimizers.SGD(0.05), "mse")
    assert isinstance(model.optimizer, kdp.LossScaleOptimizer)
    config = model.get_compile_config()["optimizer"]
    assert config["class_name"] == "SGD"
    assert config["config"]["learning_rate"] == pytest.approx(0.05)


@pytest.mark.parametrize(
    "setting, value",
    [
        ("clipnorm", 1.0),
        ("global_clipnorm", 1.0),
        ("clipvalue", 0.5),
        ("gradient_accumulation_steps", 2),
        ("use_ema", True),
        ("weight_decay", 0.01),
    ],
)
def test_inner_optimizer_settings_are_kept(setting, value):
    inner = keras.optimizers.AdamW(**{setting: value})
    model = mlp("mixed_float16")
    model.compile(inner, "mse")
    assert model.optimizer.inner_optimizer is inner
    assert getattr(inner, setting) == value
    config = model.get_compile_config()["optimizer"]["config"]
    assert config[setting] == value


def test_an_explicit_keras_wrapper_is_kept_with_its_settings():
    wrapper = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.Adam(), initial_scale=64, dynamic_growth_steps=7
    )
    model = mlp("float16")
    model.compile(wrapper, "mse")
    assert model.optimizer is wrapper
    assert (wrapper.initial_scale, wrapper.dynamic_growth_steps) == (64, 7)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_compile_settings_are_kept_as_keras_alone_keeps_them(jit_compile):
    settings = dict(jit_compile=jit_compile, steps_per_execution=2)
    kdp.uninstall()
    try:
        alone = mlp("mixed_float16")
        alone.compile("adam", "mse", **settings)
    finally:
        kdp.install()
    model = mlp("mixed_float16")
    model.compile("adam", "mse", **settings)
    assert isinstance(model.optimizer, kdp.LossScaleOptimizer)
    assert model.steps_per_execution == alone.steps_per_execution == 2
    # Keras may turn an asked-for XLA off where a backend lacks it; the
    # package decides as Keras alone does on one device.
    assert model.jit_compile == alone.jit_compile
