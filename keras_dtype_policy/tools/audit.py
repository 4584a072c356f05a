"""The numerics audit: a model under a candidate policy, next to float32.

The model is rebuilt twice, all in float32 and under the candidate policy
(or rules), and both copies run on the same inputs. For each layer that
computes something itself (a leaf layer, inside nested models and layers
too, and a layer that holds weights of its own besides its sublayers),
found by its path in the model, the audit measures how far its output
drifts from float32, which float32 values its compute dtype cannot hold
(overflow to infinity, flush to zero) and, with labels and a loss, which
weight gradients flush to zero in that dtype without loss scaling and at
the scale a dynamic `LossScaleOptimizer` would settle on.
`docs/precision-rules-and-audit.md` explains each number.
"""

import dataclasses
import glob
import math
import os
from typing import NamedTuple

import keras
import numpy as np

from keras_dtype_policy.policies import float8
from keras_dtype_policy.policies import layer_walk
from keras_dtype_policy.policies import precision_rules
from keras_dtype_policy.policies import rules_application
from keras_dtype_policy.tf_keras_compat import load_override
from keras_dtype_policy.tf_keras_compat import model_files
from keras_dtype_policy.tools import audit_table
from keras_dtype_policy.tools import layer_recorder
from keras_dtype_policy.tools.audit_table import format_error
from keras_dtype_policy.tools.audit_table import format_fraction
from keras_dtype_policy.tools.float_tensors import float_tensors
from keras_dtype_policy.tools.gradients import first_samples
from keras_dtype_policy.tools.gradients import weight_gradients
from keras_dtype_policy.tools.rounding import round_to
from keras_dtype_policy.types import Data
from keras_dtype_policy.types import LossFunction

# A dynamic LossScaleOptimizer starts at 2**15 and halves on overflow.
INITIAL_SCALE = 2.0**15
FLOAT16_MAX = 65504.0


class AuditData(NamedTuple):
    """What the audit runs the model on.

    Attributes:
        x: The inputs, given or generated.
        y: The labels for the gradient columns, or None.
        loss: The loss for the gradient columns, or None.
        generated: Whether the audit generated `x`.
    """

    x: Data
    y: Data
    loss: LossFunction | None
    generated: bool


class AuditedLayer(NamedTuple):
    """A layer of one copy of the model, and its path in the model."""

    layer: keras.layers.Layer
    path: str


@dataclasses.dataclass
class LayerValues:
    """The floating-point values one layer received and returned.

    Attributes:
        inputs: float64 NumPy arrays, one per tensor received (masks left
            out), over every call.
        outputs: The same for the tensors it returned.
    """

    inputs: list = dataclasses.field(default_factory=list)
    outputs: list = dataclasses.field(default_factory=list)


class CopyRun(NamedTuple):
    """One copy of the model (float32 or the candidate), run on `x`.

    Attributes:
        layers: Its audited layers, depth first.
        values: The values of each of `layers`, in the same order.
        outputs: The model's outputs, a flat list of float64 NumPy arrays.
    """

    layers: list
    values: list
    outputs: list


class Comparison(NamedTuple):
    """Both copies' runs, and the gradients the audit's columns need.

    Attributes:
        reference: The float32 copy's run.
        candidate: The candidate copy's run.
        gradients: The float32 copy's weight gradients, by `id` of the
            weight; None without labels and a loss.
        scale: The loss scale of the 'at scale' column; None where no
            layer computes in float16 or there are no gradients.
    """

    reference: CopyRun
    candidate: CopyRun
    gradients: dict | None
    scale: float | None


