"""Parity with keras.optimizers.LossScaleOptimizer, step for step."""

import keras
import numpy as np
import pytest
from testing import to_numpy

import keras_dtype_policy as kdp


def make_model():
    return keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, activation="tanh", dtype="mixed_float16"),
            keras.layers.Dense(1, dtype="float32"),
        ]
    )


def batches(num_steps, overflow_steps):
    rng = np.random.default_rng(7)
    for step in range(num_steps):
        x = rng.normal(size=(8, 4)).astype("float32")
        y = rng.normal(size=(8, 1)).astype("float32")
        if step in overflow_steps:
            x = x * 1e6
        yield x, y


@pytest.mark.parametrize(
    "kwargs, num_steps, overflow_steps",
    [
        ({}, 12, {1, 2, 6}),
        ({"dynamic_growth_steps": 2}, 14, {0, 5, 6, 7, 11}),
    ],
    ids=["keras_defaults", "fast_growth"],
)
def test_same_scale_and_weights_as_keras_every_step(
    kwargs, num_steps, overflow_steps
):
    keras_model, plugin_model = make_model(), make_model()
    plugin_model.set_weights(keras_model.get_weights())
    keras_model.compile(
        keras.optimizers.LossScaleOptimizer(
            keras.optimizers.Adam(1e-2), **kwargs
        ),
        "mse",
    )
    plugin_model.compile(
        kdp.LossScaleOptimizer(keras.optimizers.Adam(1e-2), **kwargs), "mse"
    )
    assert type(keras_model.optimizer) is keras.optimizers.LossScaleOptimizer
    scales = []
    for x, y in batches(num_steps, overflow_steps):
        keras_model.train_on_batch(x, y)
        plugin_model.train_on_batch(x, y)
        keras_scale = float(to_numpy(keras_model.optimizer.dynamic_scale))
        assert plugin_model.optimizer.loss_scale == keras_scale
        scales.append(keras_scale)
        for a, b in zip(
            keras_model.get_weights(), plugin_model.get_weights(), strict=True
        ):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert len(set(scales)) > 2  # the scale really moved both ways
    assert plugin_model.optimizer.skipped_steps == len(overflow_steps)
    assert int(to_numpy(plugin_model.optimizer.iterations)) == int(
        to_numpy(keras_model.optimizer.iterations)
    )
