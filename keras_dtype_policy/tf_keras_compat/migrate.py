"""`migrate`: a tf.keras 2 model file rewritten as a Keras 3 `.keras` file.

The model file may also be a SavedModel directory that tf.keras 2 wrote
(see `saved_model_dirs`; loading it needs TensorFlow).

The model is loaded through this package's translation of tf.keras 2
configs and saved again by Keras 3, weights and (for a compiled model) the
optimizer and its state included. What the translation changed is listed by
comparing the config read from the file with
`config_translation.translate_model_config` (and `translate_compile_config`
for the training config of `.h5` files), object by object.
"""

import dataclasses
import math
import os
import pathlib
import re
import tempfile
import warnings

import keras
import numpy as np

from keras_dtype_policy.loss_scaling.loss_scale import get_loss_scale
from keras_dtype_policy.policies import layer_walk
from keras_dtype_policy.policies import precision_rules
from keras_dtype_policy.policies import rules_application
from keras_dtype_policy.policies.introspection import public_class_name
from keras_dtype_policy.policies.policy import DTypePolicy
from keras_dtype_policy.tf_keras_compat import config_translation
from keras_dtype_policy.tf_keras_compat import file_limits
from keras_dtype_policy.tf_keras_compat import keras_files
from keras_dtype_policy.tf_keras_compat import legacy_policy_configs
from keras_dtype_policy.tf_keras_compat import model_files
from keras_dtype_policy.tf_keras_compat.model_files import ModelFileError

_KERAS_POLICIES = (keras.DTypePolicy, keras.dtype_policies.FloatDTypePolicy)
_CLASS_KEYS = ("class_name", "module", "registered_name")
_COMPILE_KEYS = ("compile_config", "training_config")
_OPTIMIZER_KEYS = ("optimizer", "optimizer_config")
# The most bytes of weights a migration writes: this many times its source
# file's size (a policy of wider variables doubles them, a first optimizer
# state triples them), plus `OUTPUT_SLACK`.
OUTPUT_GROWTH = 8
OUTPUT_SLACK = 64 * 2**20


@dataclasses.dataclass
class Change:
    """One rewrite: what it touched (`subject`) and how (`text`)."""

    subject: str
    text: str

    def __str__(self):
        return f"{self.subject}: {self.text}"


@dataclasses.dataclass
class Migration:
    """The outcome of `migrate`.

    Attributes:
        source: The `ModelFile` migrated.
        target: The `.keras` file written.
        changes: The `Change`s the translation made, in config order.
        dropped_loss_scales: One line per loss scale that a tf.keras policy
            carried and Keras 3 policies cannot.
        notes: Other things worth knowing (what tf.keras files never held,
            warnings from loading).
        weights: The number of weight arrays written and checked.
        optimizer_values: The number of optimizer values written and
            checked (0 for an uncompiled model).
    """

    source: model_files.ModelFile
    target: pathlib.Path
    changes: list
    dropped_loss_scales: list
    notes: list
    weights: int
    optimizer_values: int


def migrate(old, new, overwrite=False, policy=None):
    """Rewrites the model file `old` as the Keras 3 `.keras` file `new`.

    Args:
        old: A `.keras` or `.h5` model file, as tf.keras 2 (or Keras 3)
            saved it, or a SavedModel directory that tf.keras 2 wrote.
        new: The `.keras` file to write.
        overwrite: Whether an existing `new` may be replaced.
        policy: A policy name (or `PrecisionRules`) to give every layer
            instead of the file's, the layers it pins to float32 kept (see
            `load_override.load_model`); None keeps the file's policies.

    Returns:
        A `Migration`.

    Raises:
        ModelFileError: if `old` is no model, `new` is not a free `.keras`
            path, or the written file does not give back the same weights.
    """
    new = pathlib.Path(new)
    if new.suffix != ".keras":
        raise ModelFileError(f"{new}: the new file's name must end in .keras")
    if not new.parent.is_dir():
        raise ModelFileError(f"{new}: no such directory: {new.parent}")
    if new.is_dir():
        raise ModelFileError(f"{new}: is a directory, not a .keras file")
    source = model_files.read_model_file(old)
    if new.exists():
        if new.resolve() == source.path.resolve():
            raise ModelFileError(f"{new}: is the file being migrated")
        if not overwrite:
            raise ModelFileError(
                f"{new}: exists already (use --force to replace it)"
            )
    model, messages = model_files.load_model(source)
    try:
        changes = config_changes(source)
        dropped = dropped_loss_scales(source.model_config)
    except (AttributeError, TypeError, ValueError) as error:
        raise ModelFileError(
            f"{source.path}: cannot be translated: "
            f"{type(error).__name__}: {error}"
        ) from None
    adopt_package_policies(model, source.model_config)
    changes = [_with_loaded_policy(change, model) for change in changes]
    notes = [m for m in messages if "loss scale" not in m]
    if policy is not None:
        model = _override_policy(model, policy, changes, notes)
    optimizer = getattr(model, "optimizer", None)
    if (
        source.from_tf_keras
        and not source.holds_loss_scale_state
        and isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        and getattr(optimizer, "dynamic", True)
    ):
        notes.append(
            "tf.keras 2 files hold no loss-scale state: the dynamic scale "
            f"restarts at initial_scale {optimizer.initial_scale:g}; the "
            "inner optimizer's state "
            f"({int(keras.ops.convert_to_numpy(optimizer.iterations))} "
            "iterations) is kept"
        )
    check_output_size(model, source.path)
    weights, optimizer_values = _save_verified(model, new)
    return Migration(
        source=source,
        target=new,
        changes=changes,
        dropped_loss_scales=dropped,
        notes=notes,
        weights=weights,
        optimizer_values=optimizer_values,
    )


