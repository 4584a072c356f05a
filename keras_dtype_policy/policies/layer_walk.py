"""The one walk over the layers a model holds, as Keras enumerates them.

Keras tracks, for each layer, the layers assigned to its attributes (also
inside lists, dicts and tuples) and, for a model, the layers of its graph.
So the walk reaches the layers of Functional and Sequential models, of
subclassed models, and of custom layers that make theirs in `__init__`
(keras-hub backbones and tasks among them).
"""

import keras

from keras_dtype_policy.policies import keras_internals


def sublayers(layer):
    """Returns the layers `layer` holds directly, in Keras' order.

    Input layers are included. An object that is not a Keras layer gives
    its `layers` attribute, if any.
    """
    if isinstance(layer, keras.layers.Layer):
        return keras_internals.tracked_sublayers(layer)
    return list(getattr(layer, "layers", ()))


def layer_paths(model, include_inputs=False):
    """Returns `(path, layer)` for every layer in `model`, depth first.

    A path is the names of the layers that hold a layer and its own,
    joined by "/", without the model's name:
    `"bert_backbone/transformer_layer_0/self_attention_layer/query"`. A
    layer held in two places is listed once, at the first.

    Args:
        model: A Keras model or layer; itself is not listed.
        include_inputs: Whether to list input layers too.

    Example:

    >>> inputs = keras.Input((3,))
    >>> hidden = keras.layers.Dense(4, name="hidden")
    >>> model = keras.Model(inputs, hidden(inputs))
    >>> [path for path, _ in layer_paths(model)]
    ['hidden']
    """
    found = []
    seen = set()

    def walk(layer, prefix):
        for child in sublayers(layer):
            if id(child) in seen:
                continue
            if not include_inputs and isinstance(
                child, keras.layers.InputLayer
            ):
                continue
            seen.add(id(child))
            path = f"{prefix}/{child.name}" if prefix else child.name
            found.append((path, child))
            walk(child, path)

    walk(model, "")
    return found


def all_layers(model, include_inputs=False):
    """Returns every layer in `model`, depth first, each once."""
    return [layer for _, layer in layer_paths(model, include_inputs)]


def leaf_layers(model):
    """Returns the layers in `model` that hold no other layer, depth first.

    Input layers are left out.
    """
    return [layer for layer in all_layers(model) if is_leaf(layer)]


def is_leaf(layer):
    """True for a layer that holds no other layer."""
    return not sublayers(layer)


def own_weights(layer):
    """Returns the weights of `layer` that none of its sublayers holds."""
    held = {id(w) for child in sublayers(layer) for w in child.weights}
    return [w for w in layer.weights if id(w) not in held]
