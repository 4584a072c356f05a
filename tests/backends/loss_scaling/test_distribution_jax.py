"""Loss scaling under `keras.distribution.DataParallel` on JAX.

Two engines, each run by `jax_distribution_worker.py` in processes of its
own (the device count must be set before JAX is imported): `local`, one
process with two forced host devices, and `multi`, two processes of two
devices each joined over loopback with `jax.distributed.initialize`. Every
policy and scale mode is checked against a single-device run on the same
global batches, one of which holds a NaN sample in one replica's shard.
"""

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
from testing import BACKEND
from testing import made_once
from testing import run_readme_example
from testing import selected_params

pytestmark = pytest.mark.skipif(
    BACKEND != "jax",
    reason="keras.distribution.DataParallel across devices and processes "
    "is tested on the JAX backend only",
)

WORKER = pathlib.Path(__file__).with_name("jax_distribution_worker.py")
# Each worker stops by itself (its join times out after 60 s); this bounds
# a worker that hangs anyway.
TIMEOUT = 300
ENGINES = {"local": [0], "multi": [0, 1]}
POLICIES = ["mixed_float16", "mixed_bfloat16"]
MODES = ["dynamic", "fixed"]
# Largest |DataParallel - single device| allowed on any weight after the
# 8 steps. DataParallel sums each replica's part of a gradient on its own
# device and then adds the parts across devices; one device sums the whole
# batch in one order. In float16 (11 significant bits) and bfloat16 (8)
# the two orders round differently, and Adam's normalisation carries small
# gradient differences into the updates. Measured: float16 3.3e-5 (two
# devices) and 4.9e-5 (two processes); bfloat16 2.2e-4 and 2.0e-4. The
# tolerances leave a tenfold margin and stay well below one Adam step
# (learning rate 1e-2): a step applied or skipped in the wrong place fails.
TOLERANCE = {"mixed_float16": 5e-4, "mixed_bfloat16": 2e-3}


def free_port():
    """Returns a loopback port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, request):
    """Runs both engines at once, on the policy-mode cases this run
    selected, once for all xdist workers; returns the output dir and any
    failures."""
    cases = ",".join(
        f"{policy}-{mode}"
        for policy, mode in selected_params(request, "policy", "mode")
    )
    out = made_once(
        tmp_path_factory,
        "jax_distribution_" + cases.replace(",", "_"),
        lambda folder: run_engines(folder, cases),
    )
    with open(out / "failures.json") as f:
        return out, json.load(f)


def run_engines(out, cases):
    """Runs both engines' processes to their end; writes each engine's
    failures to OUT/failures.json."""
    env = dict(
        os.environ,
        TF_CPP_MIN_LOG_LEVEL="3",
        # A loaded model compiles what the saved one did: cache it.
        JAX_COMPILATION_CACHE_DIR=str(out / "jax_cache"),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
    port = str(free_port())
    commands = {
        "local": [["local", str(out), cases]],
        "multi": [
            ["multi", str(out), port, str(i), cases] for i in ENGINES["multi"]
        ],
    }
    # stderr goes to files: a pipe nobody reads yet could fill and stall a
    # worker while the fixture waits for another one.
    logs = {
        engine: [open(out / f"{engine}_{i}.log", "w") for i in range(len(c))]
        for engine, c in commands.items()
    }
    processes = {
        engine: [
            subprocess.Popen(
                [sys.executable, str(WORKER), *args],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
            for args, log in zip(engine_commands, logs[engine], strict=True)
        ]
        for engine, engine_commands in commands.items()
    }
    deadline = time.monotonic() + TIMEOUT
    failures = {}
    for engine, engine_processes in processes.items():
        for process_id, process in enumerate(engine_processes):
            killed = ""
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                killed = f"\nkilled after {TIMEOUT} s"
            logs[engine][process_id].close()
            stderr = (out / f"{engine}_{process_id}.log").read_text() + killed
            if process.returncode != 0:
                failures.setdefault(engine, []).append(
                    f"process {process_id} exited with {process.returncode}:"
                    f"\n{stderr[-3000:]}"
                )
    with open(out / "failures.json", "w") as f:
        json.dump(failures, f)


def load(runs, engine):
    """Returns the output dir, failing if the engine's processes failed."""
    out, failures = runs
    assert engine not in failures, "\n".join(failures[engine])
    return out


