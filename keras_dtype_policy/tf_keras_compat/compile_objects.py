"""tf.keras 2 losses and learning-rate schedules, as Keras 3 reads them.

tf.keras' built-in loss classes saved the function they wrap (`fn`, a
name) and a `reduction` of `"auto"`; Keras 3's classes take no `fn` (the
class is the function) and call `"auto"` `"sum_over_batch_size"`, which is
what tf.keras' `"auto"` meant in `fit`. tf.keras' schedules saved
`name=None`, which Keras 3's refuse; left out, they take their own. A
metric given by name ("accuracy") became a `MeanMetricWrapper` holding the
function's name, which Keras 3 would call: it becomes that name again
(Keras 3 then names the metric after the function).
"""

_REDUCTIONS = {"auto": "sum_over_batch_size"}
_LOSS_MODULES = ("keras.losses", "keras.src.losses", "tf_keras.")


def translate_losses(value):
    """Returns a compile config's `loss` with tf.keras' loss configs fixed.

    Args:
        value: A loss as saved: a name, a loss config dict, or a list or
            dict of those (one per output).
    """
    if isinstance(value, list):
        return [translate_losses(item) for item in value]
    if not isinstance(value, dict):
        return value
    if "class_name" not in value:
        return {key: translate_losses(item) for key, item in value.items()}
    inner = value.get("config")
    module = value.get("module") or "keras.losses"
    if not isinstance(inner, dict) or not module.startswith(_LOSS_MODULES):
        return value
    inner = dict(inner)
    if value["class_name"] != "LossFunctionWrapper":
        inner.pop("fn", None)
    reduction = inner.get("reduction")
    if reduction in _REDUCTIONS:
        inner["reduction"] = _REDUCTIONS[reduction]
    return {**value, "config": inner}


def translate_learning_rate(value):
    """Returns an optimizer's saved `learning_rate`, schedules fixed."""
    if not (isinstance(value, dict) and isinstance(value.get("config"), dict)):
        return value
    inner = value["config"]
    if "name" in inner and inner["name"] is None:
        inner = {k: v for k, v in inner.items() if k != "name"}
    return {**value, "config": inner}


def translate_metrics(value):
    """Returns a compile config's `metrics`, wrapped function names fixed."""
    if isinstance(value, list):
        return [translate_metrics(item) for item in value]
    if not isinstance(value, dict):
        return value
    if "class_name" not in value:
        return {key: translate_metrics(item) for key, item in value.items()}
    inner = value.get("config")
    if (
        value["class_name"] == "MeanMetricWrapper"
        and isinstance(inner, dict)
        and isinstance(inner.get("fn"), str)
    ):
        return inner["fn"]
    return value
