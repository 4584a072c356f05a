"""`kdp.plan` and the `plan` command: a model's predicted training peak.

Bytes of weights, gradients and optimizer state are checked against the
arithmetic done by hand from the parameter count; files and configs are
planned without allocating their weights. How close the predicted peak
comes to a measured one is benchmark 13's question
(`tests/benchmarks/memory_plan_check.py`), not a test's.
"""

import json
import resource

import keras
import pytest
from testing import call_cli
from testing import cli_error_line

import keras_dtype_policy as kdp
from keras_dtype_policy.tools import memory_plan
from keras_dtype_policy.tools import memory_plan_calibration as calibration
from keras_dtype_policy.tools import memory_plan_models

WIDTH, DEPTH = 64, 3
PARAMETERS = DEPTH * (WIDTH * WIDTH + WIDTH)
# configuration: (weight bytes, state bytes a parameter), by hand: Adam's
# two moments in the weight's dtype, or one byte (half a byte) a value and
# a float32 scale a block of 256 (128); Kahan adds a bfloat16 buffer.
BY_HAND = {
    "float32": (4, 8),
    "mixed_bfloat16": (4, 8),
    "kahan_bfloat16": (2, 2 + 4),
    "stochastic_bfloat16": (2, 4),
    "stochastic_bfloat16_8bit": (2, 2 * (1 + 4 / 256)),
    "kahan_bfloat16_8bit": (2, 2 + 2 * (1 + 4 / 256)),
    "mixed_bfloat16_8bit": (4, 2 * (1 + 4 / 256)),
    "stochastic_bfloat16_4bit": (2, 2 * (0.5 + 4 / 128)),
}


def dense_stack(width=WIDTH, depth=DEPTH):
    return keras.Sequential(
        [keras.Input((width,))]
        + [keras.layers.Dense(width) for _ in range(depth)],
        name="stack",
    )


@pytest.fixture
def model():
    return dense_stack()


def test_every_configuration_is_planned(model):
    result = kdp.plan(model, batch_size=8)
    assert {row.configuration for row in result} == set(
        memory_plan.CONFIGURATIONS
    )
    assert result.parameters == result.trainable_parameters == PARAMETERS


@pytest.mark.parametrize("name", sorted(BY_HAND))
def test_bytes_of_a_dense_stack_are_the_hand_computed_ones(model, name):
    weight, state = BY_HAND[name]
    row = kdp.plan(model, batch_size=8, configurations=[name]).rows[0]
    assert row.weights == PARAMETERS * weight
    assert row.gradients == PARAMETERS * weight
    assert row.optimizer_state == round(PARAMETERS * state)


def test_the_parts_add_up_to_the_peak(model):
    for row in kdp.plan(model, batch_size=8):
        parts = (
            row.weights,
            row.gradients,
            row.optimizer_state,
            row.activations,
            row.working_set,
            row.baseline,
        )
        assert row.peak == sum(parts)


def test_working_set_and_baseline_are_the_measured_figures(model):
    backend = keras.backend.backend()
    for row in kdp.plan(model, batch_size=8):
        per_parameter, per_variable, baseline = calibration.CPU_STEP_COSTS[
            backend
        ][row.configuration]
        variables = 2 * DEPTH  # a kernel and a bias a layer
        assert row.working_set == round(
            PARAMETERS * per_parameter + variables * per_variable * 2**20
        )
        assert row.baseline == baseline * 2**20