def result(out, engine, policy, mode, process_id=0):
    """Returns one run's JSON record and its arrays."""
    stem = out / f"{engine}_{policy}_{mode}_p{process_id}"
    with open(f"{stem}.json") as f:
        record = json.load(f)
    return record, dict(np.load(f"{stem}.npz"))


def setup(out, engine, process_id=0):
    """Returns the setup a worker process wrote when it finished."""
    with open(out / f"{engine}_p{process_id}.json") as f:
        return json.load(f)


def expected_states(dynamic, config, steps):
    """The (scale, counter, skipped, iterations) after each step, by rule.

    Only step `nan_step` has non-finite gradients; defaults of the
    optimizer otherwise (growth 2, backoff 0.5, scale in [1, 2**24]).
    """
    scale, counter, skipped, iterations = config["initial_scale"], 0, 0, 0
    states = []
    for step in range(steps):
        if step == config["nan_step"]:
            skipped += 1
            counter = 0
            if dynamic:
                scale = max(scale * 0.5, 1.0)
        else:
            iterations += 1
            counter += 1
            if dynamic and counter >= config["growth_steps"]:
                scale = min(scale * 2.0, 2.0**24)
                counter = 0
        states.append((scale, counter, skipped, iterations))
    return states


def keys(arrays, prefix):
    """Returns the names `PREFIXi` of the saved variables, sorted."""
    return sorted(
        k
        for k in arrays
        if k.startswith(prefix)
        and not k.endswith("_copies")
        and k[len(prefix) :].isdigit()
    )


# Each policy and each scale mode runs in the default runs (two of the four
# pairs); the other two pairs in the full runs (`tox -e full-jax`).
FULL_RUNS_ONLY = {("mixed_float16", "fixed"), ("mixed_bfloat16", "dynamic")}
parametrize = pytest.mark.parametrize(
    "engine, policy, mode",
    [
        pytest.param(
            engine,
            policy,
            mode,
            marks=[pytest.mark.slow]
            if (policy, mode) in FULL_RUNS_ONLY
            else [],
        )
        for engine in ENGINES
        for policy in POLICIES
        for mode in MODES
    ],
)


def test_engines_span_the_expected_devices(runs):
    local = setup(load(runs, "local"), "local")
    assert local["process_count"] == 1
    assert len(local["devices"]) == 2
    out = load(runs, "multi")
    multi = [setup(out, "multi", i) for i in ENGINES["multi"]]
    for config in multi:
        assert config["process_count"] == 2
        assert len(config["devices"]) == 4
        assert len(config["local_devices"]) == 2
    assert set(multi[0]["local_devices"]).isdisjoint(multi[1]["local_devices"])


@parametrize
def test_weights_match_the_single_device_run(runs, engine, policy, mode):
    out = load(runs, engine)
    load(runs, "local")  # the reference
    _, reference = result(out, "single", policy, mode)
    tolerance = TOLERANCE[policy]
    names = keys(reference, "weight_")
    assert len(names) == 6
    moved = max(
        np.max(np.abs(reference[k] - reference[f"initial_{k}"])) for k in names
    )
    assert moved > 5 * tolerance  # training moved the weights far enough
    for process_id in ENGINES[engine]:
        _, arrays = result(out, engine, policy, mode, process_id)
        for name in names:
            # Same start: the seed gives every run the same initial weights.
            np.testing.assert_array_equal(
                arrays[f"initial_{name}"], reference[f"initial_{name}"]
            )
            np.testing.assert_allclose(
                arrays[name],
                reference[name],
                rtol=0,
                atol=tolerance,
                err_msg=f"{name} of process {process_id}",
            )


@parametrize
def test_replicas_hold_identical_finite_copies(runs, engine, policy, mode):
    out = load(runs, engine)
    per_process = [
        result(out, engine, policy, mode, i)[1] for i in ENGINES[engine]
    ]
    names = keys(per_process[0], "weight_") + keys(per_process[0], "optimizer_")
    # The scale, its counter and the skipped steps are among the optimizer
    # variables (with the inner optimizer's iterations and moments).
    assert len(names) > 6 + 3
    for arrays in per_process:
        for name in names:
            copies = arrays[f"{name}_copies"]
            assert len(copies) == 2, name  # one per local device
            assert np.all(np.isfinite(copies)), name
            for copy in copies[1:]:
                np.testing.assert_array_equal(copy, copies[0], err_msg=name)
    for arrays in per_process[1:]:
        for name in names:
            np.testing.assert_array_equal(
                arrays[name], per_process[0][name], err_msg=name
            )


