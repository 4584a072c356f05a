"""The audit's result: one row per layer, and the table of them."""

import dataclasses
import math

import numpy as np

from keras_dtype_policy.policies import precision_rules
from keras_dtype_policy.tools import tables


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
    gradient_underflow: float | None = None
    scaled_gradient_underflow: float | None = None
    keep_float32: bool = False
    reason: str = ""


@dataclasses.dataclass
class AuditTable(tables.RowsReport):
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
        source = "generated" if self.generated_inputs else "given"
        lines = [
            f"Audit of {self.model_name} under {_describe(self.rules)}, "
            f"{self.samples} {source} samples, against float32",
            "",
            *tables.format_table(
                _COLUMNS, [_cells(row) for row in self.rows], align=_ALIGN
            ),
            "",
            "output relative error: "
            + format_error(self.output_relative_error),
        ]
        return lines + self._verdict_lines() + self._recommendation_lines()

    def _verdict_lines(self):
        """The loss scale's line, the verdict and its reasons."""
        lines = []
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
        return lines

    def _recommendation_lines(self):
        """The layers to keep in float32, and the rules that do it."""
        lines = [
            f"keep in float32: {row.path}: {row.reason}"
            for row in self.rows
            if row.keep_float32
        ]
        if not self.keep_float32:
            return lines
        base = "rules"
        if not len(self.rules):
            base = f'kdp.PrecisionRules("{self.policy}")'
        return lines + [
            "apply the recommended rules (`recommended_rules` in Python,"
            " in JSON with --json):",
            f"  rules = {base}.extend(",
            f'      kdp.PrecisionRule("float32", paths={self.keep_float32!r}))',
            "  model = kdp.apply_rules(model, rules)",
        ]

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


# The columns of the text table, and how each is aligned.
_COLUMNS = (
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
_ALIGN = "lllrrrrrrl"


def _cells(row):
    """One `LayerAudit` as the text table's cells."""
    return (
        row.path,
        row.class_name,
        row.compute_dtype,
        format_error(row.relative_error),
        format_fraction(row.nonfinite),
        format_fraction(row.overflow),
        format_fraction(row.flush_to_zero),
        format_fraction(row.gradient_underflow),
        format_fraction(row.scaled_gradient_underflow),
        "yes" if row.keep_float32 else "",
    )


def _describe(rules):
    if not len(rules):
        return rules.default.name
    return f"{rules.default.name} with {len(rules)} rules"


def format_error(value):
    """A relative error for a table: `1.23e-04`, `inf`, or `-`."""
    if value is None:
        return "-"
    if not math.isfinite(value):
        return "inf"
    return f"{value:.2e}"


def format_fraction(value):
    """A fraction for a table, in percent: `1.50%`, `0`, or `-`."""
    if value is None:
        return "-"
    if value == 0:
        return "0"
    return f"{100 * value:.2f}%"


def _json_number(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value
