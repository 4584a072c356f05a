"""The command line's commands, each run through `cli.main`.

The commands run in this process (`call_cli`: arguments, working directory
and environment as a user gives them, output captured, global state put
back), on the backend of this test run: starting Python and Keras again
for each cost seconds a run. What needs a process of its own runs in one:
the installed console script here and a user error's exit status of
`python -m keras_dtype_policy`; the output to a pipe and a terminal in
test_cli_output.py; `--import` from PYTHONPATH and the current directory
in test_cli_imports.py; a backend that does not import in
test_cli_backends.py. Standard error may hold the backends' own log
lines; only our lines are checked there.
"""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import zipfile

import keras
import numpy as np
import pytest
from testing import CLI_ERROR
from testing import call_cli
from testing import cli_error_line
from testing import run_cli
from testing import to_numpy

import keras_dtype_policy as kdp
from keras_dtype_policy.policies import hardware
from keras_dtype_policy.tools import advice
from keras_dtype_policy.tools import cli

BACKEND = keras.backend.backend()
FIXTURES = (
    pathlib.Path(__file__).resolve().parents[2] / "fixtures" / "tf_keras2"
)
ERROR = CLI_ERROR
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_one_error_line(result, status, fragment):
    """The run failed with `status` and said why in one line, no traceback."""
    assert fragment in cli_error_line(result, status)


def tables(text):
    """Returns each table of a report: its header, rule and rows."""
    lines = text.splitlines()
    found = []
    for index, line in enumerate(lines):
        if line.strip() and set(line.strip()) <= {"-", " "}:
            end = index + 1
            while end < len(lines) and lines[end].strip():
                end += 1
            found.append(lines[index - 1 : end])
    return found


def assert_aligned(table):
    """Every cell lies within its column, as the rule of dashes draws it."""
    rule = table[1]
    spans = [match.span() for match in re.finditer(r"-+", rule)]
    for line in [table[0], *table[2:]]:
        assert len(line) <= spans[-1][1], line
        for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
            assert line[end:start].strip() == "", line


def cells(table):
    """Returns the rows of a table as lists of stripped cells."""
    spans = [match.span() for match in re.finditer(r"-+", table[1])]
    return [
        [line[start:end].strip() for start, end in spans]
        for line in [table[0], *table[2:]]
    ]


def test_help_lists_the_commands():
    result = call_cli("--help")
    assert result.returncode == 0
    for command in ("demo", "inspect", "migrate", "doctor"):
        assert command in result.stdout
    assert "KERAS_BACKEND" in result.stdout


@pytest.mark.parametrize(
    "command, fragment",
    [
        ("demo", "--epochs"),
        ("inspect", "--json"),
        ("migrate", "--force"),
        ("doctor", "--json"),
    ],
)
def test_every_command_has_help(command, fragment, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0
    assert fragment in capsys.readouterr().out


# A process of its own (about 5 s), the same on every backend: `rotated`.
@pytest.mark.rotated
def test_the_console_script_runs():
    script = pathlib.Path(sys.executable).parent / "keras-dtype-policy"
    if not script.exists():
        script = shutil.which("keras-dtype-policy")
        if script is None:
            pytest.skip("the console script is not installed here")
    result = subprocess.run(
        [str(script), "--version"],
        capture_output=True,
        text=True,
        env=dict(os.environ, KERAS_BACKEND=BACKEND),
        timeout=120,
    )
    assert result.returncode == 0
    assert result.stdout.strip() == f"keras-dtype-policy {kdp.__version__}"


def test_doctor_names_backend_devices_and_policy():
    result = call_cli("doctor")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"backend: {BACKEND} ")
    table = tables(result.stdout)[0]
    assert_aligned(table)
    rows = cells(table)
    assert rows[0] == ["device", "kind", "model", "float16", "bfloat16"]
    assert rows[1][0].startswith("cpu:0") and rows[1][1] == "cpu"
    expected, _ = hardware.recommend_policy(hardware.list_devices())
    assert f"recommended policy: {expected}" in result.stdout


