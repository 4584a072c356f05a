"""The numerics audit, from Python and from the command line.

The model below is built to overflow float16 on purpose: its `boom` layer
reaches about 4e5, beyond float16's largest value (65504) but well within
bfloat16's and float32's range. Every expectation holds on each backend.
"""

import json

import keras
import numpy as np
import pytest

import keras_dtype_policy as kdp
from keras_dtype_policy.policies import rules_application
from keras_dtype_policy.tools import cli

X = np.random.default_rng(1).standard_normal((64, 6)).astype("float32")
Y = np.zeros((64, 3), "float32")


def overflowing_model():
    inputs = keras.Input((6,))
    x = keras.layers.Dense(8, activation="sigmoid", name="hidden")(inputs)
    x = keras.layers.Dense(8, name="boom")(x)
    x = keras.layers.Rescaling(2.0**-10, name="shrink")(x)
    outputs = keras.layers.Dense(3, name="head")(x)
    model = keras.Model(inputs, outputs, name="overflowing")
    boom = model.get_layer("boom")
    boom.kernel.assign(np.full(boom.kernel.shape, 1e5, "float32"))
    return model


def small_model():
    inputs = keras.Input((6,))
    x = keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
    outputs = keras.layers.Dense(3, name="head")(x)
    return keras.Model(inputs, outputs, name="small")


@pytest.fixture(scope="module")
def overflowing_audit():
    return kdp.audit(overflowing_model(), "mixed_float16", x=X)


def test_the_audit_finds_the_overflowing_layer(overflowing_audit):
    table = overflowing_audit
    boom = table.row("boom")
    assert boom.compute_dtype == "float16"
    assert boom.overflow > 0.5
    assert boom.keep_float32 and "overflow float16" in boom.reason
    # `shrink` takes boom's values as inputs, cast to float16 on entry;
    # `head` then sees the damage (non-finite values) without causing it.
    assert table.row("shrink").overflow > 0.5
    assert table.row("head").nonfinite > 0
    assert table.row("head").overflow == 0
    assert not table.row("head").keep_float32
    assert not table.row("hidden").keep_float32
    assert table.row("hidden").relative_error < 1e-2
    assert table.keep_float32 == ["boom", "shrink"]
    assert not table.safe
    assert any("boom" in reason for reason in table.reasons)


def test_the_recommended_rules_make_the_policy_safe(overflowing_audit):
    rules = overflowing_audit.recommended_rules
    # The rule names the layer's path: the layer alone, by its place.
    boom = keras.layers.Dense(1, name="boom")
    assert rules.policy_for(boom, "boom").name == "float32"
    assert rules.policy_for(boom).name == "mixed_float16"
    fixed = kdp.apply_rules(overflowing_model(), rules)
    again = kdp.audit(fixed, rules=rules, x=X)
    assert again.row("boom").compute_dtype == "float32"
    assert again.safe, again.reasons


def test_bfloat16_holds_what_float16_cannot():
    table = kdp.audit(overflowing_model(), "mixed_bfloat16", x=X)
    assert table.row("boom").overflow == 0
    assert table.row("boom").compute_dtype == "bfloat16"
    assert table.loss_scale is None


def test_gradients_flush_without_scaling_but_not_at_the_scale():
    keras.utils.set_random_seed(0)
    model = small_model()
    # Every hidden unit active on most rows: a unit all but dead would give
    # its head weights gradients far below 1e-8, which flush even at the
    # scale (one seed in 60 did so before: 1 of the head's 27 gradients).
    model.get_layer("hidden").bias.assign(np.ones((8,), "float32"))
    head = model.get_layer("head")
    # Outputs near 1e-8 against zero labels: gradients near 1e-8, below
    # float16's smallest subnormal (6e-8), above it once scaled by 2**15.
    head.kernel.assign(keras.ops.convert_to_numpy(head.kernel) * 1e-8)
    table = kdp.audit(model, "mixed_float16", x=X, y=Y, loss="mse")
    assert table.loss_scale == 2.0**15
    row = table.row("head")
    assert row.gradient_underflow > 0.5
    assert row.scaled_gradient_underflow < row.gradient_underflow
    assert row.scaled_gradient_underflow == 0


def test_the_loss_comes_from_the_compiled_model():
    model = small_model()
    model.compile("adam", "mse")
    table = kdp.audit(model, x=X, y=Y)
    assert table.policy == "mixed_float16"
    assert table.row("head").gradient_underflow is not None
    assert table.loss_scale is not None
    assert kdp.audit(small_model(), x=X).row("head").gradient_underflow is (
        None
    )


