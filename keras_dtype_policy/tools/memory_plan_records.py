"""The records of a memory plan: one row a configuration, and the plan
that prints them as a table."""

import dataclasses

from keras_dtype_policy.tools import tables


@dataclasses.dataclass(frozen=True)
class PlanRow:
    """One configuration's predicted peak, in bytes.

    Attributes:
        configuration: Its name, a key of `CONFIGURATIONS`.
        policy: The dtype policy it trains under.
        weights: Every weight, in the policy's variable dtype.
        gradients: One gradient a trainable weight, in its dtype.
        optimizer_state: Adam's moments (codes and scales where
            quantized) and Kahan's compensation buffers.
        activations: What the step keeps for the backward pass.
        working_set: The step's casts, copies, compiled steps and
            temporaries (measured: a cost a parameter, which may be
            negative, a cost a trainable variable, and on JAX and
            TensorFlow a cost an element of an embedding table).
        baseline: The process before the model (measured).
        peak: The sum of the above.
        fits: Whether `peak` is within the budget; None without one.
        bytes_per_parameter: `peak` less `baseline` and `activations`,
            over the parameters: what decides the largest model.
        note: What the prediction assumed, or "".
    """

    configuration: str
    policy: str
    weights: int
    gradients: int
    optimizer_state: int
    activations: int
    working_set: int
    baseline: int
    peak: int
    fits: bool | None
    bytes_per_parameter: float
    note: str = ""


@dataclasses.dataclass(frozen=True)
class MemoryPlan(tables.RowsReport):
    """The predicted peaks of a model's training step, one row a
    configuration: those that fit first, the cheapest a parameter first.

    Attributes:
        model_name: The model's name.
        parameters: Its parameters (every weight).
        trainable_parameters: Those the optimizer trains.
        batch_size: The batch the activations are for.
        budget: The memory budget in bytes, or None.
        backend: The Keras backend the working set and baseline are for.
        calibration: Where those two were measured.
        rows: One `PlanRow` per configuration.
    """

    model_name: str
    parameters: int
    trainable_parameters: int
    batch_size: int
    budget: int | None
    backend: str
    calibration: str
    rows: tuple

    def row(self, configuration):
        """Returns the `PlanRow` of `configuration`."""
        for row in self.rows:
            if row.configuration == configuration:
                return row
        raise KeyError(f"No configuration {configuration!r} in the plan")

    def to_dict(self):
        """Returns the plan as a JSON-serializable dict."""
        plan = dataclasses.asdict(self)
        plan["rows"] = [dataclasses.asdict(row) for row in self.rows]
        return plan

    def format(self):
        """Returns the plan as lines of text."""
        size = tables.format_bytes
        budget = "no budget" if self.budget is None else size(self.budget)
        rows = [
            (
                row.configuration,
                size(row.weights),
                size(row.gradients),
                size(row.optimizer_state),
                size(row.activations),
                size(row.working_set),
                size(row.baseline),
                size(row.peak),
                {True: "yes", False: "no", None: "-"}[row.fits],
            )
            for row in self.rows
        ]
        lines = [
            f"Memory plan of {self.model_name}: {self.parameters:,} "
            f"parameters, batch {self.batch_size}, Adam, {self.backend}, "
            f"budget {budget}",
            "",
            *tables.format_table(
                (
                    "configuration",
                    "weights",
                    "gradients",
                    "state",
                    "activations",
                    "working set",
                    "baseline",
                    "peak",
                    "fits",
                ),
                rows,
                align="lrrrrrrrl",
            ),
            "",
            *tables.wrap(
                "working set and baseline: measured on " + self.calibration
            ),
        ]
        for note in dict.fromkeys(row.note for row in self.rows if row.note):
            lines += tables.wrap(note)
        return lines
