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

import contextlib
import dataclasses
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
from keras_dtype_policy.tools.float_tensors import float_tensors

# A dynamic LossScaleOptimizer starts at 2**15 and halves on overflow.
INITIAL_SCALE = 2.0**15
FLOAT16_MAX = 65504.0


@dataclasses.dataclass
class LayerAudit:
    """What the audit found for one layer.

    Attributes:
        name: The layer's name.
        path: Its path in the audited model: the names of the layers that
            hold it and its own, joined by "/"
            (`"bert_backbone/transformer_layer_0/self_attention_layer/query"`),
            what `PrecisionRule(paths=...)` matches.
        class_name: The layer's class.
        compute_dtype: Its compute dtype under the candidate policy.
        relative_error: `|candidate - float32| / |float32|` of its output
            (Frobenius norms over the batch); `inf` if the candidate's
            output is not finite.
        nonfinite: The fraction of its candidate outputs that are inf or
            NaN (also those an earlier layer caused).
        overflow: The fraction of its finite float32 inputs, or of its
            outputs (whichever is larger), that become infinite in the
            compute dtype: a layer casts its inputs to it on entry.
        flush_to_zero: The fraction of its nonzero float32 outputs that
            become zero in the compute dtype.
        gradient_underflow: The fraction of its nonzero weight gradients
            that become zero in the compute dtype, unscaled; None without
            labels and a loss, or for a layer without weights.
        scaled_gradient_underflow: The same at the audit's loss scale;
            None where there is no loss scale.
        keep_float32: Whether the audit recommends float32 for the layer.
        reason: Why, when it does.
    """

    name: str
    path: str
    class_name: str
    compute_dtype: str
    relative_error: float
    nonfinite: float
    overflow: float
    flush_to_zero: float
    gradient_underflow: float = None
    scaled_gradient_underflow: float = None
    keep_float32: bool = False
    reason: str = ""


