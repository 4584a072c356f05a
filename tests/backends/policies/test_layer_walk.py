"""The one layer walk: the layers Keras tracks, depth first, each once."""

import keras
import pytest

from keras_dtype_policy.policies import keras_internals
from keras_dtype_policy.policies import layer_walk


class Pair(keras.layers.Layer):
    """Holds its layers in a list and a dict, and a weight of its own."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.first = [keras.layers.Dense(2, name="a")]
        self.second = {"b": keras.layers.Dense(2, name="b")}
        self.scale = self.add_weight(shape=(), name="scale")

    def call(self, x):
        return self.second["b"](self.first[0](x)) * self.scale


def nested_model():
    inputs = keras.Input((3,))
    inner = keras.Sequential(
        [keras.Input((2,)), keras.layers.Dense(2, name="dense")],
        name="inner",
    )
    pair = Pair(name="pair")
    outputs = keras.layers.Dense(1, name="head")(inner(pair(inputs)))
    return keras.Model(inputs, outputs, name="outer")


def test_paths_are_depth_first_through_models_and_custom_layers():
    paths = [path for path, _ in layer_walk.layer_paths(nested_model())]
    assert paths == ["pair", "pair/a", "pair/b", "inner", "inner/dense", "head"]


def test_input_layers_are_listed_on_request():
    paths = [
        path
        for path, _ in layer_walk.layer_paths(
            nested_model(), include_inputs=True
        )
    ]
    assert paths == [
        "input_layer",
        "pair",
        "pair/a",
        "pair/b",
        "inner",
        "inner/input_layer_1",
        "inner/dense",
        "head",
    ]


def test_a_layer_held_twice_is_listed_once_at_the_first_place():
    class Twice(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.shared = keras.layers.Dense(2, name="shared")
            self.pair = Pair(name="pair")
            self.pair.again = self.shared

        def call(self, x):
            return self.pair(self.shared(x))

    layer = Twice()
    paths = [path for path, _ in layer_walk.layer_paths(layer)]
    assert paths.count("shared") == 1
    assert "pair/shared" not in paths


def test_leaves_and_own_weights():
    model = nested_model()
    leaves = [layer.name for layer in layer_walk.leaf_layers(model)]
    assert leaves == ["a", "b", "dense", "head"]
    pair = model.get_layer("pair")
    assert not layer_walk.is_leaf(pair)
    assert [w.name for w in layer_walk.own_weights(pair)] == ["scale"]


def test_keras_layers_keep_the_sublayer_listing_the_package_reads():
    """`layer_walk` asks `keras_internals.tracked_sublayers`: if a Keras
    release moves `_flatten_layers`, the walk fails loudly."""
    assert keras_internals.FLATTEN_LAYERS in vars(keras.layers.Layer)
    pair = Pair()
    names = [layer.name for layer in keras_internals.tracked_sublayers(pair)]
    assert names == ["a", "b"]


def test_a_moved_sublayer_listing_fails_loudly(monkeypatch):
    pair = Pair()
    monkeypatch.delattr(keras.layers.Layer, keras_internals.FLATTEN_LAYERS)
    with pytest.raises(keras_internals.KerasInternalsError) as raised:
        layer_walk.sublayers(pair)
    assert keras_internals.FLATTEN_LAYERS in str(raised.value)
