"""A memory plan before training: each configuration's predicted peak.

`plan(model, batch_size=..., budget=...)` predicts, for each dtype policy
and optimizer-state configuration the package offers, the process's peak
memory of a training step, in parts: weights, gradients (one a trainable
weight, in its dtype), optimizer state (`state_memory`'s arithmetic),
activations at the batch (`memory_plan_models.activation_bytes`), the
step's working set and the backend's baseline (both measured:
`memory_plan_calibration`). Rows that fit the budget come first, the one
that fits the largest model first.
"""

import numbers
import os
import re
from collections.abc import Sequence

import keras

from keras_dtype_policy import backend_dispatch
from keras_dtype_policy.policies import hardware
from keras_dtype_policy.policies import layer_walk
from keras_dtype_policy.policies.policy import DTypePolicy
from keras_dtype_policy.tools import memory_plan_calibration as calibration
from keras_dtype_policy.tools import state_memory
from keras_dtype_policy.tools.memory_plan_models import activation_bytes
from keras_dtype_policy.tools.memory_plan_models import resolve_model
from keras_dtype_policy.tools.memory_plan_records import MemoryPlan
from keras_dtype_policy.tools.memory_plan_records import PlanRow

# name: (policy, LowPrecisionOptimizer update, state dtype), as benchmark
# 10 and 12 train them (`tests/benchmarks/quantized_state_probe.py`).
CONFIGURATIONS = {
    "float32": ("float32", None, None),
    "mixed_bfloat16": ("mixed_bfloat16", None, None),
    "kahan_bfloat16": ("kahan_bfloat16", "kahan", None),
    "stochastic_bfloat16": ("stochastic_bfloat16", "stochastic_rounding", None),
    "stochastic_bfloat16_8bit": (
        "stochastic_bfloat16",
        "stochastic_rounding",
        "8bit",
    ),
    "kahan_bfloat16_8bit": ("kahan_bfloat16", "kahan", "8bit"),
    "mixed_bfloat16_8bit": ("mixed_bfloat16", "stochastic_rounding", "8bit"),
    "stochastic_bfloat16_4bit": (
        "stochastic_bfloat16",
        "stochastic_rounding",
        "4bit",
    ),
}
# Optimizers whose state is Adam's two moments a parameter.
ADAM_LIKE = ("adam", "adamw")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def plan(
    model: keras.Model | str | os.PathLike | dict,
    optimizer: str | keras.optimizers.Optimizer = "adam",
    batch_size: int = 32,
    budget: float | str | None = None,
    configurations: Sequence[str] | str | None = None,
) -> MemoryPlan:
    """Predicts the peak memory of training `model` in each configuration.

    Args:
        model: A built `keras.Model`, a path to a `.keras` file or to a
            JSON config (a keras-hub preset's `config.json`), or such a
            config as a dict. Files and configs are built without
            allocating their weights and without running their code.
        optimizer: `"adam"` or `"adamw"` (or such an optimizer): the
            optimizer the working set was measured with.
        batch_size: The training batch size.
        budget: The memory there is, in bytes or as a string such as
            `"16GiB"` or `"500MB"`; None to judge nothing.
        configurations: Names of `CONFIGURATIONS` to plan; None for all.

    Returns:
        A `MemoryPlan`: print it for a table.

    Example:

    >>> model = keras.Sequential([keras.Input((512,)), keras.layers.Dense(512)])
    >>> memory = plan(model, batch_size=8, budget="2GiB")
    >>> memory.rows[0].configuration
    'stochastic_bfloat16_4bit'
    """
    names = configuration_names(configurations)
    _check_optimizer(optimizer)
    batch_size = _positive_int(batch_size, "batch_size")
    budget_bytes = parse_budget(budget)
    model = resolve_model(model)
    backend = backend_dispatch.name()
    rows = [
        _row(model, name, batch_size, budget_bytes, backend) for name in names
    ]
    rows.sort(key=lambda row: (row.fits is False, row.bytes_per_parameter))
    return MemoryPlan(
        model_name=model.name,
        parameters=_count(model.weights),
        trainable_parameters=_count(model.trainable_weights),
        batch_size=batch_size,
        budget=budget_bytes,
        backend=backend,
        calibration=calibration.MACHINE,
        rows=tuple(rows),
    )


def parse_budget(budget):
    """Returns a budget in bytes: None, a positive number, or a string
    such as `"16GiB"`, `"1.5 GB"` or `"500MiB"`."""
    if budget is None:
        return None
    value = budget
    if isinstance(budget, str):
        found = re.fullmatch(
            r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]i?b|b)?\s*",
            budget.lower(),
        )
        if found is None:
            value = None
        else:
            value = float(found.group(1)) * _UNITS[found.group(2) or ""]
    if (
        not isinstance(value, numbers.Real)
        or isinstance(value, bool)
        or not 0 < value < float("inf")
    ):
        raise ValueError(
            "`budget` must be a positive number of bytes or a size such "
            f"as '16GiB'. Received: budget={budget!r}"
        )
    return int(value)


