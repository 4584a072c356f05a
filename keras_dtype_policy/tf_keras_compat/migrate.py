"""`migrate`: a tf.keras 2 model file rewritten as a Keras 3 `.keras` file.

The model file may also be a SavedModel directory that tf.keras 2 wrote
(see `saved_model_dirs`; loading it needs TensorFlow).

The model is loaded through this package's translation of tf.keras 2
configs and saved again by Keras 3, weights and (for a compiled model) the
optimizer and its state included. The new file names the package's classes
where the model has them (its policies, its optimizer wrappers), and then
needs the package to load; with `to_keras` it names Keras' own only
(`keras_alone.keras_copy`), and Keras alone loads it and trains on.
What the translation changed is listed by comparing the config read from
the file with
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
from typing import NamedTuple

import keras
import numpy as np

from keras_dtype_policy.policies import layer_walk
from keras_dtype_policy.policies import precision_rules
from keras_dtype_policy.policies import rules_application
from keras_dtype_policy.policies.introspection import public_class_name
from keras_dtype_policy.policies.policy import DTypePolicy
from keras_dtype_policy.tf_keras_compat import file_limits
from keras_dtype_policy.tf_keras_compat import keras_alone
from keras_dtype_policy.tf_keras_compat import keras_files
from keras_dtype_policy.tf_keras_compat import legacy_policy_configs
from keras_dtype_policy.tf_keras_compat import load_override
from keras_dtype_policy.tf_keras_compat import model_files
from keras_dtype_policy.tf_keras_compat import state_transfer
from keras_dtype_policy.tf_keras_compat.config_diff import Change
from keras_dtype_policy.tf_keras_compat.config_diff import config_changes
from keras_dtype_policy.tf_keras_compat.config_diff import describe_dtype
from keras_dtype_policy.tf_keras_compat.config_diff import describe_loss_scale
from keras_dtype_policy.tf_keras_compat.config_diff import layer_name
from keras_dtype_policy.tf_keras_compat.model_files import ModelFileError

_KERAS_POLICIES = (keras.DTypePolicy, keras.dtype_policies.FloatDTypePolicy)
# The most bytes of weights a migration writes: this many times its source
# file's size (a policy of wider variables doubles them, a first optimizer
# state triples them), plus `OUTPUT_SLACK`.
OUTPUT_GROWTH = 8
OUTPUT_SLACK = 64 * 2**20


class VerifiedValues(NamedTuple):
    """How many values `verify` found the same in the written file."""

    weights: int
    optimizer_values: int


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


def migrate(old, new, overwrite=False, policy=None, to_keras=False):
    """Rewrites the model file `old` as the Keras 3 `.keras` file `new`.

    Args:
        old: A `.keras` or `.h5` model file, as tf.keras 2 (or Keras 3)
            saved it, or a SavedModel directory that tf.keras 2 wrote.
        new: The `.keras` file to write.
        overwrite: Whether an existing `new` may be replaced.
        policy: A policy name (or `PrecisionRules`) to give every layer
            instead of the file's, the layers it pins to float32 kept (see
            `load_override.load_model`); None keeps the file's policies.
            The optimizer's state is carried over in the new policy's form.
        to_keras: Whether to write a file that Keras alone loads and
            trains on (see `keras_alone.save_for_keras`): each layer gets
            Keras' policy nearest to its own (or `policy`, which must
            then be Keras'), the optimizer the Keras one inside the
            package's wrappers, with its state.

    Returns:
        A `Migration`.

    Raises:
        ModelFileError: if `old` is no model, `new` is not a free `.keras`
            path, or the written file does not give back the same weights.
    """
    new = pathlib.Path(new)
    _check_target_name(new)
    source = model_files.read_model_file(old)
    _check_target_free(new, source, overwrite)
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
    if to_keras:
        model = _for_keras(model, policy, changes, notes)
    elif policy is not None:
        model = _override_policy(model, policy, changes, notes)
    notes += _restarted_scale_notes(source, model)
    check_output_size(model, source.path)
    written = _save_verified(model, new)
    return Migration(
        source=source,
        target=new,
        changes=changes,
        dropped_loss_scales=dropped,
        notes=notes,
        weights=written.weights,
        optimizer_values=written.optimizer_values,
    )


def _check_target_name(new):
    """Refuses a `new` that is not a `.keras` file in a directory."""
    if new.suffix != ".keras":
        raise ModelFileError(f"{new}: the new file's name must end in .keras")
    if not new.parent.is_dir():
        raise ModelFileError(f"{new}: no such directory: {new.parent}")
    if new.is_dir():
        raise ModelFileError(f"{new}: is a directory, not a .keras file")


def _check_target_free(new, source, overwrite):
    """Refuses a `new` that is the source, or exists without `overwrite`."""
    if not new.exists():
        return
    if new.resolve() == source.path.resolve():
        raise ModelFileError(f"{new}: is the file being migrated")
    if not overwrite:
        raise ModelFileError(
            f"{new}: exists already (use --force to replace it)"
        )


def _restarted_scale_notes(source, model):
    """A note where a dynamic loss scale restarts: tf.keras kept none."""
    optimizer = getattr(model, "optimizer", None)
    if (
        source.from_tf_keras
        and not source.holds_loss_scale_state
        and isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        and getattr(optimizer, "dynamic", True)
    ):
        return [
            "tf.keras 2 files hold no loss-scale state: the dynamic scale "
            f"restarts at initial_scale {optimizer.initial_scale:g}; the "
            "inner optimizer's state "
            f"({int(keras.ops.convert_to_numpy(optimizer.iterations))} "
            "iterations) is kept"
        ]
    return []


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
    changes += _policy_changes(model, new, "--policy")
    if getattr(new, "optimizer", None) is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            reason = load_override.carry_state(model, new)
        notes.append(
            "--policy: the model is compiled again under its new policy; "
            + (
                "the optimizer's state is carried over, in the form the "
                "new policy keeps it"
                if reason is None
                else f"{reason}; the optimizer starts afresh"
            )
        )
    return new


def _policy_changes(model, new, option):
    """A `Change` per layer whose policy differs in `new`, a copy of
    `model` made for `option`."""
    before = {
        layer.path: layer
        for layer in layer_walk.all_layers(model, include_inputs=True)
    }
    changes = []
    for layer in layer_walk.all_layers(new, include_inputs=True):
        old = before.get(layer.path)
        if old is None:
            continue
        ours, theirs = old.dtype_policy, layer.dtype_policy
        if ours != theirs or type(ours) is not type(theirs):
            changes.append(
                Change(
                    layer.path,
                    f"policy {public_class_name(ours)} "
                    f'"{ours.name}" -> {public_class_name(theirs)} '
                    f'"{theirs.name}" ({option})',
                )
            )
    return changes


def _for_keras(model, policy, changes, notes):
    """Returns the copy of `model` that `keras_alone` saves for Keras
    alone, listing each layer's new policy."""
    try:
        new = keras_alone.keras_copy(model, policy)
    except (TypeError, ValueError) as error:
        raise ModelFileError(f"--to-keras: {error}") from None
    changes += _policy_changes(model, new, "--to-keras")
    optimizer = getattr(new, "optimizer", None)
    if optimizer is not None:
        carried = state_transfer.is_built(model.optimizer)
        notes.append(
            "--to-keras: the optimizer is Keras' "
            f"{type(optimizer).__name__}, "
            + (
                "its state carried over (dequantized; Kahan compensation "
                "folded into the weights)"
                if carried
                else "with fresh state (the loaded one held none yet)"
            )
        )
    return new


