"""What a model holds, and the public names of the objects in it."""

import keras


def sublayers(layer):
    """Returns the layers that `layer` holds directly, in order."""
    flatten = getattr(layer, "_flatten_layers", None)
    if flatten is not None:
        return list(flatten(include_self=False, recursive=False))
    return list(getattr(layer, "layers", ()))


def public_class_name(obj):
    """Returns the public path of an object's class: `keras.layers.Dense`.

    Keras' backend-specific subclasses (such as the torch backend's Adam)
    are named by the public class they derive from.
    """
    for cls in type(obj).__mro__:
        module = cls.__module__
        if module.split(".")[0] == "keras_dtype_policy":
            return f"keras_dtype_policy.{cls.__qualname__}"
        if not module.startswith("keras."):
            break
        if module == "keras.src.models.functional":
            # What `keras.Model(inputs, outputs)` builds; Keras exports it
            # under no name, and `keras.Function`, its base, is no model.
            return f"keras.{cls.__qualname__}"
        paths = vars(cls).get("_api_export_path")
        if isinstance(paths, str):
            return paths
        if isinstance(paths, (list, tuple)) and paths:
            return paths[0]
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def layer_paths(model):
    """Returns `(path, layer)` for every layer in `model`, depth first.

    A path is the names of the layers that hold a layer and its own,
    joined by "/", without the model's name:
    `"bert_backbone/transformer_layer_0/self_attention_layer/query"`. A
    layer held in two places is listed once, at the first. Input layers
    are left out.
    """
    found = []
    seen = set()

    def walk(layer, prefix):
        for child in sublayers(layer):
            if id(child) in seen or isinstance(child, keras.layers.InputLayer):
                continue
            seen.add(id(child))
            path = f"{prefix}/{child.name}" if prefix else child.name
            found.append((path, child))
            walk(child, path)

    walk(model, "")
    return found


def is_leaf(layer):
    """True for a layer that holds no other layer."""
    return not sublayers(layer)


def own_weights(layer):
    """Returns the weights of `layer` that none of its sublayers holds."""
    held = {id(w) for child in sublayers(layer) for w in child.weights}
    return [w for w in layer.weights if id(w) not in held]