def audit(
    model: keras.Model | str | os.PathLike,
    policy: str | keras.DTypePolicy | None = None,
    rules: precision_rules.PrecisionRules | None = None,
    x: Data = None,
    y: Data = None,
    loss: LossFunction | None = None,
    samples: int = 256,
    batch_size: int = 32,
    seed: int = 0,
    max_relative_error: float = 0.05,
    tolerance: float = 0.01,
) -> audit_table.AuditTable:
    """Audits a model's numerics under a candidate policy against float32.

    Every layer that computes something is audited, also inside nested
    models and layers (a keras-hub backbone, a `MultiHeadAttention`).

    Args:
        model: A built functional or Sequential `keras.Model` (a keras-hub
            task or backbone too), or the path of a `.keras` or `.h5` file.
        policy: The candidate policy name; `"mixed_float16"` when neither
            `policy` nor `rules` is given.
        rules: A `PrecisionRules` as the candidate instead.
        x: Inputs (an array, or a list or dict for several inputs); None to
            generate `samples` of them.
        y: Labels for `x`, for the gradient columns; or None.
        loss: The loss for the gradient columns (a name or a
            `keras.losses.Loss`); the model's compiled loss if None.
        samples: How many inputs to generate when `x` is None.
        batch_size: The batch of the forward passes and of the gradient.
        seed: The seed of the generated inputs.
        max_relative_error: The output's relative error above which the
            policy is not safe.
        tolerance: The fraction of values flushed to zero (activations, or
            gradients at the loss scale) above which a layer should be kept
            in float32.

    Returns:
        An `AuditTable`.

    Example:

    >>> table = keras_dtype_policy.audit(model)  # doctest: +SKIP
    >>> print(table)  # doctest: +SKIP
    """
    if policy is None and rules is None:
        policy = "mixed_float16"
    candidate_rules = load_override.override_rules(policy, rules)
    _refuse_float8(candidate_rules, policy, rules)
    model = _audited_model(model)
    _check_thresholds(max_relative_error, tolerance)
    data = _audit_data(model, x, y, loss, samples, seed)
    comparison = _compare(model, candidate_rules, data, batch_size)
    rows = _rows(comparison, tolerance)
    return _table(
        model, candidate_rules, rows, comparison, data, max_relative_error
    )


def _audited_model(model):
    """The model to audit: `model` itself, or the one its file holds."""
    if isinstance(model, (str, os.PathLike)):
        model, _ = model_files.load_model(model_files.read_model_file(model))
    if not isinstance(model, keras.Model):
        raise TypeError(
            "`model` must be a keras.Model or a model file's path. "
            f"Received: model={model!r} (of type {type(model).__name__})"
        )
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):
        inputs = None
    if not inputs:
        raise ValueError(
            "The audit runs the model on inputs shaped as its own: "
            "`model` must be a functional or Sequential model built "
            f"on keras.Input. Received: model={model.name!r} "
            f"({type(model).__name__})"
        )
    return model


def _check_thresholds(max_relative_error, tolerance):
    """Raises a ValueError for a threshold out of its range."""
    if (
        not isinstance(max_relative_error, (int, float))
        or not max_relative_error > 0
    ):
        raise ValueError(
            "`max_relative_error` must be a number above 0. Received: "
            f"max_relative_error={max_relative_error!r}"
        )
    if not isinstance(tolerance, (int, float)) or not 0 <= tolerance < 1:
        raise ValueError(
            "`tolerance` must be a fraction in [0, 1). Received: "
            f"tolerance={tolerance!r}"
        )


def _audit_data(model, x, y, loss, samples, seed):
    """The inputs, generated where `x` is None, and the gradients' loss."""
    generated = x is None
    if generated:
        x = _generated_inputs(model, samples, seed)
    elif not _length(x):
        raise ValueError(
            "`x` holds 0 samples: there is nothing to audit. Received: x "
            f"of shape {np.shape(keras.tree.flatten(x)[0])}"
        )
    if loss is None and y is not None and getattr(model, "compiled", False):
        loss = getattr(model, "loss", None)
    return AuditData(x=x, y=y, loss=loss, generated=generated)


def _compare(model, candidate_rules, data, batch_size):
    """Runs a float32 copy and a candidate copy of `model` on `data.x`."""
    reference = rules_application.apply_rules(model, "float32", False)
    candidate = rules_application.apply_rules(model, candidate_rules, True)
    reference_layers = _audited_layers(reference, model)
    candidate_layers = _audited_layers(candidate, model)
    reference_run = _run(reference, reference_layers, data.x, batch_size)
    candidate_run = _run(candidate, candidate_layers, data.x, batch_size)
    gradients = None
    if data.y is not None and data.loss is not None:
        gradients = weight_gradients(
            reference,
            first_samples(data.x, batch_size),
            first_samples(data.y, batch_size),
            data.loss,
        )
    uses_float16 = any(
        audited.layer.compute_dtype == "float16" for audited in candidate_layers
    )
    scale = None
    if gradients is not None and uses_float16:
        scale = _loss_scale(gradients.values())
    return Comparison(reference_run, candidate_run, gradients, scale)


def _audited_layers(copy, model):
    """Returns an `AuditedLayer` of `copy` per audited layer: the leaves,
    and the layers with weights of their own, depth first."""
    return [
        AuditedLayer(layer, path)
        for layer, path in rules_application.zip_layer_paths(
            copy, model, "the audit's rows"
        )
        if layer_walk.is_leaf(layer) or layer_walk.own_weights(layer)
    ]