def dropped_loss_scales(config):
    """Lists the loss scales that tf.keras policies in `config` carried."""
    dropped = []
    for path, dtype in _layer_dtypes(config):
        if isinstance(dtype, dict):
            scale = (dtype.get("config") or {}).get("loss_scale")
            if scale is not None:
                dropped.append(
                    f"{path}: {describe_dtype(dtype)}: "
                    f"{describe_loss_scale(scale)}"
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
            name = layer_name(layer)
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
        The `VerifiedValues`: how many weights and optimizer values were
        compared.

    Raises:
        ModelFileError: if anything differs.
    """
    shown = path if name is None else name
    written = model_files.read_model_file(path)
    reloaded, _ = model_files.load_model(written)
    _compare_values("weight", model.weights, reloaded.weights, shown)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return VerifiedValues(weights=len(model.weights), optimizer_values=0)
    _compare_values(
        "optimizer value",
        optimizer.variables,
        getattr(reloaded.optimizer, "variables", []),
        shown,
    )
    return VerifiedValues(
        weights=len(model.weights),
        optimizer_values=len(optimizer.variables),
    )


def _compare_values(what, expected, found, shown):
    """Raises a ModelFileError unless `found` holds `expected`'s values."""
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


def _save_verified(model, path):
    """Saves to a temporary file beside `path`, verifies it, then moves it
    to `path`: any failure (the verification's too) leaves `path` as it
    was. Returns the `VerifiedValues` of `verify`."""
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