def test_doctor_json_matches_the_rules():
    result = call_cli("doctor", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["backend"] == BACKEND
    assert report["keras_version"] == keras.__version__
    devices = hardware.list_devices()
    assert [d["name"] for d in report["devices"]] == [d.name for d in devices]
    for row, device in zip(report["devices"], devices, strict=True):
        assert row["float16"]["speed"] == hardware.float16_verdict(device).speed
        assert (
            row["bfloat16"]["speed"] == hardware.bfloat16_verdict(device).speed
        )
    assert report["recommended_policy"] == hardware.recommend_policy(devices)[0]
    if all(d.kind == "cpu" for d in devices):
        assert report["devices"][0]["float16"]["speed"] == "slow"


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"KDP_TORCH_COMPILE": "1"}, "kernels torch.compile builds with"),
        (
            {"CXX": "no-such-compiler", "KDP_TORCH_COMPILE": "1"},
            "no C++ compiler found",
        ),
        ({"KDP_TORCH_COMPILE": "0"}, "run eager torch operations"),
    ],
)
def test_doctor_says_how_quantized_state_runs_on_torch(
    env, expected, monkeypatch
):
    # On torch on a CPU a note says whether the 8-bit and 4-bit state
    # kernels compile; JAX and TensorFlow have no such note (XLA compiles
    # their step).
    # Each case sets the switch: tox's torch environment turns it off.
    compiles = env == {"KDP_TORCH_COMPILE": "1"}
    if BACKEND == "torch":
        from keras_dtype_policy.low_precision import torch_kernels

        # As in a fresh process: no compile has failed yet in this one.
        monkeypatch.setattr(torch_kernels, "_failed", [])
        if compiles and torch_kernels.c_compiler() is None:
            pytest.skip("no C++ compiler here: the first case cannot arise")
    if not compiles and BACKEND != "torch":
        pytest.skip("the note is torch's: one run shows it absent here")
    result = call_cli("doctor", "--json", env=env)
    assert result.returncode == 0, result.stderr
    notes = json.loads(result.stdout)["notes"]
    ours = [note for note in notes if "optimizer state" in note]
    if BACKEND == "torch":
        assert len(ours) == 1 and expected in ours[0], notes
    else:
        assert ours == []


def test_inspect_a_tf_keras_h5_file():
    result = call_cli(
        "inspect", FIXTURES / "dense_mixed_float16_adam_dynamic.h5"
    )
    assert result.returncode == 0, result.stderr
    assert "written by tf.keras 2.21.0" in result.stdout
    layers, settings = tables(result.stdout)
    assert_aligned(layers)
    assert_aligned(settings)
    rows = {row[0]: row for row in cells(layers)[1:]}
    assert rows["dense"] == [
        "dense",
        "Dense",
        "mixed_float16",
        "float16",
        "float32",
        "144",
        "576 B",
    ]
    assert rows["batch_normalization"][2:5] == [
        "mixed_float16",
        "float16",
        "float32",
    ]
    assert rows["activation"][2] == "float32"
    assert rows["total"][5] == "276"
    assert "optimizer: keras_dtype_policy.LossScaleOptimizer" in result.stdout
    assert "loss scaling: dynamic" in result.stdout
    values = {row[1]: row[2] for row in cells(settings)[1:]}
    assert values["initial_scale"] == "32768 (2^15)"
    assert values["loss_scale"] == "32768 (2^15)"
    assert values["skipped_steps"] == "0"
    assert "3 iterations" in result.stdout
    assert "hold no loss-scale state" in result.stdout