def _run(model, layers, x, batch_size):
    """Returns the `CopyRun` of `model` on `x`.

    The model runs on `x` batch by batch, each layer's `call` replaced
    for the while by one that records the floating-point tensors it
    receives (masks left out) and returns, on every call.
    """
    values = [LayerValues() for _ in layers]
    outputs = []

    def record(index, layer, args, kwargs, result):
        given = [args] + [
            value for key, value in kwargs.items() if "mask" not in key
        ]
        values[index].inputs.extend(_float_values(given))
        values[index].outputs.extend(_float_values(result))

    keyed = [(index, audited.layer) for index, audited in enumerate(layers)]
    with layer_recorder.recording(keyed, record):
        for start in range(0, _length(x), batch_size):
            batch = keras.tree.map_structure(
                lambda a, s=start: keras.ops.convert_to_tensor(
                    np.asarray(a)[s : s + batch_size]
                ),
                x,
            )
            result = model(batch, training=False)
            outputs += [_numpy(v) for v in keras.tree.flatten(result)]
    return CopyRun(layers=layers, values=values, outputs=outputs)


def _float_values(structure):
    return [_numpy(value) for value in float_tensors(structure)]


def _numpy(value):
    return np.asarray(keras.ops.convert_to_numpy(value)).astype("float64")


def _rows(comparison, tolerance):
    """A `LayerAudit` per audited layer, in the reference's order."""
    return [
        _layer_row(
            audited,
            reference,
            candidate,
            candidate_layer.layer.compute_dtype,
            comparison,
            tolerance,
        )
        for audited, reference, candidate, candidate_layer in zip(
            comparison.reference.layers,
            comparison.reference.values,
            comparison.candidate.values,
            comparison.candidate.layers,
            strict=True,
        )
    ]


def _layer_row(audited, reference, candidate, dtype, comparison, tolerance):
    """The `LayerAudit` of one layer from both copies' values."""
    reference_out = _flat(reference.outputs)
    candidate_out = _flat(candidate.outputs)
    row = audit_table.LayerAudit(
        name=audited.layer.name,
        path=audited.path,
        class_name=type(audited.layer).__name__,
        compute_dtype=dtype,
        relative_error=_relative_error(reference.outputs, candidate.outputs),
        nonfinite=(
            _mean(~np.isfinite(candidate_out)) if candidate_out.size else 0.0
        ),
        overflow=max(
            _overflow(_flat(reference.inputs), dtype),
            _overflow(reference_out, dtype),
        ),
        flush_to_zero=_flush(reference_out, dtype, 1.0),
    )
    weights = _audited_weights(audited.layer)
    if comparison.gradients is not None and weights:
        grads = [comparison.gradients[id(v)] for v in weights]
        grads = np.concatenate([g.reshape(-1) for g in grads])
        row.gradient_underflow = _flush(grads, dtype, 1.0)
        if comparison.scale is not None:
            row.scaled_gradient_underflow = _flush(
                grads, dtype, comparison.scale
            )
    reasons = _keep_float32_reasons(row, comparison.scale, tolerance)
    row.keep_float32 = bool(reasons)
    row.reason = "; ".join(reasons)
    return row


def _keep_float32_reasons(row, scale, tolerance):
    """Why the layer of `row` should stay in float32; [] if it need not."""
    dtype = row.compute_dtype
    reasons = []
    if dtype == "float32":
        return reasons
    if row.overflow > 0:
        reasons.append(
            f"{format_fraction(row.overflow)} of its inputs or outputs "
            f"overflow {dtype}"
        )
    if row.flush_to_zero > tolerance:
        reasons.append(
            f"{format_fraction(row.flush_to_zero)} of its outputs flush to "
            f"zero in {dtype}"
        )
    scaled = row.scaled_gradient_underflow
    if scale is None:
        scaled = row.gradient_underflow if dtype == "bfloat16" else None
    if scaled is not None and scaled > tolerance:
        reasons.append(
            f"{format_fraction(scaled)} of its gradients flush to zero "
            f"in {dtype}" + (" at the loss scale" if scale else "")
        )
    return reasons


