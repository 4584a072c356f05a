"""What the translation of a tf.keras 2 file changes, object by object.

The config read from a file is compared with what
`config_translation.translate_model_config` (and `translate_compile_config`
for the training config of `.h5` files and SavedModels) makes of it; each
difference is a `Change`, named after the layer (or `"model"`,
`"compile"`, `"optimizer"`) it belongs to.
"""

import dataclasses
import warnings

from keras_dtype_policy.loss_scaling.loss_scale import get_loss_scale
from keras_dtype_policy.tf_keras_compat import config_translation

_CLASS_KEYS = ("class_name", "module", "registered_name")
_COMPILE_KEYS = ("compile_config", "training_config")
_OPTIMIZER_KEYS = ("optimizer", "optimizer_config")


@dataclasses.dataclass
class Change:
    """One rewrite: what it touched (`subject`) and how (`text`)."""

    subject: str
    text: str

    def __str__(self):
        return f"{self.subject}: {self.text}"


def config_changes(source):
    """Lists what the translation changes in a file's configs.

    Args:
        source: A `ModelFile`.

    Returns:
        A list of `Change`s.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dropped loss scales: listed apart
        translated = config_translation.translate_model_config(
            source.model_config
        )
        changes = list(_diff(source.model_config, translated, "model", ()))
        # .h5 files and SavedModels hold the training config apart.
        if source.format in ("h5", "savedmodel") and source.compile_config:
            translated_compile = config_translation.translate_compile_config(
                source.compile_config
            )
            changes += _diff(
                source.compile_config, translated_compile, "compile", ()
            )
    return changes


def _diff(before, after, subject, keys, prefix=""):
    """Yields the `Change`s between two configs, object by object.

    Args:
        before: The config as read.
        after: The config as translated.
        subject: What the changes are about: a layer's path, `"model"`,
            `"compile"`, `"optimizer"`...
        keys: The keys from the subject's config down to `before`.
        prefix: The layer path of the model whose layers are below.
    """
    if isinstance(before, dict) and isinstance(after, dict):
        if _is_object(before):
            yield from _diff_object(before, after, subject, keys, prefix)
        else:
            yield from _diff_dicts(before, after, subject, keys, prefix)
    elif (
        isinstance(before, list)
        and isinstance(after, list)
        and len(before) == len(after)
    ):
        for index, (b, a) in enumerate(zip(before, after, strict=True)):
            yield from _diff(b, a, subject, (*keys, str(index)), prefix)
    elif before != after or type(before) is not type(after):
        where = ".".join(keys) if keys else "value"
        yield Change(subject, f"{where} {_json(before)} -> {_json(after)}")


def _diff_object(before, after, subject, keys, prefix):
    """Diffs a serialized object: its class, then its config and the rest."""
    if {k: before.get(k) for k in _CLASS_KEYS} != {
        k: after.get(k) for k in _CLASS_KEYS
    }:
        yield Change(
            subject, f"{_describe_class(before)} -> {_describe_class(after)}"
        )
    if not isinstance(after.get("config"), dict):
        return
    yield from _diff_dicts(
        before["config"], after["config"], subject, keys, prefix
    )
    rest = [k for k in before if k not in (*_CLASS_KEYS, "config")]
    yield from _diff_dicts(
        {k: before[k] for k in rest},
        {k: after[k] for k in rest if k in after},
        subject,
        keys,
        prefix,
    )


def _diff_dicts(before, after, subject, keys, prefix):
    removed = {k: v for k, v in before.items() if k not in after}
    added = {k: v for k, v in after.items() if k not in before}
    for old_key, value in list(removed.items()):
        renamed = [k for k, v in added.items() if v == value]
        if renamed:
            yield Change(
                subject,
                f"{_join(keys, old_key)} renamed {_join(keys, renamed[0])}",
            )
            del removed[old_key], added[renamed[0]]
    if removed:
        listed = ", ".join(
            f"{_join(keys, key)}={_json(value)}"
            for key, value in removed.items()
        )
        yield Change(subject, f"removed {listed}")
    for key, value in added.items():
        yield Change(subject, f"added {_join(keys, key)}={_json(value)}")
    for key in before:
        if key not in after:
            continue
        b, a = before[key], after[key]
        if key == "dtype" and not keys:
            if b != a:
                yield Change(
                    subject,
                    f"{describe_dtype(b)} -> {_describe_new_dtype(a)}",
                )
        elif key == "layers" and isinstance(b, list) and isinstance(a, list):
            yield from _diff_layers(b, a, subject, keys, prefix)
        elif key in _COMPILE_KEYS:
            yield from _diff(b, a, "compile", ())
        elif key in _OPTIMIZER_KEYS and subject == "compile":
            yield from _diff(b, a, "optimizer", ())
        elif key == "inner_optimizer":
            yield from _diff(b, a, f"{subject}.inner_optimizer", ())
        else:
            yield from _diff(b, a, subject, (*keys, key), prefix)


def _diff_layers(before, after, subject, keys, prefix):
    if len(before) != len(after):
        yield Change(
            subject, f"{_join(keys, 'layers')}: {len(before)} -> {len(after)}"
        )
        return
    for b, a in zip(before, after, strict=True):
        name = layer_name(b)
        if name is None:
            yield from _diff(b, a, subject, (*keys, "layers"), prefix)
            continue
        path = f"{prefix}/{name}" if prefix else name
        yield from _diff(b, a, path, (), path)


def layer_name(node):
    if not isinstance(node, dict):
        return None
    inner = node.get("config")
    name = inner.get("name") if isinstance(inner, dict) else None
    return name if isinstance(name, str) else node.get("name")


def _is_object(node):
    return "class_name" in node and "config" in node


def _describe_class(node):
    registered = node.get("registered_name")
    class_name = node.get("class_name")
    module = node.get("module")
    if isinstance(registered, str) and ">" in registered:
        return registered.replace(">", ".")
    if module in (None, "keras", "builtins"):
        return f"{module}.{class_name}" if module else str(class_name)
    if module.startswith("keras.") and not module.startswith("keras.src"):
        return f"{module}.{class_name}"
    return f"{class_name} ({module})"


def describe_dtype(dtype):
    if dtype is None:
        return "null (tf.keras: infer from the input)"
    if isinstance(dtype, str):
        return f'"{dtype}"'
    if isinstance(dtype, dict):
        inner = dtype.get("config") or {}
        name = inner.get("name")
        scale = inner.get("loss_scale")
        extra = f", loss_scale={describe_loss_scale(scale)}" if scale else ""
        return f"{dtype.get('class_name')}({name}{extra})"
    return repr(dtype)


def _describe_new_dtype(dtype):
    if isinstance(dtype, str) and dtype in ("_infer", "infer"):
        return f'Policy "{dtype}" (infers from the first input)'
    if isinstance(dtype, str):
        return f'DTypePolicy "{dtype}"'
    return describe_dtype(dtype)


def describe_loss_scale(scale):
    try:
        return repr(get_loss_scale(scale))
    except (TypeError, ValueError):
        return _json(scale)


def _join(keys, key):
    return ".".join((*keys, key))


def _json(value):
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, dict) and "class_name" in value:
        return _describe_class(value)
    return str(value)
