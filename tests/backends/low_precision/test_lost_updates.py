"""`kdp.lost_updates`: the updates that low-precision weights round away.

The model is built so that every answer is known: a bias-free Dense(1)
whose weights are all 1.0, inputs of ones and a target of 0 under the mean
absolute error, so each weight's gradient is exactly 1. In bfloat16 the
weights just below 1.0 are 2**-8 apart: an update of 1e-4 rounds away, one
of 1e-1 does not. The expectations hold on every backend.
"""

import json

import keras
import numpy as np
import pytest

import keras_dtype_policy as kdp
from keras_dtype_policy.tools import cli
from keras_dtype_policy.tools import lost_updates as lost_updates_module

X = np.ones((8, 4), "float32")
Y = np.zeros((8, 1), "float32")


def ones_model(policy=None, small=None):
    """Dense(1) from 4 inputs, kernel of ones; `small` adds a second
    Dense(1) on a separate input whose kernel holds that value."""
    inputs = keras.Input((4,))
    dense = keras.layers.Dense(
        1, use_bias=False, kernel_initializer="ones", name="ones", dtype=policy
    )
    outputs = dense(inputs)
    if small is not None:
        other = keras.layers.Dense(
            1,
            use_bias=False,
            kernel_initializer=keras.initializers.Constant(small),
            name="small",
            dtype=policy,
        )
        outputs = outputs + other(inputs)
    model = keras.Model(inputs, outputs, name="ones")
    model.compile("adam", "mean_absolute_error")
    return model


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_updates_below_half_an_ulp_of_one_are_all_lost(optimizer):
    result = kdp.lost_updates(
        ones_model(), X, Y, learning_rate=1e-4, optimizer=optimizer
    )
    row = result.row("ones/kernel")
    assert row.updates == 4
    assert row.lost == 1.0
    assert result.lost == 1.0
    assert row.median_update == pytest.approx(1e-4, rel=1e-3)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_large_updates_are_kept(optimizer):
    result = kdp.lost_updates(
        ones_model(), X, Y, learning_rate=1e-1, optimizer=optimizer
    )
    assert result.row("ones/kernel").lost == 0.0
    assert result.lost == 0.0


def test_float16_keeps_what_bfloat16_loses():
    # float16 has 11 significant bits: below 1.0 its weights are 2**-11
    # apart, so 1e-3 survives there (above half that gap) but not in
    # bfloat16; 1e-4 is lost in both.
    model = ones_model()
    assert kdp.lost_updates(model, X, Y, learning_rate=1e-3).lost == 1.0
    kept = kdp.lost_updates(model, X, Y, learning_rate=1e-3, dtype="float16")
    assert kept.lost == 0.0
    lost = kdp.lost_updates(model, X, Y, learning_rate=1e-4, dtype="float16")
    assert lost.lost == 1.0


def test_small_weights_keep_the_updates_large_ones_lose():
    # Each gradient is 1 (the sum of both outputs is positive): a step of
    # 1e-4 is lost on weights of 1.0, kept on weights of 1e-3 (whose
    # bfloat16 gap is about 7.6e-6).
    result = kdp.lost_updates(
        ones_model(small=1e-3), X, Y, learning_rate=1e-4, optimizer="sgd"
    )
    assert result.row("ones/kernel").lost == 1.0
    assert result.row("small/kernel").lost == 0.0
    assert result.lost == 0.5
    assert [row.path for row in result] == ["ones/kernel", "small/kernel"]


def test_a_bfloat16_model_is_judged_from_float32_gradients():
    # The model's own policy does not change the answer: the gradients
    # come from a float32 copy, the weights are rounded to the dtype.
    result = kdp.lost_updates(
        ones_model(policy="bfloat16"), X, Y, learning_rate=1e-4
    )
    assert result.lost == 1.0