def _table(model, candidate_rules, rows, comparison, data, max_relative_error):
    """The `AuditTable`: the rows, the verdict and the recommended rules."""
    output_error = _relative_error(
        comparison.reference.outputs, comparison.candidate.outputs
    )
    reasons = [f"{row.path}: {row.reason}" for row in rows if row.keep_float32]
    if not math.isfinite(output_error) or output_error > max_relative_error:
        reasons.append(
            f"the output's relative error {format_error(output_error)} exceeds "
            f"{max_relative_error:g}"
        )
    recommended = candidate_rules
    flagged = [row.path for row in rows if row.keep_float32]
    if flagged:
        recommended = candidate_rules.extend(
            precision_rules.PrecisionRule(
                "float32",
                paths=tuple(glob.escape(path) for path in flagged),
                why="the numerics audit: these layers' values do not fit "
                f"{candidate_rules.default.compute_dtype}",
            )
        )
    return audit_table.AuditTable(
        model_name=model.name,
        rules=candidate_rules,
        rows=rows,
        samples=_length(data.x),
        generated_inputs=data.generated,
        output_relative_error=output_error,
        loss_scale=comparison.scale,
        safe=not reasons,
        reasons=reasons,
        recommended_rules=recommended,
    )


def _audited_weights(layer):
    """A leaf's trainable weights; a container's own trainable ones."""
    if layer_walk.is_leaf(layer):
        return layer.trainable_weights
    return [w for w in layer_walk.own_weights(layer) if w.trainable]


def _flat(arrays):
    if not arrays:
        return np.zeros((0,), dtype="float64")
    return np.concatenate(
        [np.asarray(a, dtype="float64").reshape(-1) for a in arrays]
    )


def _relative_error(reference, candidate):
    reference = _flat(reference)
    candidate = _flat(candidate)
    if not np.all(np.isfinite(candidate)):
        return math.inf
    norm = float(np.linalg.norm(reference))
    difference = float(np.linalg.norm(candidate - reference))
    if norm == 0:
        return 0.0 if difference == 0 else math.inf
    return difference / norm


def _overflow(values, dtype):
    finite = values[np.isfinite(values)]
    if not finite.size or dtype in ("float32", "float64"):
        return 0.0
    return _mean(~np.isfinite(round_to(finite, dtype)))


def _flush(values, dtype, scale):
    nonzero = values[(values != 0) & np.isfinite(values)]
    if not nonzero.size or dtype in ("float32", "float64"):
        return 0.0
    with np.errstate(over="ignore"):
        return _mean(round_to(nonzero * scale, dtype) == 0)


def _mean(mask):
    return float(np.count_nonzero(mask)) / mask.size


def _loss_scale(gradients):
    """The power of two up to 2**15 at which no gradient overflows."""
    largest = max(
        (float(np.max(np.abs(g))) for g in gradients if g.size), default=0.0
    )
    scale = INITIAL_SCALE
    while scale > 1 and largest * scale > FLOAT16_MAX:
        scale /= 2
    return scale


def _generated_inputs(model, samples, seed):
    """Inputs in the structure of the model's inputs (a dict for
    keras-hub)."""
    rng = np.random.default_rng(seed)

    def generate(tensor):
        shape = tuple(tensor.shape)[1:]
        if any(dim is None for dim in shape):
            raise ValueError(
                f"Input {tensor.name!r} has unknown dimensions {shape}: "
                "give inputs (`x`, or --data) to audit this model"
            )
        dtype = keras.backend.standardize_dtype(tensor.dtype)
        if keras.backend.is_float_dtype(dtype):
            return rng.standard_normal((samples, *shape), "float32")
        return rng.integers(0, 2, (samples, *shape)).astype(dtype)

    try:
        structure = model.input
    except (AttributeError, ValueError):  # a Sequential model has no `input`
        structure = model.inputs
        structure = structure[0] if len(structure) == 1 else structure
    return keras.tree.map_structure(generate, structure)


def _length(data):
    return len(np.asarray(keras.tree.flatten(data)[0]))


def _refuse_float8(candidate_rules, policy, rules):
    """The audit compares float policies layer by layer; a float8 layer's
    outputs depend on its scaling history, which one batch does not have."""
    policies = [candidate_rules.default] + [r.policy for r in candidate_rules]
    if any(float8.is_float8_policy(p) or p.name == "float8" for p in policies):
        argument = "policy" if rules is None else "rules"
        value = policy if rules is None else rules
        raise ValueError(
            "The audit compares floating-point policies; it does not audit "
            "float8 (a float8 layer's scales come from the batches it has "
            "seen). Audit the float8 policy's source, such as "
            f"'mixed_bfloat16'. Received: {argument}={value!r}"
        )
