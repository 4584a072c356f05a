"""`save_for_keras`: a model saved as a file that Keras alone loads.

A model trained under the package's policies names them in its layers'
configs, and its optimizer is the package's wrapper: Keras alone cannot
load its file. `save_for_keras` saves a copy in Keras' own terms instead,
the model left as it was:

- each layer gets Keras' nearest policy (`keras_nearest`):
  `"kahan_bfloat16"` and `"stochastic_bfloat16_8bit"` become
  `"bfloat16"`, `"kahan_float16"` becomes `"float16"`, the mixed and plain
  policies stay (as Keras' class);
- a weight's Kahan compensation is folded in: the weight is
  weight + compensation rounded to nearest in its dtype;
- the optimizer is the Keras optimizer inside the wrappers, with the
  state carried over (`state_transfer`): 8-bit and 4-bit slots
  dequantized, each slot rounded to nearest in the dtype Keras keeps it
  in, the step count kept; the package's dynamic loss scale becomes
  Keras' `LossScaleOptimizer` with its scale and counter, a fixed one the
  optimizer's `loss_scale_factor`.
"""

import os
import pathlib
import tempfile
import zipfile

import h5py
import keras
import ml_dtypes
import numpy as np

from keras_dtype_policy.low_precision import multi_optimizers
from keras_dtype_policy.policies import keras_nearest
from keras_dtype_policy.policies import precision_rules
from keras_dtype_policy.policies import rules_application
from keras_dtype_policy.tf_keras_compat import state_transfer

PACKAGE_PREFIX = "keras_dtype_policy"


def save_for_keras(
    model: keras.Model,
    path: str | os.PathLike,
    policy: str | None = None,
    overwrite: bool = True,
) -> pathlib.Path:
    """Saves `model` as a `.keras` file that Keras alone loads and trains.

    The file holds a copy of `model` under Keras' own policies and
    optimizer, with its weights and optimizer state (see the module's
    docstring, and docs/saving-and-resuming.md for how exact each part
    is). `model` itself is not changed. The file is written beside `path`,
    loaded back and compared, then moved to `path`: an error leaves `path`
    as it was.

    Args:
        model: A built `keras.Model`, compiled or not.
        path: The `.keras` file to write.
        policy: A policy name Keras accepts (such as `"mixed_bfloat16"`,
            float32 weights holding weight + compensation exactly) for
            every layer but those `model` pins to float32; None gives each
            layer Keras' policy nearest to its own.
        overwrite: Whether an existing file at `path` may be replaced.

    Returns:
        The path written, as a `pathlib.Path`.

    Raises:
        TypeError: if `model` is not a `keras.Model`, or `path` or
            `policy` not a string.
        ValueError: if `path` does not end in `.keras` or exists without
            `overwrite`, `policy` is not one of Keras' policies, or the
            model holds something Keras alone cannot load.

    Example:

    >>> keras_dtype_policy.save_for_keras(
    ...     model, "model.keras"
    ... )  # doctest: +SKIP
    >>> model = keras.saving.load_model("model.keras")  # Keras alone
    """
    target = _checked_path(path, overwrite)
    copy = keras_copy(model, policy)
    _save_checked(copy, target)
    return target


def keras_copy(model, policy=None, with_optimizer=True):
    """Returns a copy of `model` in Keras' own terms, with its state.

    Args:
        model: A built `keras.Model`.
        policy: As `save_for_keras`'s.
        with_optimizer: False for the weights alone (Kahan compensation
            folded in), the copy left uncompiled: what serving needs.

    Returns:
        A new `keras.Model`, compiled with the Keras optimizer inside
        `model`'s (built, its state carried) if `model` was compiled and
        `with_optimizer` is True.
    """
    if not isinstance(model, keras.Model):
        raise TypeError(
            "`model` must be a keras.Model. "
            f"Received: model={model!r} (of type {type(model).__name__})"
        )
    chooser = _chooser(model, _checked_policy(policy))
    new = rules_application.rebuild(model, chooser, compile_again=False)
    if model.compiled and with_optimizer:
        config = dict(model.get_compile_config() or {})
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None:
            config["optimizer"] = keras.optimizers.serialize(
                keras_optimizer_for(optimizer)
            )
        # The loss scaling Keras alone needs is in the optimizer already.
        config["auto_scale_loss"] = False
        new.compile_from_config(config)
    state_transfer.carry(model, new)
    check_keras_only(_full_config(new), model.name)
    return new


def keras_optimizer_for(optimizer):
    """Returns a new Keras optimizer for the package's `optimizer`.

    The Keras optimizer inside the package's wrappers, from its config;
    inside Keras' `LossScaleOptimizer` where the package's scaled the loss
    dynamically, with `loss_scale_factor` where its scale was fixed.

    Args:
        optimizer: A `keras.optimizers.Optimizer`, maybe the package's.

    Returns:
        An unbuilt `keras.optimizers.Optimizer` of Keras' classes (or the
        user's inner class).
    """
    parts = state_transfer.unwrapped(optimizer)
    inner = _keras_copy_of(parts.inner)
    scaler = parts.loss_scale
    if scaler is None:
        return inner
    if getattr(scaler, "dynamic", True):
        return keras.optimizers.LossScaleOptimizer(
            inner,
            initial_scale=scaler.initial_scale,
            dynamic_growth_steps=scaler.dynamic_growth_steps,
            name=scaler.name,
        )
    config = inner.get_config()
    config["loss_scale_factor"] = float(scaler.initial_scale)
    return type(inner).from_config(config)


