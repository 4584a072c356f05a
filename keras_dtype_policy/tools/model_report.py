"""The `inspect` report: a saved model's layers, policies and loss scaling.

`build_report` gathers plain data (what `--json` prints); `format_report`
lays it out for people.
"""

import re

import keras
import numpy as np

from keras_dtype_policy import backend_dispatch
from keras_dtype_policy.loss_scaling.optimizer import LossScaleOptimizer
from keras_dtype_policy.policies import layer_walk
from keras_dtype_policy.policies.introspection import public_class_name
from keras_dtype_policy.tf_keras_compat import model_files
from keras_dtype_policy.tools import state_memory
from keras_dtype_policy.tools.tables import format_bytes
from keras_dtype_policy.tools.tables import format_table
from keras_dtype_policy.tools.tables import wrap

LAYER_COLUMNS = (
    ("path", "layer"),
    ("class", "class"),
    ("policy", "policy"),
    ("compute_dtype", "compute"),
    ("variable_dtype", "variables"),
    ("params", "params"),
    ("bytes", "bytes"),
)


def build_report(path):
    """Loads a saved model and describes it.

    Args:
        path: A `.keras` or `.h5` file, or a SavedModel directory that
            tf.keras 2 wrote (which needs TensorFlow).

    Returns:
        A JSON-serializable dict: `file`, `format`, `written_by`, `backend`,
        `model` (name and class), `layers` (see `layer_rows`), `totals`,
        `optimizer` (see `optimizer_info`, None for an uncompiled model),
        and `notes`, the warnings that loading gave and what the file
        cannot hold.

    Raises:
        ModelFileError: if the file is missing, not a model, or does not
            load.
    """
    model_file = model_files.read_model_file(path)
    model, messages = model_files.load_model(model_file)
    rows = layer_rows(model)
    notes = list(messages)
    optimizer = optimizer_info(model)
    scaling = optimizer and optimizer["loss_scaling"]
    if (
        scaling
        and scaling["settings"]["dynamic"]
        and model_file.from_tf_keras
        and not model_file.holds_loss_scale_state
    ):
        notes.append(
            "tf.keras 2 files hold no loss-scale state: the scale starts "
            "again from initial_scale; the inner optimizer's state is kept"
        )
    return {
        "file": str(model_file.path),
        "format": model_file.format,
        "written_by": model_file.writer,
        "backend": backend_dispatch.name(),
        "model": {
            "name": model.name,
            "class": public_class_name(model),
            "policy": model.dtype_policy.name,
        },
        "layers": rows,
        "totals": {
            "params": sum(row["params"] for row in rows),
            "bytes": sum(row["bytes"] for row in rows),
        },
        "optimizer": optimizer,
        "notes": notes,
    }


def layer_rows(model):
    """Returns one dict per layer, nested layers included, depth first, each
    once (see `layer_walk.layer_paths`).

    Each has `path` (names joined by "/"), `class`, `policy` (its name),
    `policy_class`, `compute_dtype`, `variable_dtype`, and `params` and
    `bytes`: the size of the weights the layer holds itself, not through
    its sublayers, so that the rows add up to the model's total.
    """
    rows = []
    for path, layer in layer_walk.layer_paths(model, include_inputs=True):
        weights = layer_walk.own_weights(layer)
        policy = layer.dtype_policy
        rows.append(
            {
                "path": path,
                "class": type(layer).__name__,
                "policy": policy.name,
                "policy_class": public_class_name(policy),
                "compute_dtype": policy.compute_dtype,
                "variable_dtype": policy.variable_dtype,
                "params": sum(_size(w) for w in weights),
                "bytes": sum(_size(w) * dtype_bytes(w.dtype) for w in weights),
            }
        )
    return rows


def optimizer_info(model):
    """Describes a compiled model's optimizer and its loss scaling.

    Returns:
        None for a model without optimizer, else a dict: `class`,
        `inner_class`, `learning_rate`, `iterations`, `loss_scaling`:
        None without loss scaling, else `settings` and `state` dicts, and
        `low_precision`: None without a `LowPrecisionOptimizer`, else its
        update and state dtype (see `state_memory.low_precision_state`).
    """
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return None
    scaling = None
    inner = optimizer
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        inner = optimizer.inner_optimizer
        scaling = {
            "settings": _loss_scale_settings(optimizer),
            "state": _loss_scale_state(optimizer),
        }
    parameters = sum(_size(w) for w in model.weights)
    return {
        "class": public_class_name(optimizer),
        "inner_class": public_class_name(inner),
        "learning_rate": _number(inner.learning_rate),
        "iterations": int(_number(optimizer.iterations)),
        "loss_scaling": scaling,
        "low_precision": state_memory.low_precision_state(
            optimizer, parameters
        ),
    }