def _row(model, name, batch_size, budget, backend):
    policy_name, update, state_dtype = CONFIGURATIONS[name]
    policy = DTypePolicy(policy_name)
    weight_dtype = policy.variable_dtype
    weight_bytes = _itemsize(weight_dtype)
    trainable = _count(model.trainable_weights, floats_only=True)
    everything = sum(
        _size(v.shape)
        * (weight_bytes if _is_float(v.dtype) else _itemsize(v.dtype))
        for v in model.weights
    )
    state = state_memory.adam_bytes_per_parameter(
        weight_dtype, update, state_dtype
    )
    activations, note = activation_bytes(
        model, batch_size, _itemsize(policy.compute_dtype)
    )
    per_parameter, per_variable, baseline, measured = calibration.step_costs(
        backend, name
    )
    variables = sum(1 for v in model.trainable_weights if _is_float(v.dtype))
    tables = _embedding_tables(model)
    per_element, per_table = calibration.embedding_costs(backend, name)
    notes = [f"activations: {note}"] if note else []
    if not measured:
        notes.append(
            f"working set and baseline: {backend} was not measured; "
            f"{calibration.FALLBACK_BACKEND}'s CPU figures stand in"
        )
    elif _on_accelerator(backend):
        notes.append(
            "working set and baseline: the CPU's figures (the plan runs on "
            "an accelerator, where they were not measured)"
        )
    parts = {
        "weights": everything,
        "gradients": trainable * weight_bytes,
        "optimizer_state": round(trainable * (state - weight_bytes)),
        "activations": activations,
        "working_set": round(
            trainable * per_parameter
            + variables * per_variable
            + sum(tables) * per_element
            + len(tables) * per_table
        ),
        "baseline": baseline,
    }
    peak = sum(parts.values())
    cost = (peak - baseline - activations) / max(trainable, 1)
    return PlanRow(
        configuration=name,
        policy=policy_name,
        **parts,
        peak=peak,
        fits=None if budget is None else peak <= budget,
        bytes_per_parameter=cost,
        note="; ".join(notes),
    )


def _embedding_tables(model):
    """The element counts of the trainable tables of `model`'s Embedding
    layers (keras-hub's embeddings subclass Keras')."""
    return [
        _size(weight.shape)
        for layer in layer_walk.all_layers(model)
        if isinstance(layer, keras.layers.Embedding)
        for weight in layer_walk.own_weights(layer)
        if weight.trainable and _is_float(weight.dtype)
    ]


def configuration_names(configurations):
    """Returns the names of `CONFIGURATIONS` asked for (None: all), from
    a list or a comma-separated string."""
    if configurations is None:
        return tuple(CONFIGURATIONS)
    if isinstance(configurations, str):
        configurations = configurations.split(",")
    names = tuple(str(name).strip() for name in configurations)
    unknown = [name for name in names if name not in CONFIGURATIONS]
    if unknown or not names:
        raise ValueError(
            "`configurations` must name some of "
            f"{', '.join(CONFIGURATIONS)}. "
            f"Received: configurations={configurations!r}"
        )
    return tuple(dict.fromkeys(names))


def _check_optimizer(optimizer):
    name = optimizer
    if isinstance(optimizer, keras.optimizers.Optimizer):
        name = type(optimizer).__name__
    if not isinstance(name, str) or name.lower() not in ADAM_LIKE:
        raise ValueError(
            "`optimizer` must be 'adam' or 'adamw' (the optimizer the "
            f"working set was measured with). Received: optimizer={optimizer!r}"
        )


def _positive_int(value, argument):
    if (
        not isinstance(value, numbers.Integral)
        or isinstance(value, bool)
        or value < 1
    ):
        raise ValueError(
            f"`{argument}` must be a positive integer. "
            f"Received: {argument}={value!r} (of type {type(value).__name__})"
        )
    return int(value)


def _count(variables, floats_only=False):
    return sum(
        int(_size(v.shape))
        for v in variables
        if not floats_only or _is_float(v.dtype)
    )


def _size(shape):
    total = 1
    for dim in shape:
        total *= int(dim)
    return total


def _is_float(dtype):
    return "float" in keras.backend.standardize_dtype(dtype)


def _itemsize(dtype):
    return state_memory.slot_bytes(None, dtype)


def _on_accelerator(backend):
    try:
        devices = hardware.list_devices(backend)
    except RuntimeError:
        return False
    return any(device.kind != "cpu" for device in devices)