def test_inspect_json_of_a_tf_keras_keras_file():
    path = FIXTURES / "dense_mixed_float16_adam_fixed.keras"
    result = call_cli("inspect", path, "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["format"] == "keras"
    assert report["backend"] == BACKEND
    model = keras.saving.load_model(path)
    assert report["totals"]["params"] == model.count_params()
    # Every variable is float32 here: 4 bytes each.
    assert report["totals"]["bytes"] == 4 * model.count_params()
    assert [row["path"] for row in report["layers"]] == [
        "input_1",
        "dense",
        "batch_normalization",
        "dense_1",
        "activation",
    ]
    dense = report["layers"][1]
    assert dense["policy_class"] == "keras.DTypePolicy"
    assert (dense["compute_dtype"], dense["variable_dtype"]) == (
        "float16",
        "float32",
    )
    optimizer = report["optimizer"]
    assert optimizer["class"] == "keras_dtype_policy.LossScaleOptimizer"
    assert optimizer["iterations"] == 3
    assert optimizer["loss_scaling"]["settings"] == {
        "dynamic": False,
        "initial_scale": 1024.0,
    }
    assert optimizer["loss_scaling"]["state"] == {
        "loss_scale": 1024.0,
        "skipped_steps": 0,
    }


def test_inspect_shows_nested_layers_and_live_state(tmp_path, capsys):
    keras.utils.set_random_seed(0)
    inner = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(1, name="dense")],
        name="inner",
    )
    inputs = keras.Input((3,))
    first = keras.layers.Dense(
        4, dtype=kdp.DTypePolicy("mixed_float16"), name="first"
    )
    model = keras.Model(inputs, inner(first(inputs)), name="outer")
    model.compile(kdp.LossScaleOptimizer(keras.optimizers.SGD(1e-3)), "mse")
    x = np.full((4, 3), 0.01, "float32")
    y = np.zeros((4, 1), "float32")
    for batch in (x, x * 1e8, x):  # 1e6 overflows float16 in `first`
        model.train_on_batch(batch, y)
    model.save(tmp_path / "outer.keras")
    assert cli.main(["inspect", str(tmp_path / "outer.keras"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    paths = {row["path"]: row for row in report["layers"]}
    assert paths["inner/dense"]["params"] == 5
    assert paths["inner/dense"]["policy"] == "float32"
    assert paths["inner"]["params"] == 0  # its weights are its layer's
    assert paths["first"]["policy_class"] == "keras_dtype_policy.DTypePolicy"
    assert paths["first"]["bytes"] == 16 * 4
    state = report["optimizer"]["loss_scaling"]["state"]
    optimizer = model.optimizer
    assert state == {
        "loss_scale": optimizer.loss_scale,
        "dynamic_counter": optimizer.dynamic_counter,
        "skipped_steps": optimizer.skipped_steps,
    }
    assert state["skipped_steps"] >= 1  # the 1e8 batch at least
    assert state["loss_scale"] < 2.0**15
    assert report["written_by"].startswith("Keras 3.")
    assert report["model"]["class"] == "keras.Functional"


def test_migrate_a_tf_keras_file(tmp_path):
    old = FIXTURES / "dense_mixed_float16_adam_dynamic.h5"
    result = call_cli("migrate", old, "migrated.keras", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert (
        'dense: Policy(mixed_float16) -> keras_dtype_policy.DTypePolicy "'
        'mixed_float16"' in out
    )
    assert (
        "optimizer: LossScaleOptimizerV3 -> "
        "keras_dtype_policy.LossScaleOptimizer" in out
    )
    assert "loss scales dropped:\n  none" in out
    assert "checked: migrated.keras loads with the same 8 weights" in out
    new = tmp_path / "migrated.keras"
    assert zipfile.is_zipfile(new)
    kdp.uninstall()
    try:
        migrated = keras.saving.load_model(new)
    finally:
        kdp.install()
    original = keras.saving.load_model(old)
    x = np.load(FIXTURES / "dense_mixed_float16_adam_dynamic.predictions.npz")[
        "x"
    ]
    np.testing.assert_array_equal(
        to_numpy(migrated.predict(x, verbose=0)),
        to_numpy(original.predict(x, verbose=0)),
    )


def demo_report(result):
    """Checks a demo run's tables; returns its layers and comparison."""
    assert result.returncode == 0, result.stderr
    found = tables(result.stdout)
    for table in found:
        assert_aligned(table)
    layers, comparison = cells(found[0]), cells(found[-1])
    return layers, comparison


def test_demo_runs_the_default_policy_against_float32(tmp_path):
    result = call_cli("demo", "--epochs", "2", "--samples", "64", cwd=tmp_path)
    layers, comparison = demo_report(result)
    choice = advice.demo_choice(hardware.list_devices())
    policy = choice.policy
    assert f"[1/2] policy {policy}" in result.stdout
    assert "[2/2] policy float32 (for comparison" in result.stdout
    assert "64 training and 359 test images" in result.stdout
    # Not at a terminal: one plain line per epoch, no progress bar.
    assert "\r" not in result.stdout and "\x1b[" not in result.stdout
    assert "\u2501" not in result.stdout
    assert result.stdout.count("Epoch 2/2") == 2
    # The demo states doctor's advice, whichever policy it shows.
    flat = " ".join(result.stdout.split())
    assert (
        "Recommended on this machine (as 'keras-dtype-policy doctor' says): "
        f"{choice.recommended}: {choice.reason}." in flat
    )
    # Where bfloat16 is fast, the advice for memory-bound training too.
    low_precision = advice.low_precision_advice(hardware.list_devices())
    assert ("Memory-bound training:" in flat) == (low_precision is not None)
    if low_precision is not None:
        assert f"Memory-bound training: {low_precision}." in flat
    if not choice.follows_advice:
        assert choice.recommended == "float32"
        assert "[2/2] policy float32 (for comparison; recommended here)" in (
            result.stdout
        )
        assert (
            f"policy: {policy}, shown next to float32; on this machine "
            f"'keras-dtype-policy doctor' recommends float32" in flat
        )
    rows = {row[0]: row for row in layers[1:]}
    compute = kdp.DTypePolicy(policy).compute_dtype
    assert rows["conv_1"][1:5] == ["Conv2D", policy, compute, "float32"]
    assert rows["probs"][2:5] == ["float32", "float32", "float32"]
    assert comparison[0] == ["", "float32", policy, f"{policy} / float32"]
    labels = [row[0] for row in comparison[1:]]
    assert labels[0] == "step time (median)"
    assert labels[1] == "activations per batch of 32"
    assert labels[2].startswith("peak memory (")
    assert labels[3] == "test accuracy"
    # 16-bit activations, but for the float32 softmax: about half.
    assert 0.45 <= float(comparison[2][3].rstrip("x")) <= 0.55
    assert re.fullmatch(r"\d+\.\d%", comparison[4][1])
    if policy == "mixed_bfloat16":
        assert "Loss scale: none." in result.stdout


def test_demo_float16_shows_loss_scale_and_writes_a_plot(tmp_path):
    result = call_cli(
        "demo",
        "--policy",
        "mixed_float16",
        "--epochs",
        "1",
        "--samples",
        "64",
        "--plot",
        "demo.png",
        cwd=tmp_path,
    )
    demo_report(result)
    assert (
        "Loss scale (dynamic, keras_dtype_policy.LossScaleOptimizer), "
        "2 steps:" in result.stdout
    )
    assert "starts at 32768, ends at 32768" in result.stdout
    assert (tmp_path / "demo.png").read_bytes().startswith(PNG_SIGNATURE)
    assert "plot written to demo.png" in result.stdout


def test_demo_without_scikit_learn_names_the_extra(monkeypatch):
    # None in sys.modules: `import sklearn` raises ImportError, as where
    # scikit-learn is not installed.
    monkeypatch.setitem(sys.modules, "sklearn", None)
    result = call_cli("demo")
    assert_one_error_line(result, 1, "pip install 'keras_dtype_policy[demo]'")


@pytest.mark.parametrize(
    "args, status, fragment",
    [
        (("inspect", "missing.keras"), 1, "missing.keras: no such file"),
        (("inspect", "notes.keras"), 1, "broken zip archive"),
        (
            ("inspect", FIXTURES / "dense_mixed_float16.weights.h5"),
            1,
            "holds weights only",
        ),
        (
            ("inspect", FIXTURES / "dense_mixed_float16_legacy_weights.h5"),
            1,
            "holds weights only",
        ),
        (("inspect", "data.h5"), 1, "data.h5: not a Keras file"),
        (
            ("migrate", FIXTURES / "dense_mixed_bfloat16.h5", "no/x.keras"),
            1,
            "no/x.keras: no such directory: no",
        ),
        (
            (
                "migrate",
                FIXTURES / "dense_mixed_bfloat16.h5",
                "folder.keras",
                "--force",
            ),
            1,
            "folder.keras: is a directory",
        ),
        (
            ("migrate", FIXTURES / "dense_mixed_bfloat16.h5", "notes.keras"),
            1,
            "exists already (use --force",
        ),
        (("demo", "--policy", "nope"), 2, "--policy: Cannot"),
        (("demo", "--epochs", "0"), 2, "argument --epochs: must be a whole"),
        (("demo", "--epochs", "abc"), 2, "not 'abc'"),
        (("demo", "--plot", "demo.jpg"), 2, "must end in .png"),
        (("frobnicate",), 2, "invalid choice: 'frobnicate'"),
    ],
    ids=[
        "missing-file",
        "not-a-model",
        "weights-only",
        "legacy-weights-only",
        "hdf5-data",
        "migrate-into-a-missing-directory",
        "migrate-onto-a-directory",
        "migrate-over-a-file",
        "unknown-policy",
        "zero-epochs",
        "epochs-not-a-number",
        "plot-not-png",
        "unknown-command",
    ],
)
def test_user_errors_are_one_line(args, status, fragment, tmp_path):
    import h5py

    (tmp_path / "notes.keras").write_text("not a model")
    (tmp_path / "folder.keras").mkdir()
    with h5py.File(tmp_path / "data.h5", "w") as f:
        f["x"] = np.arange(3)
    result = call_cli(*args, cwd=tmp_path)
    assert_one_error_line(result, status, fragment)
    assert result.stdout == ""


@pytest.mark.rotated
def test_a_user_error_is_the_exit_status_of_the_process(tmp_path):
    # The one user error run as a user runs it: `python -m
    # keras_dtype_policy` after Keras imported (test_cli_backends.py has
    # the errors before it does).
    result = run_cli("inspect", "missing.keras", cwd=tmp_path)
    assert_one_error_line(result, 1, "missing.keras: no such file")
    assert result.stdout == ""


@pytest.mark.parametrize(
    "args, status, fragment",
    [
        ([], 2, "the following arguments are required: COMMAND"),
        (["demo", "--policy", "int32"], 2, "floating-point policy"),
        (["demo", "--policy", "float16_with_float32_vars"], 2, "removed"),
        (["demo", "--samples", "-3"], 2, "not '-3'"),
        (["demo", "--plot", "no/such/dir/a.png"], 1, "no such directory"),
        (["inspect", "."], 1, "is a directory"),
        (["inspect", "model.txt"], 1, "ending in .keras or .h5"),
        (["migrate", "model.txt", "new.keras"], 1, "ending in .keras or .h5"),
        (["migrate", "in.h5", "new.h5"], 1, "must end in .keras"),
    ],
)
def test_more_user_errors_in_process(
    args, status, fragment, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model.txt").write_text("hello")
    assert cli.main(args) == status
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(ERROR)
    assert captured.err.count("\n") == 1
    assert fragment in captured.err
