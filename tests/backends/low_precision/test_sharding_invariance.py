"""A variable's state does not depend on where it lives (issue #46).

Every per-variable choice of the low-precision wing (quantized or kept in
float32, the block size and code, the compensation, the random bits'
element indices) is made from the whole variable, never from a shard. The
anchors' open bugs show what goes wrong otherwise: bitsandbytes #2080
(FSDP's flattened shards) and torchao #4912 (a DTensor's local shard
measured against the 4096-element threshold) give the same parameter
32-bit state on one device and 8-bit state when sharded.

`sharding_invariance_worker.py` trains one model under 8-bit state (and
4-bit and Kahan, 16-bit and 8-bit, in the full runs) on 1 and 8 forced
host devices (2 and 4 too in the full runs), with no distribution,
`DataParallel` and `ModelParallel`, each with and without
`shard_optimizer_state`. Checked here:

- the state's dtypes, global shapes and bytes are the same in every run;
- with the gradients summed in the same order (the same device count and
  layout), sharding the state changes no weight by a single bit;
- across device counts, where only the order of the gradients' sum
  differs, the weights stay within a few bfloat16 steps of the one-device
  run (four Adam steps at 1e-2 on 2, 4 and 8 devices: at most 9.8e-4 with 8-bit
  and 16-bit state, 6.4e-3 with 4-bit on 2 and 4 devices; the bound
  is 2**-6).

JAX only: `keras.distribution`, which `shard_optimizer_state` shards on,
is JAX's in the Keras releases the package supports.
"""

import json
import pathlib

import numpy as np
import pytest
from testing import BACKEND
from testing import made_once
from testing import run_json_worker

WORKER = pathlib.Path(__file__).with_name("sharding_invariance_worker.py")
# The 8-bit row makes the size decision (quantized or not) in the default
# runs; the 4-bit and Kahan rows run in the full runs (`tox -e full-jax`).
CONFIGURATIONS = (
    "stochastic_bfloat16_8bit",
    pytest.param("stochastic_bfloat16_4bit", marks=pytest.mark.slow),
    pytest.param("kahan_bfloat16_8bit", marks=pytest.mark.slow),
    pytest.param("kahan_bfloat16", marks=pytest.mark.slow),
)
DEVICE_COUNTS = (
    8,
    pytest.param(2, marks=pytest.mark.slow),
    pytest.param(4, marks=pytest.mark.slow),
)
LAYOUTS = ("none", "data", "data_sharded", "model", "model_sharded")
# Four Adam steps at 1e-2 move a weight by about 0.04; a different order
# of the gradients' sum flips a few bfloat16 roundings (2**-8 relative).
ACROSS_DEVICES = 2.0**-6

pytestmark = pytest.mark.skipif(
    BACKEND != "jax",
    reason="keras.distribution, which shard_optimizer_state shards on, "
    "is the JAX backend's",
)


def runs(tmp_path_factory, devices, configuration):
    """(folder, findings) of one configuration's runs on `devices`,
    made once per test run."""

    def make(folder):
        found = run_json_worker(
            WORKER, folder, devices, configuration, backend="jax"
        )
        (folder / "found.json").write_text(json.dumps(found))

    folder = made_once(
        tmp_path_factory,
        f"sharding_invariance_{devices}_{configuration}",
        make,
    )
    return folder, json.loads((folder / "found.json").read_text())


def weights(folder, devices, configuration, layout):
    with np.load(folder / f"{devices}-{configuration}-{layout}.npz") as data:
        return {key: data[key] for key in data.files}


@pytest.mark.parametrize("devices", DEVICE_COUNTS)
@pytest.mark.parametrize("configuration", CONFIGURATIONS)
def test_state_dtypes_shapes_and_bytes_ignore_the_layout(
    tmp_path_factory, configuration, devices
):
    _, single = runs(tmp_path_factory, 1, configuration)
    _, found = runs(tmp_path_factory, devices, configuration)
    reference = single[f"1-{configuration}-none"]
    quantized = [path for path in reference["state"] if path.endswith("_codes")]
    if configuration != "kahan_bfloat16":
        # The 8192-element kernel's moments are coded, and the 1024-element
        # one's are not, whatever holds them.
        assert any("dense_kernel" in path for path in quantized), quantized
        assert not any("head_kernel" in path for path in quantized)
    for results, count in ((single, 1), (found, devices)):
        for layout in LAYOUTS:
            run = results[f"{count}-{configuration}-{layout}"]
            assert run["state"] == reference["state"], (count, layout)
            assert run["state_bytes"] == reference["state_bytes"]


@pytest.mark.parametrize("devices", DEVICE_COUNTS)
@pytest.mark.parametrize("configuration", CONFIGURATIONS)
def test_sharding_the_state_changes_no_weight(
    tmp_path_factory, configuration, devices
):
    folder, _ = runs(tmp_path_factory, devices, configuration)
    for layout in ("data", "model"):
        plain = weights(folder, devices, configuration, layout)
        sharded = weights(folder, devices, configuration, f"{layout}_sharded")
        assert plain.keys() == sharded.keys()
        for path in plain:
            np.testing.assert_array_equal(
                sharded[path], plain[path], f"{layout}: {path}"
            )


@pytest.mark.parametrize("devices", DEVICE_COUNTS)
@pytest.mark.parametrize("configuration", CONFIGURATIONS)
def test_device_count_only_reorders_the_gradients_sum(
    tmp_path_factory, configuration, devices
):
    single_folder, _ = runs(tmp_path_factory, 1, configuration)
    folder, _ = runs(tmp_path_factory, devices, configuration)
    alone = weights(single_folder, 1, configuration, "none")
    # No distribution on several devices runs on the first: bit for bit.
    for path, value in weights(folder, devices, configuration, "none").items():
        np.testing.assert_array_equal(value, alone[path], path)
    for layout in ("data_sharded", "model_sharded"):
        spread = weights(folder, devices, configuration, layout)
        for path in alone:
            difference = np.max(np.abs(spread[path] - alone[path]))
            assert difference <= ACROSS_DEVICES, (layout, path, difference)
