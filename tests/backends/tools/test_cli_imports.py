"""`inspect` and `migrate` with a custom layer: `--import` and the cause.

The layer's module is written to a temporary folder; the model is saved in
a subprocess that imports it, and loaded by the command line, which finds
the module through `--import` (by name on PYTHONPATH or in the current
directory, or as a .py file). The command line runs in a subprocess where
the module is found by name (PYTHONPATH and the current directory are
read as Python starts), and in this process (`call_cli`, which forgets
the imported module and its registered layer afterwards) otherwise.
"""

import json
import os
import subprocess
import sys
import textwrap

import keras
import pytest
from testing import call_cli
from testing import cli_error_line

BACKEND = keras.backend.backend()
# Each test starts a process of its own (about 5 s); finding and importing
# the user's module does not depend on the backend: one backend each in
# the default runs (`rotated`, tests/backends/conftest.py). One xdist
# worker takes the module (`--dist loadgroup`): its module fixture runs once.
pytestmark = [pytest.mark.rotated, pytest.mark.xdist_group("cli_imports")]
LAYERS = """
import keras


@keras.saving.register_keras_serializable(package="my_layers")
class Scale(keras.layers.Layer):
    def __init__(self, factor=2.0, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor

    def call(self, x):
        return x * self.factor

    def get_config(self):
        return {**super().get_config(), "factor": self.factor}
"""
SAVE = """
import keras
import my_layers

inputs = keras.Input((3,))
scaled = my_layers.Scale(name="scale")(inputs)
outputs = keras.layers.Dense(2, name="dense")(scaled)
keras.Model(inputs, outputs, name="custom").save("custom.keras")
"""


def environment(**extra):
    values = dict(os.environ, KERAS_BACKEND=BACKEND, TF_CPP_MIN_LOG_LEVEL="2")
    values.update(extra)
    return values


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A folder with `my_layers.py` and `custom.keras`, which uses it."""
    path = tmp_path_factory.mktemp("custom")
    (path / "my_layers.py").write_text(textwrap.dedent(LAYERS))
    subprocess.run(
        [sys.executable, "-c", SAVE],
        cwd=path,
        env=environment(PYTHONPATH=str(path)),
        check=True,
        capture_output=True,
        timeout=120,
    )
    return path


def run_cli(*args, cwd, **extra):
    return subprocess.run(
        [sys.executable, "-m", "keras_dtype_policy", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=environment(**extra),
        timeout=240,
    )


def test_without_import_the_innermost_cause_and_the_fix_are_shown(folder):
    elsewhere = folder / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    result = call_cli("inspect", folder / "custom.keras", cwd=elsewhere)
    line = cli_error_line(result)
    assert "Could not locate class 'Scale'" in line
    assert "could not be deserialized properly" not in line
    assert "Full object config" not in line
    assert line.endswith(
        "(import the module that defines it: --import my_layers)"
    )


def test_inspect_imports_a_module_from_pythonpath(folder):
    elsewhere = folder / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    result = run_cli(
        "inspect",
        folder / "custom.keras",
        "--json",
        "--import",
        "my_layers",
        cwd=elsewhere,
        PYTHONPATH=str(folder),
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["model"]["class"] == "keras.Functional"
    classes = {row["path"]: row["class"] for row in report["layers"]}
    assert classes["scale"] == "Scale"


def test_inspect_imports_a_module_from_the_current_directory(folder):
    result = run_cli(
        "inspect", "custom.keras", "--import", "my_layers", cwd=folder
    )
    assert result.returncode == 0, result.stderr
    assert "custom (keras.Functional, policy float32)" in result.stdout


def test_migrate_imports_a_python_file(folder, tmp_path):
    result = call_cli(
        "migrate",
        folder / "custom.keras",
        tmp_path / "new.keras",
        "--import",
        folder / "my_layers.py",
        "--import",
        "json",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "loads with the same" in result.stdout
    assert (tmp_path / "new.keras").is_file()


@pytest.mark.parametrize(
    "module, fragment",
    [
        ("no_such_module", "--import no_such_module: no module named"),
        ("broken", "--import broken: importing it failed: ZeroDivisionError"),
        ("missing.py", "--import missing.py: no such file"),
    ],
)
def test_a_module_that_does_not_import_is_one_line(module, fragment, tmp_path):
    (tmp_path / "broken.py").write_text("1 / 0\n")
    result = call_cli(
        "inspect", "model.keras", "--import", module, cwd=tmp_path
    )
    assert fragment in cli_error_line(result)
