"""Fuzz of the Python readers: damaged files give documented errors only.

Valid small `.keras`, `.h5` and JSON models are mutated (truncation, bit
flips, wrong types in JSON and HDF5 attributes, deep nesting, huge
declared sizes) and read with `kdp.load_model`, `keras.saving.load_model`
(the package installed) and `kdp.model_from_json`. Each read must return a
model or raise a documented error (`ModelFileError`, `ValueError`,
`TypeError`), within the deadline, writing no file. `keras.saving.load_model`
may also raise what Keras alone raises for the same file.

`KDP_FUZZ_EXAMPLES` sets the examples per test (default 12): the CI run
stays near half a minute per backend; a larger count is the long run.
"""

import contextlib
import datetime
import json
import os
import pathlib
import tempfile
import warnings

import h5py
import keras
import numpy as np
import pytest
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from testing import rewrite_keras_archive

import keras_dtype_policy as kdp
from keras_dtype_policy.tf_keras_compat import file_limits
from keras_dtype_policy.tf_keras_compat.keras_files import ModelFileError

EXAMPLES = int(os.environ.get("KDP_FUZZ_EXAMPLES", "12"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=datetime.timedelta(seconds=30),
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
    ],
    derandomize=EXAMPLES <= 12,
)
DOCUMENTED = (ModelFileError, ValueError, TypeError)

hostile_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from([-1, 0, 2**31, 2**63, -(2**62), 1e400, float("nan")]),
    st.integers(-(2**40), 2**40),
    st.text(max_size=8),
    st.sampled_from(["os", "builtins.eval", "os.system", "subprocess"]),
)
hostile_values = st.one_of(
    hostile_scalars,
    st.lists(hostile_scalars, max_size=3),
    st.dictionaries(st.text(max_size=6), hostile_scalars, max_size=3),
    st.integers(110, 300).map(lambda depth: _nested(depth)),
    st.just({"class_name": "Functional"}),
)


def _nested(depth):
    value = 0.0
    for _ in range(depth):
        value = {"class_name": "L2", "config": {"l2": value}}
    return value


@pytest.fixture(scope="module")
def valid_files(tmp_path_factory):
    """A compiled two-layer model saved as `.keras` and `.h5`, and JSON."""
    folder = tmp_path_factory.mktemp("valid")
    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(2, name="first"),
            keras.layers.Dense(1, name="second"),
        ]
    )
    model.compile("adam", "mse")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save(folder / "model.keras")
        model.save(folder / "model.h5")
    return ValidFiles(
        {
            ".keras": (folder / "model.keras").read_bytes(),
            ".h5": (folder / "model.h5").read_bytes(),
            "json": model.to_json(),
        }
    )


class ValidFiles(dict):
    """The valid files, shown briefly in hypothesis' reports."""

    def __repr__(self):
        return "<valid .keras, .h5 and JSON models>"


@contextlib.contextmanager
def damaged_file(data, suffix):
    """Writes `data` to a fresh folder; checks that reading adds nothing."""
    with tempfile.TemporaryDirectory(prefix="kdp-fuzz-") as folder:
        path = pathlib.Path(folder) / f"model{suffix}"
        path.write_bytes(data)
        before = sorted(os.listdir(folder))
        cwd_before = sorted(os.listdir(os.getcwd()))
        yield path
        assert sorted(os.listdir(folder)) == before, "a reader wrote a file"
        assert sorted(os.listdir(os.getcwd())) == cwd_before