def test_a_harmless_model_is_safe_and_the_table_reads_well():
    table = kdp.audit(small_model(), "mixed_float16", samples=32)
    assert table.generated_inputs and table.samples == 32
    assert table.safe and table.keep_float32 == []
    assert [row.name for row in table] == ["hidden", "head"]
    text = str(table)
    assert "mixed_float16 is safe" in text
    assert text.splitlines()[2].split()[:3] == ["layer", "class", "compute"]
    data = json.loads(json.dumps(table.to_dict()))
    assert data["safe"] is True
    assert [layer["name"] for layer in data["layers"]] == ["hidden", "head"]


def test_the_audit_refuses_what_it_cannot_read():
    class Plain(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x)

    model = Plain()
    model(X)
    with pytest.raises(ValueError, match="functional or Sequential"):
        kdp.audit(model)
    with pytest.raises(TypeError, match="model=3"):
        kdp.audit(3)
    with pytest.raises(ValueError, match="tolerance=2"):
        kdp.audit(small_model(), tolerance=2)
    with pytest.raises(ValueError, match="policy='int8'"):
        kdp.audit(small_model(), "int8")


@pytest.fixture(scope="module")
def overflowing_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("audit")
    model = overflowing_model()
    model.compile("sgd", "mse")
    path = folder / "overflowing.keras"
    model.save(path)
    data = folder / "data.npz"
    np.savez(data, x=X, y=Y)
    return path, data


def test_the_command_reports_and_exits_3_when_unsafe(overflowing_file, capsys):
    path, data = overflowing_file
    status = cli.main(["audit", str(path), "--data", str(data), "--json"])
    assert status == cli.UNSAFE
    report = json.loads(capsys.readouterr().out)
    assert report["safe"] is False
    assert report["keep_float32"] == ["boom", "shrink"]
    assert report["samples"] == 64
    boom = [layer for layer in report["layers"] if layer["name"] == "boom"]
    assert boom[0]["overflow"] > 0.5
    assert boom[0]["gradient_underflow"] is not None
    rules = kdp.PrecisionRules.from_config(report["recommended_rules"])
    # The rule names the layer's path: the layer alone, by its place.
    boom = keras.layers.Dense(1, name="boom")
    assert rules.policy_for(boom, "boom").name == "float32"
    assert rules.policy_for(boom).name == "mixed_float16"


def test_the_command_prints_a_table_for_a_safe_policy(overflowing_file, capsys):
    path, _ = overflowing_file
    status = cli.main(["audit", str(path), "--policy", "mixed_bfloat16"])
    # bfloat16 holds the large values; the head's error stays small.
    assert status == 0
    out = capsys.readouterr().out
    assert "mixed_bfloat16 is safe" in out


def test_the_command_writes_a_plot(overflowing_file, tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib")
    path, _ = overflowing_file
    plot = tmp_path / "audit.png"
    status = cli.main(
        ["audit", str(path), "--policy", "mixed_bfloat16", "--plot", str(plot)]
    )
    assert status == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--policy", "int8"], "--policy: expected a floating-point"),
        (["--data", "missing.npz"], "--data missing.npz: cannot be read"),
    ],
)
def test_the_command_reports_bad_options_in_one_line(
    overflowing_file, args, fragment, capsys
):
    path, _ = overflowing_file
    status = cli.main(["audit", str(path), *args])
    assert status in (1, 2)
    assert fragment in capsys.readouterr().err


# Nested models and layers: the audit reads the layers inside them.


def leaf_count(model):
    """Counts the leaf layers the way Keras walks a model, apart from the
    audit's own walk."""
    return sum(
        1
        for layer in model._flatten_layers(include_self=False)
        if not isinstance(layer, keras.layers.InputLayer)
        and not list(layer._flatten_layers(include_self=False))
    )


def policies_by_path(copy, model):
    """The policies of a copy's layers, by their paths in `model`."""
    return {
        path: layer.dtype_policy.name
        for layer, path in rules_application.zip_layer_paths(
            copy, model, "the test"
        )
    }