def _override_policy(model, policy, changes, notes):
    """Rebuilds `model` under `policy`, listing each layer's new policy."""
    try:
        rules = policy
        if not isinstance(policy, precision_rules.PrecisionRules):
            rules = precision_rules.PrecisionRules(policy)
        new = rules_application.apply_rules(model, rules)
    except (TypeError, ValueError) as error:
        raise ModelFileError(f"--policy: {error}") from None
    keras_files.build_optimizer(new)
    before = {
        layer.path: layer
        for layer in layer_walk.all_layers(model, include_inputs=True)
    }
    for layer in layer_walk.all_layers(new, include_inputs=True):
        old = before.get(layer.path)
        if old is not None and old.dtype_policy != layer.dtype_policy:
            changes.append(
                Change(
                    layer.path,
                    f'policy "{old.dtype_policy.name}" -> '
                    f'"{layer.dtype_policy.name}" (--policy)',
                )
            )
    if getattr(new, "optimizer", None) is not None:
        notes.append(
            "--policy: the model is compiled again under its new policy; "
            "the optimizer's state starts afresh"
        )
    return new


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


def dropped_loss_scales(config):
    """Lists the loss scales that tf.keras policies in `config` carried."""
    dropped = []
    for path, dtype in _layer_dtypes(config):
        if isinstance(dtype, dict):
            scale = (dtype.get("config") or {}).get("loss_scale")
            if scale is not None:
                dropped.append(
                    f"{path}: {_describe_dtype(dtype)}: "
                    f"{_describe_loss_scale(scale)}"
                )
    return dropped


def adopt_package_policies(model, config):
    """Gives this package's `DTypePolicy` to the layers that had tf.keras's.

    Keras loads a translated tf.keras policy as its own `DTypePolicy` of the
    same name; this swaps in `keras_dtype_policy.DTypePolicy`, which is what
    the new file then names (it still loads as Keras' own without this
    package). The dtypes stay the same, so the weights are untouched.

    Args:
        model: The loaded model.
        config: The model config as read from the file.
    """
    for path, dtype in _layer_dtypes(config):
        if not legacy_policy_configs.is_legacy_policy_config(dtype):
            continue
        layer = _find_layer(model, path)
        if layer is not None and type(layer.dtype_policy) in _KERAS_POLICIES:
            layer.dtype_policy = DTypePolicy(layer.dtype_policy.name)


def _layer_dtypes(config):
    """Yields `(path, dtype config)` for every layer, nested ones too."""

    def visit(node, path):
        inner = node.get("config") if isinstance(node, dict) else None
        if not isinstance(inner, dict):
            return
        if path:
            yield path, inner.get("dtype")
        for layer in inner.get("layers") or ():
            name = _layer_name(layer)
            if name is not None:
                yield from visit(layer, f"{path}/{name}" if path else name)

    yield from visit(config, "")


def check_output_size(model, source_path):
    """Refuses a model that would be written far larger than its source.

    A file that declares sizes its weights do not hold (a layer config
    asking for huge `units`, datasets left unwritten) would otherwise
    expand into a file many times its size.

    Args:
        model: The loaded model, with its optimizer's variables.
        source_path: The file (or SavedModel directory) it came from.

    Raises:
        ModelFileError: naming the largest weight, if the weights' bytes
            exceed `OUTPUT_GROWTH` times the source's plus `OUTPUT_SLACK`.
    """
    variables = list(model.weights)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        variables += list(optimizer.variables)
    total = 0
    for variable in variables:
        shape = tuple(variable.shape)
        try:
            file_limits.check_declared_shape(shape, f"weight {variable.path}")
        except file_limits.FileLimitError as error:
            raise ModelFileError(f"{source_path}: {error}") from None
        total += math.prod(shape) * _item_bytes(variable.dtype)
    limit = OUTPUT_GROWTH * _size_on_disk(source_path) + OUTPUT_SLACK
    if total > limit and variables:
        largest = max(variables, key=lambda v: math.prod(tuple(v.shape)))
        raise ModelFileError(
            f"{source_path}: its config declares {total} bytes of weights, "
            f"more than {OUTPUT_GROWTH} times the file's size: the file does "
            f"not hold them (the largest: {largest.path} of shape "
            f"{tuple(largest.shape)})"
        )


