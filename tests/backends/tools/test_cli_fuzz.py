"""Hostile and mistaken input through the command line, in-process.

Mutated `.keras`, `.h5`, `.npz` and JSON configs, and misused command
lines, go through `cli.main`: every run ends with a documented status,
one `keras-dtype-policy: error: ...` line when it fails, no traceback, in
bounded time, and writes nothing but the file `migrate` was asked for.
`KDP_FUZZ_EXAMPLES` sets the examples per property (default 12).
"""

import contextlib
import io
import json
import math
import os
import pathlib
import shutil
import signal
import tempfile
import time
import zipfile

import numpy as np
import pytest
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from testing import CLI_ERROR

from keras_dtype_policy.tf_keras_compat import migrate
from keras_dtype_policy.tools import cli

FIXTURES = (
    pathlib.Path(__file__).resolve().parents[2] / "fixtures" / "tf_keras2"
)
KERAS_FILE = FIXTURES / "dense_mixed_float16_adam_dynamic.keras"
H5_FILE = FIXTURES / "dense_mixed_float16_adam_dynamic.h5"
STATUSES = {0, 1, 2, 3}  # docs/command-line.md
SECONDS = 60  # the most one run may take
EXAMPLES = int(os.environ.get("KDP_FUZZ_EXAMPLES", "12"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    derandomize="KDP_FUZZ_EXAMPLES" not in os.environ,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
    ],
)


class _Hang(BaseException):
    """A run past `SECONDS` (BaseException: no command may swallow it)."""


def _alarm(signum, frame):
    raise _Hang()


def run(*argv):
    """Runs the command line; returns `(status, stdout, stderr)` after
    checking a failure said why in one line, without a traceback."""
    out, err = io.StringIO(), io.StringIO()
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(SECONDS)
    start = time.monotonic()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = cli.main([str(arg) for arg in argv])
            except SystemExit as exit:  # --help, --version
                status = exit.code
    except _Hang:
        pytest.fail(f"{argv} ran past {SECONDS} s")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert time.monotonic() - start < SECONDS
    stderr = err.getvalue()
    assert status in STATUSES, (argv, status, stderr)
    assert "Traceback" not in stderr, stderr
    ours = [
        line for line in stderr.splitlines() if line.startswith("keras-dtype")
    ]
    if status in (1, 2):
        assert len(ours) == 1 and ours[0].startswith(CLI_ERROR), stderr
    else:
        assert not any(line.startswith(CLI_ERROR) for line in ours), stderr
    return status, out.getvalue(), stderr


@contextlib.contextmanager
def folder():
    """A fresh directory, removed afterwards (hypothesis runs many examples
    in one test, so `tmp_path` is not enough)."""
    path = pathlib.Path(tempfile.mkdtemp(prefix="kdp-fuzz-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def listing(path):
    return sorted(p.name for p in path.iterdir())


def keras_members(path=KERAS_FILE):
    with zipfile.ZipFile(path) as archive:
        return {name: archive.read(name) for name in archive.namelist()}


def write_keras(path, members):
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)


def assert_migrate_clean(old, directory):
    """`migrate` either writes a verified NEW or leaves nothing behind."""
    before = listing(directory)
    new = directory / "new.keras"
    status, _, _ = run("migrate", old, new)
    if status == 0:
        assert listing(directory) == sorted([*before, "new.keras"])
    else:
        assert listing(directory) == before
    return status


# --- Mutated bytes: truncation and bit flips of .keras and .h5 files. ---

flips = st.lists(
    st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 7)),
    min_size=1,
    max_size=8,
)


@FUZZ
@given(
    source=st.sampled_from([KERAS_FILE, H5_FILE]),
    truncate=st.none() | st.floats(0, 1),
    flipped=flips,
)
def test_mutated_model_files(source, truncate, flipped):
    data = bytearray(source.read_bytes())
    for where, bit in flipped:
        data[int(where * len(data))] ^= 1 << bit
    if truncate is not None:
        data = data[: int(truncate * len(data))]
    with folder() as directory:
        path = directory / f"model{source.suffix}"
        path.write_bytes(bytes(data))
        run("inspect", path)
        run("plan", path, "--batch-size", "8")
        assert_migrate_clean(path, directory)


# --- Mutated JSON: wrong types and hostile values in a .keras config. ---

hostile_values = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from([-1, 0, 2**31, 2**63, -(2**62)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e400, -1.0, "banana", "mixed_float16", "", "os.system"]),
    st.text(max_size=8),
    st.just([]),
    st.just({}),
    st.integers(1, 400).map(lambda depth: _nested(depth)),
)


