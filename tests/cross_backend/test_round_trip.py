"""Models saved under each backend load under each other backend.

Each side runs in its own process (worker.py). The pairs must keep every
layer's policy, the loss-scale state and every optimizer value exactly, and
the predictions within float16/bfloat16 rounding: rtol = atol = 2e-2 (the
backends compute half-precision matmuls differently; float32 layers agree
to 1e-6). Loading must not import the backend library that saved the file
(beyond what `import keras` itself imports when it is installed).

A `kahan_bfloat16` model trained by the `LowPrecisionOptimizer` travels
with it: its bfloat16 weights, Kahan compensation buffers and optimizer
state must come back bit for bit on the other backend, and so must the codes,
scales and other optimizer values of a model trained with 8-bit Adam state.
"""

import itertools
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

BACKENDS = ("tensorflow", "jax", "torch")
WORKER = pathlib.Path(__file__).with_name("worker.py")


def run_worker(backend, mode, model_path, state_path):
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run(
        [sys.executable, str(WORKER), mode, str(model_path), str(state_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(pathlib.Path(state_path).read_text())


class SavedModels(dict):
    """Each backend's saved model and state, made when first asked for.

    Lazily: the tests run in two worker processes, and each saves only
    the backends its own share of the pairs loads from.
    """

    def __init__(self, folder):
        super().__init__()
        self.folder = folder

    def __missing__(self, backend):
        model_path = self.folder / f"{backend}.keras"
        state = run_worker(
            backend, "save", model_path, self.folder / f"{backend}.json"
        )
        self[backend] = (model_path, state)
        return self[backend]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return SavedModels(tmp_path_factory.mktemp("saved"))


@pytest.mark.parametrize(
    "source, target",
    [p for p in itertools.permutations(BACKENDS, 2)],
    ids=lambda b: b,
)
def test_round_trip(saved, source, target, tmp_path):
    model_path, before = saved[source]
    after = run_worker(target, "load", model_path, tmp_path / "loaded.json")
    assert before["backend"] == source and after["backend"] == target
    assert after["policies"] == before["policies"]
    assert after["optimizer"] == before["optimizer"] == "LossScaleOptimizer"
    for key in ("loss_scale", "dynamic_counter", "skipped_steps"):
        assert after[key] == before[key], key
    assert before["skipped_steps"] == 1
    assert before["loss_scale"] == 2.0**9
    assert len(after["optimizer_values"]) == len(before["optimizer_values"])
    for old, new in zip(
        before["optimizer_values"], after["optimizer_values"], strict=True
    ):
        np.testing.assert_array_equal(np.asarray(old), np.asarray(new))
    np.testing.assert_allclose(
        after["predictions"], before["predictions"], rtol=2e-2, atol=2e-2
    )
    assert source not in after["newly_imported"]
    assert_low_precision_kept(before["low_precision"], after["low_precision"])
    assert_quantized_kept(before["quantized"], after["quantized"])


def assert_low_precision_kept(before, after):
    """The `kahan_bfloat16` model came back bit for bit."""
    assert after["optimizer"] == before["optimizer"]
    assert before["optimizer"] == "LowPrecisionOptimizer"
    assert after["update"] == before["update"] == "kahan"
    assert after["weight_dtypes"] == before["weight_dtypes"]
    assert set(before["weight_dtypes"]) == {"bfloat16"}
    for old, new in zip(before["weights"], after["weights"], strict=True):
        np.testing.assert_array_equal(np.asarray(old), np.asarray(new))
    assert len(after["optimizer_values"]) == len(before["optimizer_values"])
    for old, new in zip(
        before["optimizer_values"], after["optimizer_values"], strict=True
    ):
        np.testing.assert_array_equal(np.asarray(old), np.asarray(new))


def assert_quantized_kept(before, after):
    """The model with 8-bit Adam state came back bit for bit."""
    assert after["optimizer"] == before["optimizer"]
    assert after["state_dtype"] == before["state_dtype"] == "8bit"
    # The step count and the seed generator's state are int32, int64 or
    # uint32 as the backend has them (Keras' choice); their values agree.
    dtypes = [
        (name, old, new)
        for name, old, new in zip(
            before["names"], before["dtypes"], after["dtypes"], strict=True
        )
        if name.endswith(("_codes", "_scales"))
    ]
    assert len(dtypes) == 4
    assert all(old == new for _, old, new in dtypes), dtypes
    # A slot's name comes from its weight's path, with or without the
    # model's name in front as the optimizer was built in or out of it.
    for old, new in zip(before["names"], after["names"], strict=True):
        assert old.endswith(new) or new.endswith(old), (old, new)
    assert sum(name.endswith("_codes") for name in before["names"]) == 2
    for old, new in zip(
        before["optimizer_values"], after["optimizer_values"], strict=True
    ):
        np.testing.assert_array_equal(np.asarray(old), np.asarray(new))