def nested_model():
    """A functional model inside a functional model; `boom` overflows
    float16 inside it, and the outer model has a harmless `boom` too."""
    inner_inputs = keras.Input((6,))
    x = keras.layers.Dense(8, activation="sigmoid", name="hidden")(inner_inputs)
    x = keras.layers.Dense(8, name="boom")(x)
    x = keras.layers.Rescaling(2.0**-10, name="shrink")(x)
    inner = keras.Model(inner_inputs, x, name="inner")
    boom = inner.get_layer("boom")
    boom.kernel.assign(np.full(boom.kernel.shape, 1e5, "float32"))
    inputs = keras.Input((6,))
    x = keras.layers.Dense(8, name="boom")(inner(inputs))
    outputs = keras.layers.Dense(3, name="head")(x)
    return keras.Model(inputs, outputs, name="outer")


def test_a_nested_functional_model_is_audited_layer_by_layer():
    model = nested_model()
    table = kdp.audit(model, "mixed_float16", x=X)
    paths = [row.path for row in table]
    assert paths == [
        "inner/hidden",
        "inner/boom",
        "inner/shrink",
        "boom",
        "head",
    ]
    assert len(table) == leaf_count(model)
    assert table.row("inner/boom").overflow > 0.5
    assert table.keep_float32 == ["inner/boom", "inner/shrink"]
    assert not table.row("boom").keep_float32
    assert table.row("hidden") is table.row("inner/hidden")
    with pytest.raises(KeyError, match="No layer at 'nothing'"):
        table.row("nothing")


def test_the_recommended_rules_change_exactly_the_flagged_paths():
    model = nested_model()
    table = kdp.audit(model, "mixed_float16", x=X)
    before = policies_by_path(kdp.apply_rules(model, table.rules), model)
    fixed = kdp.apply_rules(model, table.recommended_rules)
    after = policies_by_path(fixed, model)
    changed = sorted(path for path in after if after[path] != before[path])
    # The outer `boom` shares the flagged layer's name, not its path.
    assert changed == ["inner/boom", "inner/shrink"]
    assert after["inner/boom"] == "float32" and after["boom"] == (
        "mixed_float16"
    )
    again = kdp.audit(fixed, rules=table.recommended_rules, x=X)
    assert again.safe, again.reasons


@keras.saving.register_keras_serializable(package="test_audit")
class GatedBlock(keras.layers.Layer):
    """A subclassed layer with two sublayers and a weight of its own."""

    def __init__(self, units=8, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.up = keras.layers.Dense(units, activation="relu", name="up")
        self.down = keras.layers.Dense(units, name="down")

    def build(self, input_shape):
        self.gain = self.add_weight(
            shape=(self.units,), initializer="ones", name="gain"
        )
        self.up.build(input_shape)
        self.down.build((*input_shape[:-1], self.units))

    def call(self, x):
        return self.down(self.up(x)) * self.gain

    def get_config(self):
        return {**super().get_config(), "units": self.units}


def test_a_subclassed_layer_is_audited_through_its_sublayers():
    inputs = keras.Input((6,))
    x = GatedBlock(name="block")(inputs)
    outputs = keras.layers.Dense(3, name="head")(x)
    model = keras.Model(inputs, outputs)
    table = kdp.audit(model, "mixed_float16", x=X, y=Y, loss="mse")
    # The block holds `gain` itself: it has a row of its own, next to its
    # leaves, and its gradient column covers `gain` alone.
    assert [row.path for row in table] == [
        "block",
        "block/up",
        "block/down",
        "head",
    ]
    assert len(table) == leaf_count(model) + 1
    assert [row.class_name for row in table][:3] == [
        "GatedBlock",
        "Dense",
        "Dense",
    ]
    assert all(row.compute_dtype == "float16" for row in table)
    assert all(row.gradient_underflow is not None for row in table)
    assert table.row("block/up").relative_error < 1e-2
    assert table.safe, table.reasons


def test_multi_head_attention_is_audited_through_its_projections():
    inputs = keras.Input((4, 8))
    x = keras.layers.MultiHeadAttention(2, 4, name="attention")(inputs, inputs)
    model = keras.Model(inputs, x)
    data = np.random.default_rng(2).standard_normal((16, 4, 8))
    table = kdp.audit(model, rules=kdp.float16_rules(), x=data)
    assert len(table) == leaf_count(model)
    paths = [row.path for row in table]
    assert len(set(paths)) == len(paths)
    for name in ("query", "key", "value", "attention_output"):
        row = table.row(f"attention/{name}")
        assert row.class_name == "EinsumDense"
        assert row.compute_dtype == "float16"
        assert row.relative_error < 1e-2
    (softmax,) = [row for row in table if row.class_name == "Softmax"]
    assert softmax.path.startswith("attention/")
    assert softmax.compute_dtype == "float32"  # float16_rules keep it there
    assert table.safe, table.reasons