@dataclasses.dataclass
class AuditTable:
    """The audit of one model under one candidate policy.

    Iterate over it for its `LayerAudit` rows; `row(path)` finds one.

    Attributes:
        model_name: The audited model's name.
        rules: The candidate `PrecisionRules` (a bare policy is rules with
            no exceptions).
        rows: One `LayerAudit` per layer that computes something itself:
            every leaf layer (one that holds no other), and every layer
            with weights of its own besides its sublayers; depth first.
        samples: The number of input samples.
        generated_inputs: Whether the inputs were generated (standard
            normal floats, integers 0 and 1) rather than given.
        output_relative_error: The model output's relative error.
        loss_scale: The loss scale of the gradient columns, or None.
        safe: The verdict: the candidate policy is safe for this model.
        reasons: Why it is not, one line each.
        recommended_rules: The candidate rules extended with a rule that
            gives float32 to the paths of the layers the audit flags (the
            candidate rules if none); `apply_rules` applies it to exactly
            those layers.
    """

    model_name: str
    rules: precision_rules.PrecisionRules
    rows: list
    samples: int
    generated_inputs: bool
    output_relative_error: float
    loss_scale: float
    safe: bool
    reasons: list
    recommended_rules: precision_rules.PrecisionRules

    @property
    def policy(self):
        """The candidate's default policy name."""
        return self.rules.default.name

    @property
    def keep_float32(self):
        """The paths of the layers the audit recommends float32 for."""
        return [row.path for row in self.rows if row.keep_float32]

    def row(self, path):
        """Returns the `LayerAudit` of the layer at `path`, or of the one
        layer named `path`."""
        for row in self.rows:
            if row.path == path:
                return row
        named = [row for row in self.rows if row.name == path]
        if len(named) == 1:
            return named[0]
        if named:
            raise KeyError(
                f"{len(named)} layers are named {path!r}; give a path: "
                f"{[row.path for row in named]}"
            )
        raise KeyError(f"No layer at {path!r} in the audit")

    def __iter__(self):
        return iter(self.rows)

    def __len__(self):
        return len(self.rows)

    def to_dict(self):
        """Returns the audit as a JSON-serializable dict."""
        return {
            "model": self.model_name,
            "policy": self.policy,
            "rules": self.rules.get_config(),
            "samples": self.samples,
            "generated_inputs": self.generated_inputs,
            "output_relative_error": _json_number(self.output_relative_error),
            "loss_scale": self.loss_scale,
            "layers": [
                {k: _json_number(v) for k, v in dataclasses.asdict(row).items()}
                for row in self.rows
            ],
            "safe": self.safe,
            "reasons": list(self.reasons),
            "keep_float32": self.keep_float32,
            "recommended_rules": self.recommended_rules.get_config(),
        }

    def format(self):
        """Returns the audit as lines of text."""
        from keras_dtype_policy.tools import tables

        header = (
            "layer",
            "class",
            "compute",
            "rel. error",
            "nonfinite",
            "overflow",
            "to zero",
            "grad to 0",
            "at scale",
            "keep f32",
        )
        rows = [
            (
                row.path,
                row.class_name,
                row.compute_dtype,
                _error(row.relative_error),
                _fraction(row.nonfinite),
                _fraction(row.overflow),
                _fraction(row.flush_to_zero),
                _fraction(row.gradient_underflow),
                _fraction(row.scaled_gradient_underflow),
                "yes" if row.keep_float32 else "",
            )
            for row in self.rows
        ]
        source = "generated" if self.generated_inputs else "given"
        lines = [
            f"Audit of {self.model_name} under {_describe(self.rules)}, "
            f"{self.samples} {source} samples, against float32",
            "",
            *tables.format_table(header, rows, align="lllrrrrrrl"),
            "",
            f"output relative error: {_error(self.output_relative_error)}",
        ]
        if self.loss_scale is not None:
            lines.append(
                f"loss scale for 'at scale': {self.loss_scale:g} (the "
                "largest power of two up to 2**15 at which no gradient "
                "overflows float16)"
            )
        if self.safe:
            lines.append(f"verdict: {self.policy} is safe for this model")
        else:
            lines.append(f"verdict: {self.policy} is NOT safe as it is:")
            lines += [f"  - {reason}" for reason in self.reasons]
        for row in self.rows:
            if row.keep_float32:
                lines.append(f"keep in float32: {row.path}: {row.reason}")
        if self.keep_float32:
            base = "rules"
            if not len(self.rules):
                base = f'kdp.PrecisionRules("{self.policy}")'
            lines += [
                "apply the recommended rules (`recommended_rules` in Python,"
                " in JSON with --json):",
                f"  rules = {base}.extend(",
                '      kdp.PrecisionRule("float32", paths='
                f"{self.keep_float32!r}))",
                "  model = kdp.apply_rules(model, rules)",
            ]
        return lines

    def __str__(self):
        return "\n".join(self.format())

    def plot(self, path):
        """Writes a PNG of the per-layer numbers (needs matplotlib)."""
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot

        names = [row.path for row in self.rows]
        positions = np.arange(len(names))
        figure, (top, bottom) = pyplot.subplots(
            2, 1, figsize=(max(6, len(names) * 0.6), 6), sharex=True
        )
        errors = [
            row.relative_error if math.isfinite(row.relative_error) else 1e3
            for row in self.rows
        ]
        top.bar(positions, np.maximum(errors, 1e-12), color="tab:blue")
        top.set_yscale("log")
        top.set_ylabel("relative error")
        top.set_title(f"{self.model_name} under {self.policy} vs float32")
        width = 0.2
        columns = (
            ("overflow", "tab:red"),
            ("flush_to_zero", "tab:orange"),
            ("gradient_underflow", "tab:gray"),
            ("scaled_gradient_underflow", "tab:green"),
        )
        for index, (column, color) in enumerate(columns):
            values = [getattr(row, column) or 0.0 for row in self.rows]
            bottom.bar(
                positions + (index - 1.5) * width,
                values,
                width,
                label=column.replace("_", " "),
                color=color,
            )
        bottom.set_ylabel("fraction")
        bottom.legend(fontsize="small")
        bottom.set_xticks(positions, names, rotation=45, ha="right")
        figure.tight_layout()
        figure.savefig(path)
        pyplot.close(figure)


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
    for name, value in (("max_relative_error", max_relative_error),):
        if not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(
                f"`{name}` must be a number above 0. Received: {name}={value!r}"
            )
    if not isinstance(tolerance, (int, float)) or not 0 <= tolerance < 1:
        raise ValueError(
            "`tolerance` must be a fraction in [0, 1). Received: "
            f"tolerance={tolerance!r}"
        )
    generated = x is None
    if generated:
        x = _generated_inputs(model, samples, seed)
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
            f"the output's relative error {_error(output_error)} exceeds "
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
    return AuditTable(
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
    with _recording(layers, records):
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


@contextlib.contextmanager
def _recording(layers, records):
    for (layer, _), (inputs, outputs) in zip(layers, records, strict=True):
        object.__setattr__(
            layer, "call", _recorder(layer.call, inputs, outputs)
        )
    try:
        yield
    finally:
        for layer, _ in layers:
            layer.__dict__.pop("call", None)


def _recorder(call, inputs, outputs):
    def recording_call(*args, **kwargs):
        result = call(*args, **kwargs)
        given = [args] + [
            value for key, value in kwargs.items() if "mask" not in key
        ]
        inputs.extend(_float_values(given))
        outputs.extend(_float_values(result))
        return result

    return recording_call


def _float_values(structure):
    return [_numpy(value) for value in float_tensors(structure)]


def _numpy(value):
    return np.asarray(keras.ops.convert_to_numpy(value)).astype("float64")


def _layer_row(layer, path, dtype, ref, cand_out, gradients, scale, tolerance):
    ref_in, ref_out = ref
    reference = _flat(ref_out)
    candidate = _flat(cand_out)
    row = LayerAudit(
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
                f"{_fraction(row.overflow)} of its inputs or outputs "
                f"overflow {dtype}"
            )
        if row.flush_to_zero > tolerance:
            reasons.append(
                f"{_fraction(row.flush_to_zero)} of its outputs flush to "
                f"zero in {dtype}"
            )
        scaled = row.scaled_gradient_underflow
        if scale is None:
            scaled = row.gradient_underflow if dtype == "bfloat16" else None
        if scaled is not None and scaled > tolerance:
            reasons.append(
                f"{_fraction(scaled)} of its gradients flush to zero "
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


def _cast(values, dtype):
    if dtype == "bfloat16":
        import ml_dtypes

        return values.astype(ml_dtypes.bfloat16).astype("float64")
    with np.errstate(over="ignore"):
        return values.astype(dtype).astype("float64")


def _overflow(values, dtype):
    finite = values[np.isfinite(values)]
    if not finite.size or dtype in ("float32", "float64"):
        return 0.0
    return _mean(~np.isfinite(_cast(finite, dtype)))


def _flush(values, dtype, scale):
    nonzero = values[(values != 0) & np.isfinite(values)]
    if not nonzero.size or dtype in ("float32", "float64"):
        return 0.0
    with np.errstate(over="ignore"):
        return _mean(_cast(nonzero * scale, dtype) == 0)


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


def weight_gradients(model, x, y, loss):
    """Returns `{id(variable): gradient}` for the trainable variables."""
    function = keras.losses.get(loss) if isinstance(loss, str) else loss

    def loss_fn(y_true, y_pred):
        return keras.ops.mean(function(y_true, y_pred))

    variables = model.trainable_variables
    backend = keras.backend.backend()
    x = keras.tree.map_structure(keras.ops.convert_to_tensor, x)
    y = keras.tree.map_structure(keras.ops.convert_to_tensor, y)
    if backend == "jax":
        import jax

        trainable = [v.value for v in variables]
        non_trainable = [v.value for v in model.non_trainable_variables]

        def compute_loss(values):
            y_pred, _ = model.stateless_call(values, non_trainable, x)
            return loss_fn(y, y_pred)

        grads = jax.grad(compute_loss)(trainable)
    elif backend == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            value = loss_fn(y, model(x, training=False))
        grads = tape.gradient(value, variables)
    elif backend == "torch":
        for variable in variables:
            variable.value.grad = None
        value = loss_fn(y, model(x, training=False))
        value.backward()
        grads = [variable.value.grad for variable in variables]
    else:
        raise ValueError(
            f"The audit computes gradients on jax, tensorflow or torch, "
            f"not on the {backend!r} backend"
        )
    return {
        id(variable): (
            np.zeros(tuple(variable.shape))
            if grad is None
            else np.asarray(keras.ops.convert_to_numpy(grad), "float64")
        )
        for variable, grad in zip(variables, grads, strict=True)
    }


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


def first_samples(data, count):
    """Returns the first `count` samples of `data` (any structure)."""
    return keras.tree.map_structure(lambda a: np.asarray(a)[:count], data)


def _length(data):
    return len(np.asarray(keras.tree.flatten(data)[0]))


def _describe(rules):
    if not len(rules):
        return rules.default.name
    return f"{rules.default.name} with {len(rules)} rules"


def _error(value):
    if value is None:
        return "-"
    if not math.isfinite(value):
        return "inf"
    return f"{value:.2e}"


def _fraction(value):
    if value is None:
        return "-"
    if value == 0:
        return "0"
    return f"{100 * value:.2f}%"


def _json_number(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


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
