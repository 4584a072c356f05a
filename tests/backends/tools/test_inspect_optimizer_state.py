"""`inspect` shows a `LowPrecisionOptimizer`'s update and state dtype.

Real files saved on the backend under test: a `.keras` file gives them from
its config (the loaded optimizer); a `.weights.h5` file, which has no
config, from its stored variables (int8 codes of 256 columns: 8-bit state,
of 64: 4-bit). Both give the same bytes of state a parameter. A weights
file is read from its metadata only; odd entries give a report or the old
one-line error, never a traceback.
"""

import json

import h5py
import keras
import numpy as np
import pytest

import keras_dtype_policy as kdp
from keras_dtype_policy.tools import cli
from keras_dtype_policy.tools import state_memory


def saved_files(folder, policy, optimizer=None):
    """Trains a small model under `policy`; saves .keras and .weights.h5."""
    keras.utils.set_random_seed(0)
    with kdp.policy_scope(policy):
        model = keras.Sequential(
            [
                keras.Input((256,)),
                keras.layers.Dense(256, activation="tanh"),
                keras.layers.Dense(1),
            ]
        )
    model.compile(optimizer or keras.optimizers.Adam(1e-3), "mse")
    x = np.random.RandomState(0).randn(32, 256).astype("float32")
    model.fit(x, x[:, :1], batch_size=16, verbose=0)
    model.save(folder / "model.keras")
    model.save_weights(folder / "model.weights.h5")
    return model


def inspected(path, capsys):
    assert cli.main(["inspect", str(path), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def inspected_text(path, capsys):
    assert cli.main(["inspect", str(path)]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize(
    "policy, update, state_dtype",
    [
        ("stochastic_bfloat16_8bit", "stochastic_rounding", "8bit"),
        ("kahan_bfloat16_4bit", "kahan", "4bit"),
        ("kahan_bfloat16", "kahan", None),
    ],
)
def test_state_dtype_of_saved_files(
    policy, update, state_dtype, tmp_path, capsys
):
    saved_files(tmp_path, policy)
    keras_file = inspected(tmp_path / "model.keras", capsys)
    state = keras_file["optimizer"]["low_precision"]
    slots = 2 if state_dtype else 0  # the kernel's moments
    assert state["update"] == update
    assert state["state_dtype"] == state_dtype
    assert state["quantized_slots"] == slots
    # The kernel dominates: near the arithmetic of a large layer.
    expected = (
        state_memory.adam_bytes_per_parameter("bfloat16", update, state_dtype)
        - 2.0
    )
    assert state["state_bytes_per_parameter"] == pytest.approx(
        expected, abs=0.06
    )
    text = inspected_text(tmp_path / "model.keras", capsys)
    assert f"low-precision updates: {update}, state " in text
    assert "bytes a parameter" in text

    weights_file = inspected(tmp_path / "model.weights.h5", capsys)
    assert weights_file["format"] == "weights"
    stored = weights_file["optimizer"]
    assert stored["state_dtype"] == (state_dtype or "bfloat16")
    assert stored["quantized_slots"] == slots
    assert stored["update"] == ("kahan" if update == "kahan" else None)
    assert stored["state_bytes_per_parameter"] == pytest.approx(
        state["state_bytes_per_parameter"]
    )
    assert weights_file["totals"]["params"] == keras_file["totals"]["params"]
    text = inspected_text(tmp_path / "model.weights.h5", capsys)
    assert f"state dtype: {stored['state_dtype']}" in text


def test_float16_form_is_seen_through_the_loss_scale_optimizer(
    tmp_path, capsys
):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", kdp.SlowFloat16Warning)
        saved_files(tmp_path, "stochastic_float16_8bit")
        report = inspected(tmp_path / "model.keras", capsys)
    optimizer = report["optimizer"]
    assert optimizer["loss_scaling"] is not None
    assert optimizer["low_precision"]["state_dtype"] == "8bit"
    stored = inspected(tmp_path / "model.weights.h5", capsys)
    assert stored["optimizer"]["state_dtype"] == "8bit"
    assert stored["optimizer"]["state_bytes_per_parameter"] == pytest.approx(
        optimizer["low_precision"]["state_bytes_per_parameter"]
    )


def test_a_plain_optimizer_has_no_low_precision_entry(tmp_path, capsys):
    saved_files(tmp_path, "mixed_bfloat16")
    report = inspected(tmp_path / "model.keras", capsys)
    assert report["optimizer"]["low_precision"] is None
    stored = inspected(tmp_path / "model.weights.h5", capsys)
    assert stored["optimizer"]["state_dtype"] == "float32"
    assert stored["optimizer"]["quantized_slots"] == 0


def test_odd_weights_files(tmp_path, capsys):
    path = tmp_path / "odd.weights.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("layers/dense/vars/0", data=np.zeros((4, 3)))
        vars_ = f.create_group("optimizer/vars")
        vars_.create_dataset("0", data=np.zeros((2, 256), "int8"))
        vars_.create_dataset("1", data=np.array([b"text"]))
        vars_["2"] = h5py.ExternalLink("/etc/passwd", "/x")
        vars_["3"] = h5py.SoftLink("/nowhere")
        f["optimizer/inner_optimizer"] = h5py.SoftLink("/optimizer")
    report = inspected(path, capsys)
    assert report["totals"]["params"] == 12
    assert report["optimizer"]["state_dtype"] == "8bit"
    # Only the model's weights, no optimizer group: the old error.
    bare = tmp_path / "bare.weights.h5"
    with h5py.File(bare, "w") as f:
        f.create_dataset("layers/dense/vars/0", data=np.zeros((4, 3)))
        f.create_group("vars")
    assert cli.main(["inspect", str(bare)]) == 1
    assert "holds weights only" in capsys.readouterr().err
    empty = tmp_path / "empty.weights.h5"
    with h5py.File(empty, "w") as f:
        f.create_group("layers")
        f.create_group("optimizer")
    report = inspected(empty, capsys)
    assert report["optimizer"]["state_dtype"] is None
    assert report["optimizer"]["state_bytes_per_parameter"] is None