def _keras_copy_of(optimizer):
    """A new Keras optimizer like `optimizer` (a MultiOptimizer's
    sub-optimizers each the Keras one inside the package's wrapper)."""
    if multi_optimizers.is_multi_optimizer(optimizer):
        return multi_optimizers.with_sub_optimizers(
            optimizer,
            lambda sub: _keras_copy_of(state_transfer.unwrapped(sub).inner),
        )
    return keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))


def check_keras_only(config, name):
    """Raises a ValueError where `config` names one of the package's
    classes (which Keras alone cannot find)."""
    found = _package_objects(config, "")
    if found:
        where, class_name = found[0]
        raise ValueError(
            f"Model {name!r} cannot be saved for Keras alone: its config "
            f"names the package's {class_name} at {where or 'the top'}, "
            "which has no Keras counterpart"
        )


def _package_objects(node, where):
    """`(where, class name)` of each object of the package in a config."""
    found = []
    if isinstance(node, dict):
        module = str(node.get("module") or "")
        registered = str(node.get("registered_name") or "")
        if module.startswith(PACKAGE_PREFIX) or registered.startswith(
            PACKAGE_PREFIX + ">"
        ):
            found.append((where, node.get("class_name")))
        for key, value in node.items():
            found += _package_objects(value, f"{where}/{key}")
    elif isinstance(node, (list, tuple)):
        for index, value in enumerate(node):
            found += _package_objects(value, f"{where}/{index}")
    return found


def _full_config(model):
    config = keras.saving.serialize_keras_object(model)
    if model.compiled:
        config["compile_config"] = model.get_compile_config()
    return config


def _chooser(model, policy):
    """The `rebuild` chooser giving each layer Keras' nearest policy (to
    its own, or to `policy`'s rules)."""
    rules = None
    if policy is not None:
        rules = rules_application.rules_chooser(
            model, precision_rules.PrecisionRules(policy)
        )

    def chooser(layer, requested_dtype, path=None):
        chosen = None if rules is None else rules(layer, requested_dtype)
        current = layer.dtype_policy if chosen is None else chosen
        return keras_nearest.nearest_keras_policy(current) or chosen

    return chooser


def _checked_policy(policy):
    if policy is None:
        return None
    if not isinstance(policy, str):
        raise TypeError(
            "`policy` must be a policy name, such as 'mixed_bfloat16', or "
            f"None. Received: policy={policy!r} (of type "
            f"{type(policy).__name__})"
        )
    if not keras_nearest.is_keras_policy_name(policy):
        raise ValueError(
            "`policy` must be one of Keras' own policies, such as "
            "'bfloat16', 'mixed_bfloat16' or 'float32' (the file is for "
            f"Keras alone). Received: policy={policy!r}"
        )
    return policy


def _checked_path(path, overwrite):
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            "`path` must be a string or path ending in .keras. "
            f"Received: path={path!r} (of type {type(path).__name__})"
        )
    if not isinstance(overwrite, bool):
        raise TypeError(
            "`overwrite` must be True or False. Received: "
            f"overwrite={overwrite!r} (of type {type(overwrite).__name__})"
        )
    path = pathlib.Path(path)
    if path.suffix != ".keras":
        raise ValueError(
            f"`path` must end in .keras (the format Keras alone reads "
            f"with its optimizer state). Received: path={str(path)!r}"
        )
    if path.is_dir() or (path.exists() and not overwrite):
        raise ValueError(
            "`path` exists already (pass overwrite=True to replace a "
            f"file). Received: path={str(path)!r}"
        )
    if not path.parent.is_dir():
        raise ValueError(
            f"`path`'s directory does not exist. Received: path={str(path)!r}"
        )
    return path


def _save_checked(model, path):
    """Saves `model` beside `path`, checks what the file holds, then
    moves it to `path`.

    The weights are checked by loading the file uncompiled (`safe_mode`
    on); the optimizer's values by reading them from the file as stored,
    in order: loading it compiled here would let the package's compile
    hook rewrap the optimizer, which Keras alone does not do.
    """
    handle, temporary = tempfile.mkstemp(
        suffix=".keras", prefix=".for-keras-", dir=path.parent
    )
    os.close(handle)
    try:
        model.save(temporary)
        loaded = keras.saving.load_model(
            temporary, compile=False, safe_mode=True
        )
        _compare(model.weights, loaded.weights, path)
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None:
            _compare(optimizer.variables, _stored_optimizer(temporary), path)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


def _stored_optimizer(path):
    """The optimizer's values a `.keras` file stores, in order."""
    with zipfile.ZipFile(path) as archive:
        with archive.open("model.weights.h5") as weights:
            with h5py.File(weights, "r") as stored:
                group = stored.get("optimizer/vars")
                if group is None:
                    return []
                return [_stored_value(group[str(i)]) for i in range(len(group))]


def _stored_value(dataset):
    """A stored array, in its dtype (Keras marks bfloat16 in an attribute,
    HDF5 having none)."""
    if dataset.attrs.get("dtype") == "bfloat16":
        return np.array(dataset, dtype=ml_dtypes.bfloat16)
    return dataset[()]


def _comparable(value):
    value = np.asarray(keras.ops.convert_to_numpy(value))
    if value.dtype == ml_dtypes.bfloat16:
        return value.astype("float32")
    return value


def _compare(expected, found, path):
    same = len(expected) == len(found) and all(
        np.array_equal(_comparable(a), _comparable(b), equal_nan=True)
        for a, b in zip(expected, found, strict=True)
    )
    if not same:
        raise ValueError(
            f"{path}: the file written does not give back the copy's "
            "values; nothing was written"
        )