def _nested(depth):
    value = {"class_name": "Dense", "config": {}}
    for _ in range(depth):
        value = {"class_name": "Dense", "config": {"dtype": value}}
    return value


def _paths(node, path=()):
    """Every (path) to a value in a JSON document."""
    yield path
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, (*path, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _paths(value, (*path, index))


CONFIG = json.loads(keras_members()["config.json"])
CONFIG_PATHS = [path for path in _paths(CONFIG) if path]


def _replaced(config, path, value):
    config = json.loads(json.dumps(config))
    node = config
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return config


@FUZZ
@given(
    edits=st.lists(
        st.tuples(st.sampled_from(CONFIG_PATHS), hostile_values),
        min_size=1,
        max_size=3,
    )
)
def test_mutated_keras_configs(edits):
    config = CONFIG
    for path, value in edits:
        try:
            config = _replaced(config, path, value)
        except (KeyError, IndexError, TypeError):
            continue  # an earlier edit replaced what held this path
    members = keras_members()
    members["config.json"] = json.dumps(config).encode()
    with folder() as directory:
        path = directory / "model.keras"
        write_keras(path, members)
        run("inspect", path)
        run("plan", path, "--batch-size", "8")
        assert_migrate_clean(path, directory)


# --- Mutated .npz: declared shapes, dtypes and bytes. ---

dtypes = st.sampled_from(
    ["<f4", "<f8", "<i4", "|b1", "<U3", "|S2", "|O", "<c8", "<f2", "V8"]
)
shapes = st.one_of(
    st.lists(st.integers(0, 8), max_size=3).map(tuple),
    st.sampled_from([(10**12,), (2**31, 2), (-1, 8), (3, 2**40)]),
)


def _npz_bytes(name, descr, shape, body, fortran_order=False):
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header,
        {"descr": descr, "fortran_order": fortran_order, "shape": shape},
    )
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr(f"{name}.npy", header.getvalue() + body)
    return buffer.getvalue()


@FUZZ
@given(
    name=st.sampled_from(["x", "y", "input_1", "a/../b"]),
    descr=dtypes,
    shape=shapes,
    fortran_order=st.booleans(),
    body=st.binary(max_size=512),
    flipped=st.none() | flips,
)
def test_mutated_npz_files(name, descr, shape, fortran_order, body, flipped):
    data = bytearray(_npz_bytes(name, descr, shape, body, fortran_order))
    for where, bit in flipped or ():
        data[int(where * len(data))] ^= 1 << bit
    with folder() as directory:
        path = directory / "data.npz"
        path.write_bytes(bytes(data))
        # MODEL is missing: the data is read first, then the run stops at
        # the model, so that only the reading of --data is timed here.
        status, _, stderr = run(
            "audit", directory / "none.keras", "--data", path
        )
        assert status == 1
        assert listing(directory) == ["data.npz"]


# --- Command-line misuse. ---

tokens = st.sampled_from(
    [
        "inspect",
        "migrate",
        "audit",
        "find-nonfinite",
        "plan",
        "--batch-size",
        "--budget",
        "--json",
        "--force",
        "--policy",
        "banana",
        "int8",
        "--data",
        "--samples",
        "0",
        "-3",
        "nan",
        "--learning-rate",
        "--loss-scale",
        "--import",
        "no_such_module_kdp",
        "--plot",
        "a.jpg",
        "--",
        "-",
        "",
        "missing.keras",
        "MODEL_DIR",
        "FIFO",
        "TEXT",
        "\x00",
        "--help",
        "--version",
    ]
)


@FUZZ
@given(argv=st.lists(tokens, max_size=6))
def test_command_line_misuse(argv):
    with folder() as directory:
        (directory / "model_dir").mkdir()
        os.mkfifo(directory / "fifo.keras")
        (directory / "text.h5").write_text("not a model")
        places = {
            "MODEL_DIR": directory / "model_dir",
            "FIFO": directory / "fifo.keras",
            "TEXT": directory / "text.h5",
        }
        before = listing(directory)
        cwd = os.getcwd()
        os.chdir(directory)
        try:
            run(*[places.get(token, token) for token in argv])
        finally:
            os.chdir(cwd)
        assert listing(directory) == before


# --- The cases the issue reported, each once. ---


