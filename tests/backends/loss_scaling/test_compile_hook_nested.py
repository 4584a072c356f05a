"""The compile hook finds float16 layers wherever a model holds them.

A float16-computing Dense made in a custom layer's `__init__` is no layer
of the model's `layers`: the hook walks the layers Keras tracks (see
`layer_walk`), so the model still gets its `LossScaleOptimizer`.
"""

import keras
import numpy as np
import pytest
from testing import to_numpy

import keras_dtype_policy


class Block(keras.layers.Layer):
    """A custom layer that makes its Dense in `__init__`."""

    def __init__(self, dense_dtype, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(4, dtype=dense_dtype)

    def call(self, x):
        return self.dense(x)


class Stack(keras.layers.Layer):
    """A custom layer holding custom layers in a list: two levels deep."""

    def __init__(self, dense_dtype, **kwargs):
        super().__init__(**kwargs)
        self.blocks = [Block(dense_dtype), Block(dense_dtype)]

    def call(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class Subclassed(keras.Model):
    """A subclassed model holding a custom layer in a dict."""

    def __init__(self, dense_dtype, **kwargs):
        super().__init__(**kwargs)
        self.parts = {"block": Block(dense_dtype)}
        self.head = keras.layers.Dense(1)

    def call(self, x):
        return self.head(self.parts["block"](x))


def functional(dense_dtype):
    inputs = keras.Input((3,))
    hidden = Block(dense_dtype)(inputs)
    return keras.Model(inputs, keras.layers.Dense(1)(hidden))


def sequential(dense_dtype):
    return keras.Sequential(
        [keras.Input((3,)), Block(dense_dtype), keras.layers.Dense(1)]
    )


def two_levels_deep(dense_dtype):
    inputs = keras.Input((3,))
    hidden = Stack(dense_dtype)(inputs)
    return keras.Model(inputs, keras.layers.Dense(1)(hidden))


def subclassed(dense_dtype):
    model = Subclassed(dense_dtype)
    model(np.zeros((1, 3), "float32"))
    return model


BUILDERS = {
    "functional": functional,
    "sequential": sequential,
    "two_levels_deep": two_levels_deep,
    "subclassed": subclassed,
}


@pytest.mark.parametrize("build", BUILDERS.values(), ids=BUILDERS.keys())
def test_nested_float16_layers_get_a_loss_scale_optimizer(build):
    model = build("mixed_float16")
    assert model.dtype_policy.name == "float32"
    assert not any(
        layer.compute_dtype == "float16" for layer in model.layers
    ), "the float16 layer must be nested, out of `model.layers`"
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    assert isinstance(model.optimizer, keras_dtype_policy.LossScaleOptimizer)
    before = [to_numpy(w) for w in model.trainable_weights]
    # Small values: the first step, at a loss scale of 2**15, must not
    # overflow float16 (that step would be skipped).
    x = np.random.default_rng(0).normal(0.0, 0.1, (8, 3)).astype("float32")
    y = np.full((8, 1), 0.1, "float32")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    after = [to_numpy(w) for w in model.trainable_weights]
    assert all(np.all(np.isfinite(value)) for value in after)
    for old, new in zip(before, after, strict=True):
        assert not np.array_equal(old, new)


@pytest.mark.parametrize("build", BUILDERS.values(), ids=BUILDERS.keys())
def test_nested_float32_layers_keep_a_plain_optimizer(build):
    model = build("float32")
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    assert not isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert isinstance(model.optimizer, keras.optimizers.Adam)