def test_the_report_reads_and_serializes():
    result = kdp.lost_updates(ones_model(), X, Y, learning_rate=1e-4)
    text = str(result)
    assert "ones/kernel" in text and "100.0%" in text
    assert "kdp.LowPrecisionOptimizer" in text
    data = json.loads(json.dumps(result.to_dict()))
    assert data["lost"] == 1.0 and data["weights"][0]["shape"] == [4, 1]
    kept = kdp.lost_updates(ones_model(), X, Y, learning_rate=1e-1)
    assert "LowPrecisionOptimizer" not in str(kept)


def test_lost_mask_rounds_as_bfloat16_does():
    weight = np.array([1.0, 1.0, 1.0, 0.0, 256.0])
    update = np.array([-1e-3, -3e-3, 0.0, 1e-30, 1.0])
    mask = lost_updates_module.lost_mask(weight, update, "bfloat16")
    # 1 - 1e-3 rounds to 1.0; 1 - 3e-3 to 1 - 2**-8; a zero update is not
    # counted; 1e-30 is representable next to 0; 257 rounds to 256.
    assert mask.tolist() == [True, False, False, False, True]


@pytest.mark.parametrize(
    "arguments, error, fragment",
    [
        ({"learning_rate": 0}, ValueError, "learning_rate=0"),
        ({"learning_rate": "1e-3"}, ValueError, "of type str"),
        ({"optimizer": "rmsprop"}, ValueError, "optimizer='rmsprop'"),
        ({"dtype": "float32"}, ValueError, "dtype='float32'"),
        ({"batch_size": 0}, ValueError, "batch_size=0"),
    ],
)
def test_bad_arguments_are_named(arguments, error, fragment):
    with pytest.raises(error, match=fragment):
        kdp.lost_updates(ones_model(), X, Y, **arguments)


def test_no_model_labels_or_loss_is_an_error():
    with pytest.raises(TypeError, match="of type str"):
        kdp.lost_updates("model.keras", X, Y)
    with pytest.raises(ValueError, match="y=None"):
        kdp.lost_updates(ones_model(), X, None)
    uncompiled = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match="loss=None"):
        kdp.lost_updates(uncompiled, X, Y)
    result = kdp.lost_updates(uncompiled, X, Y, loss="mean_squared_error")
    assert len(result) == 2


# The command line: `keras-dtype-policy audit --learning-rate LR`.


@pytest.fixture(scope="module")
def ones_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lost_updates")
    path = folder / "ones.keras"
    ones_model().save(path)
    data = folder / "data.npz"
    np.savez(data, x=X, y=Y)
    return str(path), str(data)


@pytest.mark.parametrize("rate, lost", [("1e-4", 1.0), ("1e-1", 0.0)])
def test_the_audit_command_counts_lost_updates(ones_file, rate, lost, capsys):
    path, data = ones_file
    args = ["audit", path, "--policy", "mixed_bfloat16", "--data", data]
    status = cli.main([*args, "--learning-rate", rate, "--json"])
    assert status == 0
    report = json.loads(capsys.readouterr().out)
    assert report["safe"] is True
    assert report["lost_updates"]["dtype"] == "bfloat16"
    assert report["lost_updates"]["lost"] == lost
    status = cli.main([*args, "--learning-rate", rate])
    out = capsys.readouterr().out
    assert f"lost in all: {100 * lost:.1f}%" in out
    assert "mixed_bfloat16 is safe" in out


@pytest.mark.parametrize(
    "args, fragment",
    [
        (
            ["--policy", "float32", "--learning-rate", "1e-4"],
            "--learning-rate: float32 computes in float32",
        ),
        (["--learning-rate", "1e-4"], "--learning-rate needs labels"),
    ],
)
def test_the_audit_command_reports_bad_learning_rate_use(
    ones_file, args, fragment, capsys
):
    path, data = ones_file
    if "float32" in args:
        args = [*args, "--data", data]
    status = cli.main(["audit", path, *args])
    assert status == 2
    assert fragment in capsys.readouterr().err


def test_the_audit_command_rejects_a_learning_rate_of_zero(ones_file, capsys):
    status = cli.main(["audit", ones_file[0], "--learning-rate", "0"])
    assert status == 2
    assert "must be a number above 0, not '0'" in capsys.readouterr().err
