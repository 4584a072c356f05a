"""LowPrecisionOptimizer's attributes: the update rule under both names,
a step without variables, and the cache of TensorFlow's compiled steps.

Each test runs on the backend KERAS_BACKEND names; every expectation holds
on tensorflow, jax and torch alike unless a test says otherwise.
"""

import keras
import numpy as np
import pytest
from testing import BACKEND
from testing import to_numpy

from keras_dtype_policy import LowPrecisionOptimizer
from keras_dtype_policy.low_precision.step_targets import StepCache


def as_float32(x):
    # Cast first: TensorFlow cannot turn a bfloat16 scalar into NumPy.
    return np.asarray(to_numpy(keras.ops.cast(x, "float32")))


@pytest.mark.parametrize("rule", ["kahan", "stochastic_rounding", "nearest"])
def test_update_is_an_alias_of_update_rule(rule):
    optimizer = LowPrecisionOptimizer(keras.optimizers.SGD(), update=rule)
    assert optimizer.update_rule == rule
    assert optimizer.update == rule
    # Saved files and string options know the argument as "update".
    config = optimizer.get_config()
    assert config["update"] == rule
    assert "update_rule" not in config
    assert LowPrecisionOptimizer.from_config(config).update_rule == rule
    # Read-only (another value: TensorFlow's tracking skips assigning the
    # value an attribute already has).
    with pytest.raises(AttributeError):
        optimizer.update = "another"
    with pytest.raises(AttributeError):
        optimizer.update_rule = "another"


def test_the_default_update_rule_is_kahan():
    optimizer = LowPrecisionOptimizer(keras.optimizers.SGD())
    assert optimizer.update_rule == optimizer.update == "kahan"


def test_a_first_step_without_variables_says_what_it_needs():
    # As Keras' own optimizers say it.
    optimizer = LowPrecisionOptimizer(keras.optimizers.SGD())
    with pytest.raises(ValueError, match="trainable_variables=None"):
        optimizer.apply([keras.ops.ones((2,))])
    assert not optimizer.built


def test_the_step_cache_is_the_optimizer_own_and_starts_empty():
    optimizer = LowPrecisionOptimizer(keras.optimizers.Adam())
    assert optimizer._step_cache == StepCache()
    other = LowPrecisionOptimizer(keras.optimizers.Adam())
    assert other._step_cache is not optimizer._step_cache


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's tracking")
def test_tensorflow_tracking_never_sees_the_compiled_steps(tmp_path):
    import tensorflow as tf

    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3, dtype="bfloat16")]
    )
    model.compile(
        LowPrecisionOptimizer(keras.optimizers.Adam(1e-2), seed=1), loss="mse"
    )
    x = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
    model.fit(x, x[:, :3], batch_size=8, verbose=0)
    optimizer = model.optimizer
    assert len(optimizer._step_cache.steps) == 1
    tracked = tf.train.TrackableView(optimizer).descendants()
    assert not any(
        isinstance(t, (StepCache, tf.types.experimental.PolymorphicFunction))
        for t in tracked
    )
    # A .keras file saves and restores the state as without the cache.
    model.save(tmp_path / "model.keras")
    restored = keras.saving.load_model(tmp_path / "model.keras")
    assert restored.optimizer._step_cache == StepCache()
    saved = optimizer.variables
    loaded = restored.optimizer.variables
    assert len(saved) == len(loaded)
    for a, b in zip(saved, loaded, strict=True):
        np.testing.assert_array_equal(as_float32(a), as_float32(b))