def test_a_damaged_zip_is_one_line(tmp_path):
    data = bytearray(KERAS_FILE.read_bytes())
    data[data.find(b'"class_name"') + 2] ^= 0x20
    path = tmp_path / "crc.keras"
    path.write_bytes(bytes(data))
    for argv in (("inspect", path), ("migrate", path, tmp_path / "n.keras")):
        _, _, stderr = run(*argv)
        assert "broken zip archive" in stderr
    assert listing(tmp_path) == ["crc.keras"]


@pytest.mark.parametrize("loss_scale", [-1, math.nan, 1e400])
def test_migrate_reports_translation_errors_as_inspect_does(
    loss_scale, tmp_path
):
    members = keras_members(FIXTURES / "dense_mixed_float16.keras")
    config = json.loads(members["config.json"])
    policy = config["config"]["layers"][1]["config"]["dtype"]
    policy["config"]["loss_scale"] = loss_scale
    members["config.json"] = json.dumps(config).encode()
    path = tmp_path / "old.keras"
    write_keras(path, members)
    inspected = run("inspect", path)
    migrated = run("migrate", path, tmp_path / "new.keras")
    assert inspected[0] == migrated[0] == 1
    assert "loss_scale" in migrated[2]
    assert listing(tmp_path) == ["old.keras"]


@pytest.mark.parametrize("argument", ["inspect", "migrate", "--data"])
def test_a_fifo_is_refused_up_front(argument, tmp_path):
    fifo = tmp_path / "model.keras"
    os.mkfifo(fifo)
    argv = {
        "inspect": ("inspect", fifo),
        "migrate": ("migrate", fifo, tmp_path / "new.keras"),
        "--data": ("audit", KERAS_FILE, "--data", fifo),
    }[argument]
    status, _, stderr = run(*argv)
    assert status == 1
    assert "which is a FIFO" in stderr


@pytest.mark.parametrize(
    "arrays, fragment",
    [
        ({"x": np.array([["a", "b"]])}, "array 'x' holds <U1 values"),
        ({"x": np.zeros((0, 8), "float32")}, "holds 0 samples"),
        ({"x": np.float32(1)}, "is a scalar"),
        ({"x": np.array([None], object)}, "holds object values"),
    ],
    ids=["strings", "empty", "scalar", "objects"],
)
def test_npz_arrays_that_are_no_samples(arrays, fragment, tmp_path):
    path = tmp_path / "data.npz"
    np.savez(path, **arrays)
    status, _, stderr = run("audit", KERAS_FILE, "--data", path)
    assert status == 1
    assert fragment in stderr


def test_npz_declared_shape_is_bounded_before_reading(tmp_path):
    path = tmp_path / "data.npz"
    path.write_bytes(_npz_bytes("x", "<f4", (10**12,), b""))
    status, _, stderr = run("audit", KERAS_FILE, "--data", path)
    assert status == 1
    assert "array 'x': declares 1000000000000 elements" in stderr


def test_npz_reads_only_the_samples_asked_for(tmp_path):
    from keras_dtype_policy.tools.cli_data import read_npz

    x = np.arange(40, dtype="float32").reshape(10, 4)
    np.savez(tmp_path / "data.npz", x=x, f=np.asfortranarray(x))
    arrays = read_npz(tmp_path / "data.npz", 3)
    np.testing.assert_array_equal(arrays["x"], x[:3])
    np.testing.assert_array_equal(arrays["f"], x[:3])


def test_a_failed_verification_leaves_the_destination_as_it_was(
    tmp_path, monkeypatch
):
    def fail(model, path, name=None):
        raise migrate.ModelFileError(f"{name}: differs")

    monkeypatch.setattr(migrate, "verify", fail)
    new = tmp_path / "new.keras"
    assert run("migrate", H5_FILE, new)[0] == 1
    assert listing(tmp_path) == []
    new.write_bytes(b"the old file")
    assert run("migrate", H5_FILE, new, "--force")[0] == 1
    assert listing(tmp_path) == ["new.keras"]
    assert new.read_bytes() == b"the old file"


def test_verification_compares_nan_with_nan(tmp_path):
    import keras

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.layers[0].kernel.assign(np.full((2, 1), np.nan, "float32"))
    path = tmp_path / "nan.keras"
    model.save(path)
    assert migrate.verify(model, path) == (2, 0)


def test_migrate_bounds_what_it_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(migrate, "OUTPUT_SLACK", 0)
    monkeypatch.setattr(migrate, "OUTPUT_GROWTH", 0)
    status, _, stderr = run("migrate", H5_FILE, tmp_path / "new.keras")
    assert status == 1
    assert "bytes of weights" in stderr
    assert listing(tmp_path) == []
