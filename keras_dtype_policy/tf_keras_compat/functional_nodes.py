"""The call graph of a tf.keras 2 functional config, as Keras 3 reads it.

A functional config lists, for each layer, the calls ("inbound nodes") that
made the model, each naming the outputs it took as `[layer, node, tensor]`.
Two of tf.keras' conventions differ from Keras 3's:

- a nested model (an application used as a layer) counted the call that
  built it as its node 0, so the outer model's call of it is node 1; a
  Keras 3 model built from a config has no such node;
- a tensor passed as a keyword argument (MultiHeadAttention's `value`) is
  written as a bare `[layer, node, tensor]` list, which Keras 3 passes to
  the layer as a list; Keras 3 reads tensors only from its own node form
  (`{"args": ..., "kwargs": ...}` with `__keras_tensor__` objects).

`translate_nodes` rewrites both, in place, and nothing else.
"""

_MODEL_CLASSES = ("Functional", "Model")


def translate_nodes(config):
    """Rewrites the inbound nodes of a tf.keras functional model config.

    Args:
        config: The inner `config` of a Functional (or Sequential) model,
            with its `layers` list; changed in place.
    """
    layers = config.get("layers")
    if not isinstance(layers, list):
        return
    own_node = {
        _name(layer): True
        for layer in layers
        if isinstance(layer, dict) and _has_own_node(layer)
    }
    names = {_name(layer) for layer in layers if isinstance(layer, dict)}
    for layer in layers:
        if not isinstance(layer, dict):
            continue
        nodes = layer.get("inbound_nodes")
        if isinstance(nodes, list):
            layer["inbound_nodes"] = [
                _translate_node(node, own_node, names) for node in nodes
            ]


def _name(layer):
    return layer.get("name") or (layer.get("config") or {}).get("name")


def _has_own_node(layer):
    """Whether tf.keras gave this nested model a node of its own at 0."""
    class_name = layer.get("class_name")
    inner = layer.get("config") or {}
    if class_name in _MODEL_CLASSES:
        return isinstance(inner.get("layers"), list)
    if class_name == "Sequential":
        members = inner.get("layers") or []
        first = members[0] if members else {}
        return isinstance(first, dict) and (
            first.get("class_name") == "InputLayer"
            or "batch_input_shape" in (first.get("config") or {})
        )
    return False


def _translate_node(node, own_node, names):
    if not isinstance(node, list):
        return node
    node = [_shifted(entry, own_node) for entry in node]
    keyword_tensors = any(
        len(entry) == 4
        and isinstance(entry[3], dict)
        and any(_is_reference(v, names) for v in entry[3].values())
        for entry in node
        if isinstance(entry, list)
    )
    if not keyword_tensors or len(node) != 1:
        return node
    # One positional input, with tensors among the keyword arguments.
    entry = node[0]
    kwargs = {
        key: _tensor(_shifted(value, own_node))
        if _is_reference(value, names)
        else value
        for key, value in entry[3].items()
    }
    return {"args": [_tensor(entry[:3])], "kwargs": kwargs}


def _shifted(entry, own_node):
    """A reference to a nested model's node, counted as Keras 3 does."""
    if (
        isinstance(entry, list)
        and len(entry) >= 3
        and own_node.get(entry[0])
        and isinstance(entry[1], int)
        and entry[1] >= 1
    ):
        return [entry[0], entry[1] - 1, *entry[2:]]
    return entry


def _is_reference(value, names):
    return (
        isinstance(value, list)
        and len(value) == 3
        and isinstance(value[0], str)
        and value[0] in names
        and all(isinstance(v, int) for v in value[1:])
    )


def _tensor(reference):
    # Keras 3 replaces this placeholder by the output it names, so its
    # shape and dtype are never used.
    return {
        "class_name": "__keras_tensor__",
        "config": {
            "shape": [],
            "dtype": "float32",
            "keras_history": list(reference[:3]),
        },
    }