def read_with_every_reader(path):
    """Reads `path` with `kdp.load_model` and `keras.saving.load_model`."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            model = kdp.load_model(path)
        except DOCUMENTED as error:
            assert str(error), repr(error)
        else:
            assert isinstance(model, keras.Model)
        try:
            keras.saving.load_model(path)
        except DOCUMENTED:
            pass
        except Exception as error:  # noqa: BLE001 - compared with Keras'
            assert type(error) is type(keras_alone_error(path)), repr(error)


def keras_alone_error(path):
    """The exception Keras alone raises for `path` (None if it loads)."""
    kdp.uninstall()
    try:
        keras.saving.load_model(path)
    except Exception as error:  # noqa: BLE001
        return error
    finally:
        kdp.install()
    return None


def mutate_json(config, index, value):
    """Returns `config` with its `index`-th node (in walk order) replaced."""
    config = json.loads(json.dumps(config))
    slots = []
    pending = [config]
    while pending:
        node = pending.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in items:
            slots.append((node, key))
            if isinstance(child, (dict, list)):
                pending.append(child)
    node, key = slots[index % len(slots)]
    node[key] = value
    return config


byte_damage = st.one_of(
    st.tuples(st.just("truncate"), st.floats(0.0, 0.99)),
    st.tuples(
        st.just("flip"),
        st.lists(
            st.tuples(st.floats(0.0, 1.0), st.integers(0, 7)),
            min_size=1,
            max_size=8,
        ),
    ),
)


def damage_bytes(data, damage):
    kind, detail = damage
    if kind == "truncate":
        return data[: int(len(data) * detail)]
    data = bytearray(data)
    for where, bit in detail:
        data[min(int(where * len(data)), len(data) - 1)] ^= 1 << bit
    return bytes(data)


@FUZZ
@given(suffix=st.sampled_from([".keras", ".h5"]), damage=byte_damage)
def test_truncated_and_flipped_files(valid_files, suffix, damage):
    with damaged_file(damage_bytes(valid_files[suffix], damage), suffix) as p:
        read_with_every_reader(p)


@FUZZ
@given(
    member=st.sampled_from(["config.json", "metadata.json"]),
    index=st.integers(0, 10**6),
    value=hostile_values,
)
def test_keras_files_with_hostile_json(valid_files, member, index, value):
    with damaged_file(valid_files[".keras"], ".keras") as path:

        def change(members):
            config = json.loads(members[member])
            members[member] = json.dumps(
                mutate_json(config, index, value)
            ).encode()

        rewrite_keras_archive(path, change)
        read_with_every_reader(path)


H5_ATTRIBUTES = (
    ("/", "model_config"),
    ("/", "training_config"),
    ("/", "keras_version"),
    ("/model_weights", "layer_names"),
    ("/model_weights/first", "weight_names"),
    ("/optimizer_weights", "weight_names"),
)
h5_attribute_values = st.one_of(
    st.sampled_from(
        [np.array([1, 2]), np.array([b"nope"]), 7, b"{", b"[]", "2.15.0"]
    ),
    hostile_scalars.filter(lambda v: v is not None).map(json.dumps),
)


@FUZZ
@given(
    where=st.sampled_from(H5_ATTRIBUTES),
    value=h5_attribute_values,
    deleted=st.sampled_from([None, "model_weights/first", "optimizer_weights"]),
)
def test_h5_files_with_hostile_attributes(valid_files, where, value, deleted):
    with damaged_file(valid_files[".h5"], ".h5") as path:
        with h5py.File(path, "r+") as f:
            if where[0] in f:
                f[where[0]].attrs[where[1]] = value
            if deleted is not None and deleted in f:
                del f[deleted]
        read_with_every_reader(path)


@FUZZ
@given(index=st.integers(0, 10**6), value=hostile_values)
def test_model_from_json_with_hostile_configs(valid_files, index, value):
    config = mutate_json(json.loads(valid_files["json"]), index, value)
    try:
        text = json.dumps(config)
    except (RecursionError, ValueError):
        return
    try:
        model = kdp.model_from_json(text)
    except DOCUMENTED as error:
        assert str(error), repr(error)
    else:
        assert isinstance(model, keras.layers.Layer)


@pytest.mark.parametrize("suffix", [".keras", ".h5"])
def test_a_huge_declared_shape_is_refused(valid_files, suffix):
    with damaged_file(valid_files[suffix], suffix) as path:
        if suffix == ".h5":
            _add_huge_dataset(path)
        else:

            def change(members):
                weights = path.with_suffix(".weights.h5")
                weights.write_bytes(members["model.weights.h5"])
                _add_huge_dataset(weights)
                members["model.weights.h5"] = weights.read_bytes()
                weights.unlink()

            rewrite_keras_archive(path, change)
        with pytest.raises(ModelFileError, match="elements"):
            kdp.load_model(path)


def _add_huge_dataset(path):
    with h5py.File(path, "r+") as f:
        f.create_dataset("huge", shape=(2**40,), dtype="f4", chunks=(1024,))


def test_a_zip_member_past_the_limit_is_refused(valid_files, monkeypatch):
    monkeypatch.setattr(file_limits, "MAX_ZIP_MEMBER_BYTES", 100)
    with damaged_file(valid_files[".keras"], ".keras") as path:
        with pytest.raises(ModelFileError, match="expands to"):
            kdp.load_model(path)


def test_a_bad_crc_and_a_fifo_give_model_file_errors(valid_files, tmp_path):
    data = bytearray(valid_files[".keras"])
    data[data.index(b'"class_name"') + 2] ^= 1
    with damaged_file(bytes(data), ".keras") as path:
        with pytest.raises(ModelFileError, match="broken zip"):
            kdp.load_model(path)
    fifo = tmp_path / "model.keras"
    os.mkfifo(fifo)
    with pytest.raises(ModelFileError, match="FIFO"):
        kdp.load_model(fifo)
    h5_fifo = tmp_path / "model.h5"
    os.mkfifo(h5_fifo)
    with pytest.raises(ValueError, match="FIFO"):
        keras.saving.load_model(h5_fifo)


def test_a_version_that_is_an_array_is_ignored(valid_files):
    with damaged_file(valid_files[".h5"], ".h5") as path:
        with h5py.File(path, "r+") as f:
            f.attrs["keras_version"] = np.array([1, 2])
        assert isinstance(kdp.load_model(path), keras.Model)


def test_malformed_h5_files_give_value_errors(valid_files):
    with damaged_file(valid_files[".h5"], ".h5") as path:
        with h5py.File(path, "r+") as f:
            del f["model_weights/first"]
        with pytest.raises(ModelFileError, match="KeyError"):
            kdp.load_model(path)
        with pytest.raises(ValueError, match="malformed"):
            keras.saving.load_model(path)


@pytest.mark.parametrize(
    "text, match",
    [
        ('{"class_name": "Functional"}', "'config'"),
        (
            '{"class_name": "Sequential", "config": {"layers": [{"class_name"'
            ': "Dense", "config": {"units": 2147483648}}]}}',
            "`units`=2147483648",
        ),
        (
            '{"class_name": "Sequential", "config": {"layers": [{"class_name"'
            ': "Dense", "config": {"units": 2, "kernel_regularizer": '
            + '{"class_name": "L2", "config": {"l2": ' * 450
            + "0.1"
            + "}}" * 450
            + "}}]}}",
            "nested more than 200",
        ),
        ("[" * 100000 + "]" * 100000, "nested too deeply"),
    ],
    ids=["no_config", "huge_units", "deep_regularizer", "deep_json"],
)
def test_model_from_json_refuses_with_the_field_named(text, match):
    with pytest.raises(ValueError, match=match):
        kdp.model_from_json(text)


def test_h5py_runtime_errors_name_the_file_and_keep_their_kind():
    # h5py raises a plain RuntimeError on a damaged HDF5 structure (found by
    # a fuzz run on torch through keras.saving.load_model): it becomes a
    # MalformedFileError, a ValueError that is still a RuntimeError.
    message = "Unable to synchronously check link existence"
    with pytest.raises(file_limits.MalformedFileError) as caught:
        with file_limits.malformed_as_value_errors("model.h5"):
            raise RuntimeError(message)
    assert isinstance(caught.value, (ValueError, RuntimeError))
    assert str(caught.value).startswith("model.h5: ")
    assert message in str(caught.value)
    # Other RuntimeErrors are not about the file: they pass unchanged.
    with pytest.raises(RecursionError):
        with file_limits.malformed_as_value_errors("model.h5"):
            raise RecursionError("deep")