def test_an_embedding_table_adds_its_measured_cost_on_jax_and_tensorflow():
    # Expectations per backend: on JAX and TensorFlow each table adds
    # its measured bytes an element and MiB a table to the working set
    # (the step's temporaries of the whole table); on PyTorch nothing.
    backend = keras.backend.backend()
    table = 1000 * 16

    def embedding_model(trainable):
        inputs = keras.Input((4,), dtype="int32")
        embedding = keras.layers.Embedding(1000, 16, trainable=trainable)
        outputs = keras.layers.Dense(16)(embedding(inputs))
        return keras.Model(inputs, outputs)

    with_table, frozen = embedding_model(True), embedding_model(False)
    for row in kdp.plan(with_table, batch_size=8):
        per_element, per_table = calibration.CPU_EMBEDDING_COSTS.get(
            backend, {}
        ).get(row.configuration, (0.0, 0.0))
        if backend != "torch":
            assert per_element > 0, row.configuration
        without = kdp.plan(
            frozen, batch_size=8, configurations=[row.configuration]
        ).rows[0]
        per_parameter = calibration.CPU_STEP_COSTS[backend][row.configuration][
            0
        ]
        # The frozen table is no trainable variable: neither its cost a
        # parameter and a variable nor the table's own.
        added = row.working_set - without.working_set
        per_variable = calibration.CPU_STEP_COSTS[backend][row.configuration][1]
        assert added == pytest.approx(
            table * (per_parameter + per_element)
            + per_variable * 2**20
            + per_table * 2**20,
            abs=2,
        ), row.configuration


def test_activations_grow_with_the_batch_in_the_compute_dtype(model):
    def activations(name, batch):
        result = kdp.plan(model, batch_size=batch, configurations=[name])
        return result.rows[0].activations

    # Three Dense outputs of WIDTH values a sample.
    assert activations("float32", 1) == DEPTH * WIDTH * 4
    assert activations("float32", 16) == 16 * DEPTH * WIDTH * 4
    assert activations("mixed_bfloat16", 16) == 16 * DEPTH * WIDTH * 2


def test_nested_and_multi_output_models_are_planned():
    inputs = keras.Input((8,))
    inner = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    hidden = inner(inputs)
    model = keras.Model(
        inputs, [keras.layers.Dense(2)(hidden), keras.layers.Dense(3)(hidden)]
    )
    row = kdp.plan(model, batch_size=2, configurations="float32").rows[0]
    assert row.activations == 2 * (4 + 2 + 3) * 4


def test_rows_that_fit_come_first_cheapest_a_parameter_first(model):
    result = kdp.plan(dense_stack(1024, 4), batch_size=8)
    costs = [row.bytes_per_parameter for row in result]
    assert costs == sorted(costs)
    middle = sorted(row.peak for row in result)[len(result) // 2]
    budgeted = kdp.plan(dense_stack(1024, 4), batch_size=8, budget=middle)
    fits = [row.fits for row in budgeted]
    assert fits == sorted(fits, reverse=True)
    assert all(row.peak <= middle for row in budgeted if row.fits)
    assert all(row.peak > middle for row in budgeted if not row.fits)
    assert any(fits) and not all(fits)
    assert all(row.fits is None for row in result)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("16GiB", 16 * 2**30),
        ("1.5 GB", 1_500_000_000),
        ("500mib", 500 * 2**20),
        ("1024", 1024),
        (2048, 2048),
    ],
)
def test_budgets_as_sizes(text, expected):
    assert memory_plan.parse_budget(text) == expected


@pytest.mark.parametrize(
    "arguments, fragment",
    [
        ({"batch_size": 0}, "batch_size=0"),
        ({"batch_size": 2.5}, "batch_size=2.5"),
        ({"batch_size": True}, "batch_size=True"),
        ({"budget": "lots"}, "budget='lots'"),
        ({"budget": -1}, "budget=-1"),
        ({"budget": float("nan")}, "budget=nan"),
        ({"configurations": ["float64"]}, "configurations=['float64']"),
        ({"configurations": []}, "configurations=[]"),
        ({"optimizer": "sgd"}, "optimizer='sgd'"),
    ],
)
def test_bad_arguments_are_named_with_the_value(model, arguments, fragment):
    arguments = {"batch_size": 8, **arguments}
    with pytest.raises(ValueError, match="Received") as raised:
        kdp.plan(model, **arguments)
    assert fragment in str(raised.value)


def test_a_model_of_another_kind_is_a_type_error():
    with pytest.raises(TypeError, match="Received: model=42"):
        kdp.plan(42, batch_size=8)


def test_a_keras_file_plans_as_its_model(model, tmp_path):
    path = tmp_path / "stack.keras"
    model.save(path)
    from_file = kdp.plan(str(path), batch_size=8)
    assert from_file.rows == kdp.plan(model, batch_size=8).rows