def _item_bytes(dtype):
    """The bytes of one element of `dtype` (`"bfloat16"`: 2), at least 1."""
    bits = re.findall(r"\d+", str(dtype))
    return max(1, int(bits[0]) // 8) if bits else 1


def _size_on_disk(path):
    path = pathlib.Path(path)
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size


def verify(model, path, name=None):
    """Loads `path` and checks it holds `model`'s weights and optimizer.

    Values compare NaN-aware: a NaN matches a NaN.

    Args:
        model: The model that was saved.
        path: The file written.
        name: The file's name in messages; `path` if None.

    Returns:
        The numbers of weights and of optimizer values compared.

    Raises:
        ModelFileError: if anything differs.
    """
    shown = path if name is None else name
    written = model_files.read_model_file(path)
    reloaded, _ = model_files.load_model(written)
    pairs = [("weight", model.weights, reloaded.weights)]
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        pairs.append(
            (
                "optimizer value",
                optimizer.variables,
                getattr(reloaded.optimizer, "variables", []),
            )
        )
    for what, expected, found in pairs:
        if len(expected) != len(found):
            raise ModelFileError(
                f"{shown}: holds {len(found)} {what}s instead of "
                f"{len(expected)}; the migration is incomplete"
            )
        for a, b in zip(expected, found, strict=True):
            if not np.array_equal(
                keras.ops.convert_to_numpy(a),
                keras.ops.convert_to_numpy(b),
                equal_nan=True,
            ):
                raise ModelFileError(
                    f"{shown}: its {what} {b.path} differs from the "
                    "original's; the migration is incomplete"
                )
    return len(model.weights), len(pairs[1][1]) if len(pairs) > 1 else 0


def _save_verified(model, path):
    """Saves to a temporary file beside `path`, verifies it, then moves it
    to `path`: any failure (the verification's too) leaves `path` as it
    was. Returns what `verify` returns."""
    handle, temporary = tempfile.mkstemp(
        suffix=".keras", prefix=".migrating-", dir=path.parent
    )
    os.close(handle)
    try:
        model.save(temporary)
        counts = verify(model, temporary, name=path)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise
    return counts


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
                    f"{_describe_dtype(b)} -> {_describe_new_dtype(a)}",
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
        name = _layer_name(b)
        if name is None:
            yield from _diff(b, a, subject, (*keys, "layers"), prefix)
            continue
        path = f"{prefix}/{name}" if prefix else name
        yield from _diff(b, a, path, (), path)


def _layer_name(node):
    if not isinstance(node, dict):
        return None
    inner = node.get("config")
    name = inner.get("name") if isinstance(inner, dict) else None
    return name if isinstance(name, str) else node.get("name")


def _is_object(node):
    return "class_name" in node and "config" in node


def _with_loaded_policy(change, model):
    """Names the policy class a layer really has, where known."""
    marker = ' -> DTypePolicy "'
    if marker not in change.text:
        return change
    layer = _find_layer(model, change.subject)
    if layer is None:
        return change
    policy = layer.dtype_policy
    before = change.text.split(marker)[0]
    return Change(
        change.subject,
        f'{before} -> {public_class_name(policy)} "{policy.name}"',
    )


def _find_layer(model, path):
    layer = model
    for name in path.split("/"):
        found = [
            child for child in layer_walk.sublayers(layer) if child.name == name
        ]
        if not found:
            return None
        layer = found[0]
    return layer


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


def _describe_dtype(dtype):
    if dtype is None:
        return "null (tf.keras: infer from the input)"
    if isinstance(dtype, str):
        return f'"{dtype}"'
    if isinstance(dtype, dict):
        inner = dtype.get("config") or {}
        name = inner.get("name")
        scale = inner.get("loss_scale")
        extra = f", loss_scale={_describe_loss_scale(scale)}" if scale else ""
        return f"{dtype.get('class_name')}({name}{extra})"
    return repr(dtype)


def _describe_new_dtype(dtype):
    if isinstance(dtype, str) and dtype in ("_infer", "infer"):
        return f'Policy "{dtype}" (infers from the first input)'
    if isinstance(dtype, str):
        return f'DTypePolicy "{dtype}"'
    return _describe_dtype(dtype)


def _describe_loss_scale(scale):
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