@parametrize
def test_nan_on_one_replica_skips_the_step_everywhere(
    runs, engine, policy, mode
):
    out = load(runs, engine)
    load(runs, "local")
    config = setup(out, engine)
    reference, _ = result(out, "single", policy, mode)
    records = [result(out, engine, policy, mode, i)[0] for i in ENGINES[engine]]
    # Exactly one device, of all processes', got the NaN sample.
    nan_in_shards = {}
    for record in records:
        nan_in_shards.update(record["nan_in_shards"])
    assert len(nan_in_shards) == len(config["devices"])
    assert sum(nan_in_shards.values()) == 1

    expected = expected_states(mode == "dynamic", config, config["steps"])
    scale = [s for s, _, _, _ in expected]
    got_reference = [step["loss_scale"][0] for step in reference["steps"]]
    assert got_reference == scale
    for record in records:
        assert len(record["steps"]) == config["steps"]
        for step, (want, got) in enumerate(
            zip(expected, record["steps"], strict=True)
        ):
            for key, value in zip(
                (
                    "loss_scale",
                    "dynamic_counter",
                    "skipped_steps",
                    "iterations",
                ),
                want,
                strict=True,
            ):
                # Every local copy, after every step, follows the rule.
                assert got[key] == [value] * 2, (step, key)
        assert record["final"]["skipped_steps"] == 1
        assert record["final"]["loss_scale"] == scale[-1]
        assert record["final"] == {
            **reference["final"],
            "devices": record["final"]["devices"],
        }
    if mode == "dynamic":
        # The scale halved once, at the NaN step, and only there.
        nan_step = config["nan_step"]
        assert scale[nan_step] == scale[nan_step - 1] / 2
    else:
        assert set(scale) == {config["initial_scale"]}


@parametrize
def test_save_and_load_keep_policies_and_scale_state(
    runs, engine, policy, mode
):
    out = load(runs, engine)
    config = setup(out, engine)
    expected = expected_states(mode == "dynamic", config, config["steps"] + 1)
    for process_id in ENGINES[engine]:
        record, arrays = result(out, engine, policy, mode, process_id)
        final, loaded = record["final"], record["loaded"]
        assert final["policies"] == [policy, policy, "float32"]
        assert final["optimizer_type"] == (
            "keras_dtype_policy.loss_scaling.optimizer.LossScaleOptimizer"
        )
        assert final["dynamic"] is (mode == "dynamic")
        assert loaded == final  # policies, type, scale state, devices
        names = keys(arrays, "weight_") + keys(arrays, "optimizer_")
        for name in names:
            np.testing.assert_array_equal(
                arrays[f"loaded_{name}"], arrays[name], err_msg=name
            )
            copies = arrays[f"loaded_{name}_copies"]
            assert len(copies) == 2 and np.all(np.isfinite(copies)), name
            for copy in copies[1:]:
                np.testing.assert_array_equal(copy, copies[0], err_msg=name)
        # One more step trains the loaded model as it does the original.
        more = record["more_loaded"]
        assert more == record["more_original"]
        scale, counter, skipped, iterations = expected[-1]
        assert (
            more["loss_scale"],
            more["dynamic_counter"],
            more["skipped_steps"],
            more["iterations"],
        ) == (scale, counter, skipped, iterations)
        for name in names:
            np.testing.assert_array_equal(
                arrays[f"more_loaded_{name}"],
                arrays[f"more_original_{name}"],
                err_msg=name,
            )
            assert np.all(np.isfinite(arrays[f"more_loaded_{name}_copies"]))
        assert not np.array_equal(
            arrays["more_loaded_weight_0"], arrays["loaded_weight_0"]
        )


def test_the_readme_example_trains_under_data_parallel(tmp_path, monkeypatch):
    # This process has one CPU device, so DataParallel has one replica; the
    # workers above cover several.
    monkeypatch.chdir(tmp_path)
    try:
        namespace, printed = run_readme_example("jax", kind="distributed")
    finally:
        keras.distribution.set_distribution(None)
    model = namespace["model"]
    name, scale = printed.split()[-2:]
    assert name == "LossScaleOptimizer"
    assert float(scale) == model.optimizer.loss_scale
    optimizer = model.optimizer
    assert int(optimizer.iterations.numpy()) + optimizer.skipped_steps == 32
    assert (tmp_path / "model.keras").exists()
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    assert loaded.optimizer.loss_scale == optimizer.loss_scale
    assert [layer.dtype_policy.name for layer in loaded.layers] == [
        "mixed_float16",
        "float32",
    ]


