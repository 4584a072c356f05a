"""tf.keras 2's MultiHeadAttention config, as Keras 3 reads it.

tf.keras saved the shapes the layer was built with as config arguments
(`query_shape`, `key_shape`, `value_shape`), which Keras 3's constructor
rejects, and a build config holding the query shape alone, with which
Keras 3's `build(query_shape, value_shape)` cannot be called. The shapes
move into a Keras 3 build config (`shapes_dict`), which builds the layer
with all three before its weights load.
"""

_SHAPE_KEYS = ("query_shape", "value_shape", "key_shape")
# Arguments of tf.keras' MultiHeadAttention that Keras 3's lacks, with the
# value that behaves as Keras 3 does.
_DROPPABLE = {"softmax_robust_masking": False}


def translate_attention(node):
    """Rewrites a tf.keras MultiHeadAttention object config in place.

    Args:
        node: A layer config dict (`class_name`, `config`, ...).
    """
    inner = node.get("config")
    if node.get("class_name") != "MultiHeadAttention" or not isinstance(
        inner, dict
    ):
        return
    for key, default in _DROPPABLE.items():
        if key in inner and inner[key] == default:
            inner.pop(key)
    shapes = {key: inner.pop(key) for key in _SHAPE_KEYS if key in inner}
    if shapes.get("query_shape") is None or shapes.get("value_shape") is None:
        return
    if shapes.get("key_shape") is None:
        shapes.pop("key_shape", None)
    node["build_config"] = {"shapes_dict": shapes}
