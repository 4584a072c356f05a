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

import glob
import math
import os

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

# A dynamic LossScaleOptimizer starts at 2**15 and halves on overflow.
INITIAL_SCALE = 2.0**15
FLOAT16_MAX = 65504.0


def audit(
    model,
    policy=None,
    rules=None,
    x=None,
    y=None,
    loss=None,
    samples=256,
    batch_size=32,
    seed=0,
    max_relative_error=0.05,
    tolerance=0.01,
):
    """Audits a model's numerics under a candidate policy against float32.

    Every layer that computes something is audited, also inside nested
    models and layers (a keras-hub backbone, a `MultiHeadAttention`): the
    audit runs the model and records what each such layer's `call`
    receives and returns.

    Args:
        model: A built functional or Sequential `keras.Model` (a keras-hub
            task or backbone too), or the path of a `.keras` or `.h5`
            file.
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
        tolerance: The fraction of values flushed to zero (activations,
            or gradients at the loss scale) above which a layer should be
            kept in float32.

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
    if isinstance(model, (str, os.PathLike)):
        model, _ = model_files.load_model(model_files.read_model_file(model))
    _check_model(model)
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

    reference = rules_application.apply_rules(model, "float32", False)
    candidate = rules_application.apply_rules(model, candidate_rules, True)
    reference_layers = _audited_layers(reference, model)
    candidate_layers = _audited_layers(candidate, model)
    ref_values, ref_final = _run(reference, reference_layers, x, batch_size)
    cand_values, cand_final = _run(candidate, candidate_layers, x, batch_size)

    gradients = None
    if y is not None and loss is not None:
        gradients = weight_gradients(
            reference,
            first_samples(x, batch_size),
            first_samples(y, batch_size),
            loss,
        )
    uses_float16 = any(
        layer.compute_dtype == "float16" for layer, _ in candidate_layers
    )
    scale = None
    if gradients is not None and uses_float16:
        scale = _loss_scale(gradients.values())

    rows = []
    for index, (layer, path) in enumerate(reference_layers):
        dtype = candidate_layers[index][0].compute_dtype
        rows.append(
            _layer_row(
                layer,
                path,
                dtype,
                ref_values[index],
                cand_values[index][1],
                gradients,
                scale,
                tolerance,
            )
        )
    output_error = _relative_error(ref_final, cand_final)
    reasons = []
    for row in rows:
        if row.keep_float32:
            reasons.append(f"{row.path}: {row.reason}")
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
        samples=_length(x),
        generated_inputs=generated,
        output_relative_error=output_error,
        loss_scale=scale,
        safe=not reasons,
        reasons=reasons,
        recommended_rules=recommended,
    )


def _check_model(model):
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


def _audited_layers(copy, model):
    """Returns `(layer of copy, path in model)` per audited layer: the
    leaves, and the layers with weights of their own, depth first."""
    return [
        (layer, path)
        for layer, path in rules_application.zip_layer_paths(
            copy, model, "the audit's rows"
        )
        if layer_walk.is_leaf(layer) or layer_walk.own_weights(layer)
    ]


def _run(model, layers, x, batch_size):
    """Returns `(inputs, outputs)` of each layer, then the model's outputs.

    The model runs on `x` batch by batch, each layer's `call` replaced
    for the while by one that records the floating-point tensors it
    receives (masks left out) and returns, on every call. Every value is
    a flat list of NumPy arrays.
    """
    records = [([], []) for _ in layers]
    finals = []

    def record(index, layer, args, kwargs, result):
        given = [args] + [
            value for key, value in kwargs.items() if "mask" not in key
        ]
        records[index][0].extend(_float_values(given))
        records[index][1].extend(_float_values(result))

    keyed = [(index, layer) for index, (layer, _) in enumerate(layers)]
    with layer_recorder.recording(keyed, record):
        for start in range(0, _length(x), batch_size):
            batch = keras.tree.map_structure(
                lambda a, s=start: keras.ops.convert_to_tensor(
                    np.asarray(a)[s : s + batch_size]
                ),
                x,
            )
            outputs = model(batch, training=False)
            finals += [_numpy(v) for v in keras.tree.flatten(outputs)]
    return records, finals


def _float_values(structure):
    return [_numpy(value) for value in float_tensors(structure)]


def _numpy(value):
    return np.asarray(keras.ops.convert_to_numpy(value)).astype("float64")


def _layer_row(layer, path, dtype, ref, cand_out, gradients, scale, tolerance):
    ref_in, ref_out = ref
    reference = _flat(ref_out)
    candidate = _flat(cand_out)
    row = audit_table.LayerAudit(
        name=layer.name,
        path=path,
        class_name=type(layer).__name__,
        compute_dtype=dtype,
        relative_error=_relative_error(ref_out, cand_out),
        nonfinite=_mean(~np.isfinite(candidate)) if candidate.size else 0.0,
        overflow=max(
            _overflow(_flat(ref_in), dtype), _overflow(reference, dtype)
        ),
        flush_to_zero=_flush(reference, dtype, 1.0),
    )
    weights = _audited_weights(layer)
    if gradients is not None and weights:
        grads = [gradients[id(v)] for v in weights]
        grads = np.concatenate([g.reshape(-1) for g in grads])
        row.gradient_underflow = _flush(grads, dtype, 1.0)
        if scale is not None:
            row.scaled_gradient_underflow = _flush(grads, dtype, scale)
    reasons = []
    if dtype != "float32":
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
    row.keep_float32 = bool(reasons)
    row.reason = "; ".join(reasons)
    return row


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