def sharded_result(out, process_id, run="sharded"):
    """Returns the sharded-state run's record and its gathered state
    (`run="scattered"`: the run with the reduce-scatter step)."""
    stem = out / f"multi_{run}_p{process_id}"
    with open(f"{stem}.json") as f:
        record = json.load(f)
    return record, dict(np.load(f"{stem}.npz"))


def reloaded(path):
    """Returns the model of a file saved by the sharded-state run, loaded
    in this process (one device, no distribution): a `.keras` file as it
    is, a `.weights.h5` file into a model compiled anew from it."""
    if path.suffix == ".keras":
        return keras.saving.load_model(path)
    # The architecture and compile arguments of the `.keras` file beside it.
    source = keras.saving.load_model(path.with_suffix("").with_suffix(".keras"))
    model = keras.models.clone_model(source)
    model.compile(keras.optimizers.Adam(1e-3, epsilon=1e-4), "mse")
    model.optimizer.build(model.trainable_variables)
    model.load_weights(path)
    return model


@pytest.mark.parametrize("suffix", [".keras", ".weights.h5"])
@pytest.mark.parametrize("run", ["sharded", "scattered"])
def test_state_split_across_processes_reloads_whole_on_one(runs, suffix, run):
    # "scattered": `shard_optimizer_state(model, reduce_scatter=True)`,
    # whose shard_map step spans both processes.
    out = load(runs, "multi")
    record, state = sharded_result(out, 0, run)
    assert (record["optimizer_type"], record["inner_type"]) == (
        "LossScaleOptimizer",
        "LowPrecisionOptimizer",
    )
    # The NaN batch skipped one of the 8 steps on every device.
    assert (record["skipped_steps"], record["iterations"]) == (1, 7)
    paths, shards = record["paths"], record["shard_shapes"]
    # The state was split: each of a process' two devices held a quarter
    # of the first kernel's 8-bit codes and compensation (4 devices).
    for ending, whole in (
        ("dense_kernel_momentum_codes", (32, 256)),
        ("dense_kernel_velocity_codes", (32, 256)),
        ("dense_kernel_compensation", (64, 128)),
    ):
        (name,) = [k for k, p in paths.items() if p.endswith("_" + ending)]
        assert state[name].shape == whole
        assert shards[name] == [[whole[0] // 4, whole[1]]] * 2, ending
    # Both processes gathered the same whole state, finite throughout.
    _, other = sharded_result(out, 1, run)
    assert other.keys() == state.keys()
    for name, value in state.items():
        np.testing.assert_array_equal(other[name], value, err_msg=name)
        assert np.all(np.isfinite(value.astype("float32"))), name
    for process_id in ENGINES["multi"]:
        model = reloaded(out / f"multi_{run}_p{process_id}{suffix}")
        optimizer = model.optimizer
        assert type(optimizer).__name__ == "LossScaleOptimizer"
        assert (optimizer.loss_scale, optimizer.skipped_steps) == (
            record["loss_scale"],
            1,
        )
        saved = [("weight", model.weights), ("optimizer", optimizer.variables)]
        for kind, variables in saved:
            assert len(variables) == len(keys(state, f"{kind}_"))
            for i, variable in enumerate(variables):
                np.testing.assert_array_equal(
                    keras.ops.convert_to_numpy(variable),
                    state[f"{kind}_{i}"],
                    err_msg=f"{variable.path} from process {process_id}",
                )
        # It trains on from there.
        x = np.ones((8, 64), "float32")
        model.fit(x, np.ones((8, 1), "float32"), verbose=0)
        assert int(keras.ops.convert_to_numpy(optimizer.iterations)) == 8
        first = keras.ops.convert_to_numpy(model.weights[0])
        assert np.all(np.isfinite(first.astype("float32")))
        assert not np.array_equal(first, state["weight_0"])


def test_reduce_scatter_step_across_processes_trains_as_keras_step(runs):
    out = load(runs, "multi")
    _, keras_step = sharded_result(out, 0, "sharded")
    _, scattered = sharded_result(out, 0, "scattered")
    # float16 compute: each device's gradient is rounded to float16 before
    # the four are summed, where Keras' step may sum float32 partial
    # products (test_reduce_scatter.py); after 7 Adam steps at 1e-3 the
    # weights stay within a few steps of each other.
    for name, value in keras_step.items():
        if name.startswith("weight_"):
            difference = np.abs(
                scattered[name].astype("float64") - value.astype("float64")
            )
            assert difference.max() <= 0.01, name
