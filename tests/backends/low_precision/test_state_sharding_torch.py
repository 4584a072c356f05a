"""`shard_optimizer_state` on Keras' torch distribution API (keras-nightly).

Keras' development builds give the torch backend `keras.distribution`
(`DataParallel` through DistributedDataParallel, DTensor layouts); its
releases up to 3.15 have none, and there the switch refuses
(`test_state_sharding.py`). Two processes on this machine (gloo, a local
coordinator) train under `DataParallel` with and without the switch
(`torch_state_sharding_worker.py`); a third process, without a
distribution, loads what each saved.
"""

import pathlib

import numpy as np
import pytest
import testing
from testing import BACKEND

from keras_dtype_policy.low_precision import state_sharding

pytestmark = [
    pytest.mark.skipif(
        BACKEND != "torch" or not state_sharding.torch_has_distribution(),
        reason=(
            "Keras' torch distribution API exists in Keras' development "
            "builds only (tox -e keras-nightly-torch); on a release the "
            "switch's refusal is tested in test_state_sharding.py"
        ),
    ),
    pytest.mark.xdist_group("state_sharding_torch"),
]

WORKER = pathlib.Path(__file__).with_name("torch_state_sharding_worker.py")
WORLD_SIZE = 2
PROCESS_TIMEOUT = 240
CASES = ("adam", "mixed_float16", "model_parallel")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both ranks' results, then the loads of their files."""
    for _ in range(3):  # another process may take the port first
        work_dir = tmp_path_factory.mktemp("torch_state_sharding")
        port = str(testing.free_port())
        ranks = [
            (f"rank{r}", ["rank", str(r), str(WORLD_SIZE), port, str(work_dir)])
            for r in range(WORLD_SIZE)
        ]
        failures = testing.run_all(WORKER, ranks, work_dir, PROCESS_TIMEOUT)
        if not any("address already in use" in f.lower() for f in failures):
            break
    assert not failures, "\n".join(failures)
    load = [("load", ["load", str(work_dir), str(WORLD_SIZE)])]
    failures = testing.run_all(WORKER, load, work_dir, PROCESS_TIMEOUT)
    assert not failures, "\n".join(failures)
    return work_dir


def results(runs, name):
    return np.load(runs / f"{name}.npz")


def keys(found, prefix):
    return sorted(k[len(prefix) :] for k in found.files if k.startswith(prefix))


@pytest.mark.parametrize("case", CASES)
def test_training_is_unchanged_bit_for_bit(runs, case):
    ranks = [results(runs, f"rank{r}-{case}") for r in range(WORLD_SIZE)]
    names = keys(ranks[0], "sharded:")
    assert names == keys(ranks[0], "plain:") and len(names) > 10
    for found in ranks:
        for name in names:
            np.testing.assert_array_equal(
                found[f"sharded:{name}"], found[f"plain:{name}"], err_msg=name
            )
            np.testing.assert_array_equal(
                found[f"sharded:{name}"], ranks[0][f"sharded:{name}"]
            )


@pytest.mark.parametrize("case", CASES)
def test_each_process_holds_half_of_the_state(runs, case):
    found = results(runs, f"rank0-{case}")
    names = list(found["names"])
    for index, name in enumerate(names):
        local, whole = found[f"local:o{index}"]
        # Slots of a kernel or bias split along their first dimension;
        # scalars (the iteration counter, a loss scale's counters) stay
        # whole on every process.
        if name.endswith(("momentum", "velocity")):
            assert (local, whole) == (whole // 2, whole) and whole > 1, name
        else:
            assert local == whole, name


def test_a_nan_in_one_process_skips_the_step_everywhere(runs):
    # mixed_float16: the compile hook's LossScaleOptimizer around the
    # sharded Adam; rank 0's part of step 2 holds a NaN. DDP sums it into
    # both processes' gradients, so both skip and halve the scale.
    for rank in range(WORLD_SIZE):
        found = results(runs, f"rank{rank}-mixed_float16")
        values = {}
        for index, name in enumerate(found["names"]):
            values.setdefault(str(name), []).append(found[f"sharded:o{index}"])
        assert int(values["skipped_steps"][0]) == 1
        assert float(values["dynamic_scale"][0]) == 2.0**15 / 2
        # Four batches, one skipped: the inner Adam stepped three times.
        assert max(int(x) for x in values["iteration"]) == 3


@pytest.mark.parametrize("case", CASES)
def test_saved_files_load_in_one_process_equal(runs, case):
    saved = results(runs, f"rank0-{case}")
    for rank in range(WORLD_SIZE):
        loaded = results(runs, f"load{rank}-{case}")
        names = keys(loaded, "loaded:")
        assert names == keys(saved, "sharded:")
        for name in names:
            np.testing.assert_array_equal(
                loaded[f"loaded:{name}"], saved[f"sharded:{name}"], err_msg=name
            )
        assert loaded["trained_finite"].all()


def test_uninstall_takes_the_methods_off(runs):
    for case in CASES:
        found = results(runs, f"rank0-{case}")
        expected = sorted(state_sharding.SHARDING_METHODS)
        assert sorted(found["patched"]) == expected
        assert len(found["left_after_uninstall"]) == 0
