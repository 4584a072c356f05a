"""8-bit state, ZeRO-1, loss scaling, float8 layers and a MultiOptimizer.

`everything_worker.py` trains a `"float8_from_mixed_float16"` model (its
Dense layers in float8, the compile hook's dynamic `LossScaleOptimizer`)
with a `MultiOptimizer` whose first layer keeps 8-bit Adam state, all of
it sharded by `shard_optimizer_state` over four forced host devices, runs
a batch that overflows float16, saves, and continues; then loads the file
in processes with two devices (sharded again) and one, and continues the
same epoch there. JAX only: `keras.distribution` and the sharding are
JAX's on the released Keras (PyTorch's are tested on keras-nightly in
`test_state_sharding_torch.py`, without float8 and MultiOptimizer).
"""

import pathlib

import keras
import pytest
from testing import BACKEND
from testing import run_json_worker

WORKER = pathlib.Path(__file__).with_name("everything_worker.py")
TRAINED_ON = 4

pytestmark = [
    pytest.mark.xdist_group("everything_at_once"),
    pytest.mark.skipif(
        BACKEND != "jax",
        reason="keras.distribution, which the sharding uses, is JAX's "
        "on the released Keras",
    ),
    pytest.mark.skipif(
        not hasattr(keras.optimizers, "MultiOptimizer"),
        reason="MultiOptimizer arrived in Keras 3.15",
    ),
]
# After loading on fewer devices and training one more epoch, the weights
# differ from the four-device run by the order in which the gradient is
# summed (float32 master weights; the 8-bit moments may then round a code
# differently): measured at most 6.6e-4 on 2 and 1 devices. The float8
# amax histories of the scaled gradients may round the other way in
# float16: relatively at most 1.5e-3.
RESUME_TOLERANCE = 2e-3
SCALING_TOLERANCE = 1e-2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("everything")
    found = {"train": run_json_worker(WORKER, out, TRAINED_ON, "train")}
    for devices in (2, 1):
        found[devices] = run_json_worker(WORKER, out, devices, "resume")
    return found


def check_structure(found, devices):
    assert found["devices"] == devices
    assert found["optimizer"] == "LossScaleOptimizer"
    assert found["inner"] == "MultiOptimizer"
    assert found["policies"] == ["float8_from_mixed_float16"] * 2
    dtypes = found["state_dtypes"]
    # The first kernel's moments are 8-bit codes with float32 block
    # scales; its bias is below the 4096 elements that get codes, and the
    # second layer's Adam keeps float32 moments.
    codes = {p: d for p, d in dtypes.items() if p.endswith("_codes")}
    assert len(codes) == 2 and set(codes.values()) == {"int8"}, dtypes
    assert all("hidden_kernel" in p for p in codes), dtypes
    head = {p: d for p, d in dtypes.items() if "head" in p}
    assert len(head) == 4 and set(head.values()) == {"float32"}, dtypes
    assert found["all_finite"]


def test_trains_sharded_with_a_skipped_step(runs):
    found = runs["train"]
    check_structure(found, TRAINED_ON)
    # 1/4 of each slot, plus the replicated scalars.
    assert found["share"] <= 1 / TRAINED_ON + 0.02
    assert found["weights_changed"]
    # 8 batches, one overflowed: the optimizer stepped 7 times and the
    # dynamic scale halved once from 2**15 (it grows only after 2000).
    assert found["iterations"] == 7
    assert found["dynamic_scale"] == 2.0**14


@pytest.mark.parametrize("devices", [2, 1])
def test_reloads_on_another_device_count_and_trains_on(runs, devices):
    found = runs[devices]
    assert found["state_paths_equal"]
    assert found["state_equal"]
    assert found["weights_equal"]
    check_structure(found, devices)
    assert found["share"] <= 1 / devices + 0.02
    assert found["iterations"] == 11
    assert found["dynamic_scale"] == 2.0**14
    assert found["difference_from_continued"] <= RESUME_TOLERANCE
    assert found["scaling_difference_from_continued"] <= SCALING_TOLERANCE