def test_a_config_plans_without_allocating_its_weights(tmp_path):
    # 4 Dense layers 16384 wide: 1.07e9 parameters, 4.3 GB in float32.
    width = 16384
    config = keras.saving.serialize_keras_object(dense_stack(2, 4))
    config = json.loads(
        json.dumps(config)
        .replace('"units": 2', f'"units": {width}')
        .replace("[null, 2]", f"[null, {width}]")
    )
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = kdp.plan(str(path), batch_size=8)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert result.parameters == 4 * (width * width + width)
    assert grown * 1024 < 2**30  # ru_maxrss: KiB on Linux
    # Keras must not allocate them when a later stateless scope closes.
    with keras.StatelessScope():
        pass
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 2**20


def test_a_config_dict_plans_as_the_model(model):
    config = keras.saving.serialize_keras_object(model)
    assert (
        kdp.plan(config, batch_size=8).rows
        == kdp.plan(model, batch_size=8).rows
    )


def test_a_file_that_is_no_model_names_it(tmp_path):
    path = tmp_path / "notes.keras"
    path.write_text("not a zip")
    with pytest.raises(ValueError, match="notes.keras"):
        kdp.plan(str(path), batch_size=8)
    with pytest.raises(ValueError, match="config names no class"):
        kdp.plan({"layers": []}, batch_size=8)


def test_a_config_never_runs_code():
    lambda_config = {
        "class_name": "Sequential",
        "config": {
            "layers": [
                {
                    "class_name": "InputLayer",
                    "config": {"batch_shape": [None, 2]},
                },
                {
                    "class_name": "Lambda",
                    "config": {
                        "function": {
                            "class_name": "__lambda__",
                            "config": {"code": "bad", "defaults": None},
                        }
                    },
                },
            ]
        },
    }
    with pytest.raises(ValueError, match="does not build"):
        memory_plan_models.resolve_model(lambda_config)


def test_the_table_names_every_configuration(model):
    text = str(kdp.plan(model, batch_size=8, budget="1GiB"))
    assert "peak" in text and "fits" in text and "1.0 GiB" in text
    for name in memory_plan.CONFIGURATIONS:
        assert name in text


# --- The command line. ---


def test_the_command_prints_the_plan(model, tmp_path):
    path = tmp_path / "stack.keras"
    model.save(path)
    result = call_cli(
        "plan",
        path,
        "--batch-size",
        "8",
        "--budget",
        "16GiB",
        "--configurations",
        "float32,kahan_bfloat16",
    )
    assert result.returncode == 0, result.stderr
    assert "kahan_bfloat16" in result.stdout
    assert "mixed_bfloat16" not in result.stdout
    assert "16.0 GiB" in result.stdout


def test_the_command_reads_a_config_and_prints_json(model, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(keras.saving.serialize_keras_object(model)))
    result = call_cli("plan", "--config", path, "--batch-size", "4", "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["parameters"] == PARAMETERS
    assert len(plan["rows"]) == len(memory_plan.CONFIGURATIONS)


@pytest.mark.parametrize(
    "arguments, status, fragment",
    [
        (("--budget", "lots"), 2, "budget='lots'"),
        (("--configurations", "float64"), 2, "float64"),
        (("--batch-size", "0"), 2, "'0'"),
    ],
)
def test_the_commands_errors_are_one_line(
    model, tmp_path, arguments, status, fragment
):
    path = tmp_path / "stack.keras"
    model.save(path)
    argv = ["plan", path, "--batch-size", "8", *arguments]
    line = cli_error_line(call_cli(*argv), status=status)
    assert fragment in line


def test_a_damaged_file_is_one_line(tmp_path):
    path = tmp_path / "broken.keras"
    path.write_bytes(b"PK\x03\x04 truncated")
    line = cli_error_line(call_cli("plan", path, "--batch-size", "8"))
    assert "broken.keras" in line
    config = tmp_path / "config.json"
    config.write_text("{not json")
    line = cli_error_line(
        call_cli("plan", "--config", config, "--batch-size", "8")
    )
    assert "config.json" in line