def _loss_scale_settings(optimizer):
    dynamic = getattr(optimizer, "dynamic", True)
    settings = {
        "dynamic": dynamic,
        "initial_scale": float(optimizer.initial_scale),
    }
    if not dynamic:
        return settings
    settings["dynamic_growth_steps"] = int(optimizer.dynamic_growth_steps)
    if isinstance(optimizer, LossScaleOptimizer):
        for name in ("growth_factor", "backoff_factor", "min_scale"):
            settings[name] = float(getattr(optimizer, name))
        settings["max_scale"] = float(optimizer.max_scale)
        settings["hysteresis"] = int(optimizer.hysteresis)
    return settings


def _loss_scale_state(optimizer):
    if isinstance(optimizer, LossScaleOptimizer):
        state = {"loss_scale": optimizer.loss_scale}
        if optimizer.dynamic:
            state["dynamic_counter"] = optimizer.dynamic_counter
        state["skipped_steps"] = optimizer.skipped_steps
        if optimizer.dynamic and optimizer.hysteresis > 1:
            state["nonfinite_steps_in_a_row"] = (
                optimizer.nonfinite_steps_in_a_row
            )
        return state
    if not optimizer.built:
        return {"loss_scale": float(optimizer.initial_scale)}
    return {
        "loss_scale": _number(optimizer.dynamic_scale),
        "dynamic_counter": int(_number(optimizer.step_counter)),
    }


def format_report(report):
    """Returns the lines that `inspect` prints for people."""
    model = report["model"]
    lines = [
        f"file:     {report['file']} ({_format_name(report['format'])}, "
        f"written by {report['written_by']})",
        f"model:    {model['name']} ({model['class']}, policy "
        f"{model['policy']})",
        f"backend:  {report['backend']}",
        "",
    ]
    rows = [
        [row[key] for key, _ in LAYER_COLUMNS[:-1]]
        + [format_bytes(row["bytes"])]
        for row in report["layers"]
    ]
    totals = report["totals"]
    rows.append(
        [
            "total",
            "",
            "",
            "",
            "",
            totals["params"],
            format_bytes(totals["bytes"]),
        ]
    )
    lines += format_table(
        [title for _, title in LAYER_COLUMNS], rows, align="lllllrr"
    )
    lines.append("")
    lines += format_optimizer(report["optimizer"])
    if report["notes"]:
        lines.append("")
        lines.append("notes:")
        for note in report["notes"]:
            lines += wrap(note, bullet="  - ")
    return lines


def format_optimizer(info):
    """Returns the lines that describe the optimizer and its loss scaling."""
    if info is None:
        return ["optimizer: none (the model was saved without compiling)"]
    lines = [
        f"optimizer: {info['class']}"
        + (
            f" (inner: {info['inner_class']})"
            if info["inner_class"] != info["class"]
            else ""
        ),
        f"  learning rate {info['learning_rate']:g}, "
        f"{info['iterations']} iterations",
    ]
    lines += format_low_precision(info.get("low_precision"))
    scaling = info["loss_scaling"]
    if scaling is None:
        lines.append("  loss scaling: none")
        return lines
    settings = scaling["settings"]
    kind = "dynamic" if settings["dynamic"] else "fixed"
    lines.append(f"  loss scaling: {kind}")
    rows = [
        ("setting", key, _format_value(value))
        for key, value in settings.items()
        if key != "dynamic"
    ]
    rows += [
        ("state", key, _format_value(value))
        for key, value in scaling["state"].items()
    ]
    lines += format_table(("", "name", "value"), rows, indent="  ", align="llr")
    return lines


def format_low_precision(state):
    """Returns the lines on a `LowPrecisionOptimizer`'s update and state."""
    if state is None:
        return []
    state_dtype = state["state_dtype"] or "each weight's dtype"
    line = f"  low-precision updates: {state['update']}, state {state_dtype}"
    if state["quantized_slots"]:
        line += f" ({state['quantized_slots']} slots as codes)"
    lines = [line]
    per_parameter = state["state_bytes_per_parameter"]
    if per_parameter is not None:
        lines.append(
            f"  optimizer state: {per_parameter:.2f} bytes a parameter"
        )
    return lines


def _format_name(file_format):
    names = {"keras": ".keras", "savedmodel": "SavedModel directory"}
    return names.get(file_format, "legacy .h5")


def _format_value(value):
    """Formats a setting: whole floats without exponent, powers of two
    above 1024 with their exponent: `"16777216 (2^24)"`."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        if value > 1024 and value & (value - 1) == 0:
            return f"{value} (2^{value.bit_length() - 1})"
        return str(value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _number(value):
    return float(np.asarray(keras.ops.convert_to_numpy(value)))


def _size(weight):
    return int(np.prod(weight.shape, dtype=np.int64))


def dtype_bytes(dtype):
    """Returns the bytes per element of a dtype: 2 for `"bfloat16"`."""
    name = keras.backend.standardize_dtype(dtype)
    if name == "bool":
        return 1
    bits = re.search(r"(\d+)$", name)
    return int(bits.group(1)) // 8 if bits else 4
