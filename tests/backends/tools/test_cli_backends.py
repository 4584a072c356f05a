"""The command line and the package where Keras cannot import its backend.

A backend that is not installed is stood in for by a package of its name
whose import fails as a missing one does; `KERAS_HOME` points at an empty
folder, so that no `keras.json` chooses the backend.
"""

import os
import pathlib
import subprocess
import sys

import keras
import pytest

import keras_dtype_policy as kdp

ERROR = "keras-dtype-policy: error: "
COMMANDS = [
    ("doctor",),
    ("demo",),
    ("inspect", "model.keras"),
    ("migrate", "old.h5", "new.keras"),
]


def broken_environment(tmp_path, backend):
    """Returns an environment where importing `backend` fails."""
    fake = tmp_path / "fake" / backend
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        f"raise ModuleNotFoundError({f'No module named {backend!r}'!r}, "
        f"name={backend!r})\n"
    )
    (tmp_path / "keras_home").mkdir()
    environment = dict(os.environ, KERAS_HOME=str(tmp_path / "keras_home"))
    environment["PYTHONPATH"] = os.pathsep.join(
        [str(tmp_path / "fake"), os.environ.get("PYTHONPATH", "")]
    )
    environment.pop("KERAS_BACKEND", None)
    return environment


def run(args, environment, cwd):
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        env=environment,
        cwd=cwd,
        timeout=120,
    )


def our_lines(stderr):
    return [
        line for line in stderr.splitlines() if "keras-dtype-policy" in line
    ]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_a_missing_default_backend_is_one_line(command, tmp_path):
    # KERAS_BACKEND unset: Keras picks tensorflow, which "is missing".
    environment = broken_environment(tmp_path, "tensorflow")
    result = run(["-m", "keras_dtype_policy", *command], environment, tmp_path)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""
    [line] = our_lines(result.stderr)
    assert line.startswith(ERROR)
    assert "Keras could not import its backend tensorflow" in line
    assert "KERAS_BACKEND is not set" in line
    assert "No module named 'tensorflow'" in line
    assert "export KERAS_BACKEND=" in line


@pytest.mark.parametrize("backend", ["jax", "torch", "tensorflow"])
def test_a_missing_chosen_backend_is_one_line(backend, tmp_path):
    environment = broken_environment(tmp_path, backend)
    environment["KERAS_BACKEND"] = backend
    result = run(["-m", "keras_dtype_policy", "doctor"], environment, tmp_path)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    [line] = our_lines(result.stderr)
    assert f"its backend {backend} (set by KERAS_BACKEND)" in line
    assert "export KERAS_BACKEND=" in line
    assert f"KERAS_BACKEND={backend}" not in line


def test_an_unknown_backend_is_one_line(tmp_path):
    environment = dict(os.environ, KERAS_BACKEND="foo")
    result = run(["-m", "keras_dtype_policy", "doctor"], environment, tmp_path)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    [line] = our_lines(result.stderr)
    assert line == (
        f"{ERROR}'foo' (set by KERAS_BACKEND) is not a Keras backend: "
        "choose jax, tensorflow or torch: export KERAS_BACKEND="
        + line.split("export KERAS_BACKEND=")[1]
    )


@pytest.mark.parametrize("option", ["--help", "--version"])
def test_help_and_version_need_no_backend(option, tmp_path):
    environment = broken_environment(tmp_path, "tensorflow")
    result = run(["-m", "keras_dtype_policy", option], environment, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    if option == "--version":
        assert result.stdout.strip() == f"keras-dtype-policy {kdp.__version__}"
    else:
        assert "KERAS_BACKEND" in result.stdout


def test_the_console_script_reports_a_broken_backend(tmp_path):
    script = pathlib.Path(sys.executable).parent / "keras-dtype-policy"
    if not script.exists():
        pytest.skip("the console script is not installed next to python")
    environment = broken_environment(tmp_path, "tensorflow")
    version = subprocess.run(
        [str(script), "--version"],
        capture_output=True,
        text=True,
        env=environment,
        timeout=120,
    )
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"keras-dtype-policy {kdp.__version__}"
    doctor = subprocess.run(
        [str(script), "doctor"],
        capture_output=True,
        text=True,
        env=environment,
        timeout=120,
    )
    assert doctor.returncode == 1
    assert "Traceback" not in doctor.stderr
    [line] = our_lines(doctor.stderr)
    assert "Keras could not import its backend tensorflow" in line


def test_importing_the_package_raises_a_clear_import_error(tmp_path):
    environment = broken_environment(tmp_path, "tensorflow")
    code = (
        "try:\n"
        "    import keras_dtype_policy\n"
        "except ImportError as error:\n"
        "    print(type(error).__name__)\n"
        "    print(error)\n"
        "    print(type(error.__cause__).__name__)\n"
        "    print(error.__cause__.name)\n"
    )
    result = run(["-c", code], environment, tmp_path)
    assert result.returncode == 0, result.stderr
    kind, message, cause, name = result.stdout.strip().splitlines()
    assert kind == "ImportError"
    assert message.startswith("Keras could not import its backend tensorflow")
    assert "export KERAS_BACKEND=" in message
    assert (cause, name) == ("ModuleNotFoundError", "tensorflow")


def test_the_package_imports_as_before_where_the_backend_works():
    assert kdp._backend_error is None
    assert keras.backend.backend() in ("jax", "tensorflow", "torch")
    assert kdp.is_installed()
