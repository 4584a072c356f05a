"""Mixed precision and loss scaling across processes on PyTorch.

Keras' torch backend has no distribution API (no `keras.distribution`, no
`model.fit` across devices). What a torch user can do is Keras' guide
"Multi-GPU distributed training with PyTorch": torch.distributed, one process
per rank, gradients averaged across ranks by DistributedDataParallel or by
`all_reduce`, in a torch training loop. These tests run two ranks on this
machine (gloo, CPU) with the plugin's LossScaleOptimizer, against one process
training on the same global batches (`torch_distribution_worker.py`).
"""

import json
import pathlib

import numpy as np
import pytest
import testing
from testing import BACKEND
from testing import FINITE
from testing import NAN
from testing import reference_trajectory

pytestmark = [
    pytest.mark.skipif(
        BACKEND != "torch",
        reason="torch.distributed data parallelism: the torch backend only",
    ),
    # One xdist worker takes the module (`--dist loadgroup`): its module
    # fixture runs once a run.
    pytest.mark.xdist_group("distribution_torch"),
]

WORKER = pathlib.Path(__file__).with_name("torch_distribution_worker.py")
PROCESS_TIMEOUT = 180  # seconds; the worker's own watchdog stops at 240
WORLD_SIZE = 2
# As in the worker.
STEPS, NAN_STEP, INITIAL_SCALE, GROWTH_STEPS = 8, 4, 2.0**10, 3
KINDS = [NAN if step == NAN_STEP else FINITE for step in range(STEPS)]
POLICIES = ("mixed_float16", "mixed_bfloat16")
SCALINGS = ("dynamic", "fixed")
SYNCS = ("ddp", "all_reduce")
# Largest difference from the single process allowed in any weight, after
# any step. The ranks compute the same gradients as one process, summed in
# another order: each rank sums its own samples in the compute dtype, then
# the ranks average. So they differ by the compute dtype's rounding, which
# 8 steps of SGD with momentum carry into the weights (which move by about
# 1.1 in all). Measured: 4.4e-4 for float16, 1.8e-2 for bfloat16, 1.5e-7 for
# the float32 control; the bounds leave a margin of 3 or more.
TOLERANCE = {"float32": 1e-5, "mixed_float16": 2e-3, "mixed_bfloat16": 6e-2}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Trains every configuration in one process and on two ranks, and
    loads what the ranks saved in a fourth process, all at once."""
    for _ in range(3):  # another process may take the port first
        work_dir = tmp_path_factory.mktemp("torch_distribution")
        port = str(testing.free_port())
        ranks = [
            (f"rank{r}", ["rank", str(r), str(WORLD_SIZE), port, str(work_dir)])
            for r in range(WORLD_SIZE)
        ]
        failures = testing.run_all(
            WORKER,
            [
                ("single", ["single", str(work_dir)]),
                *ranks,
                ("load", ["load", str(WORLD_SIZE), str(work_dir)]),
            ],
            work_dir,
            PROCESS_TIMEOUT,
        )
        if not any("address already in use" in f.lower() for f in failures):
            break
    assert not failures, "\n".join(failures)
    return work_dir


def load(runs, name):
    """Returns the arrays a run wrote to `name`.npz."""
    return np.load(runs / f"{name}.npz")


def rank_runs(runs, policy, scaling):
    """Yields (sync, [each rank's results]) for both ways of averaging."""
    for sync in SYNCS:
        yield (
            sync,
            [
                load(runs, f"rank{r}-{policy}-{scaling}-{sync}")
                for r in range(WORLD_SIZE)
            ],
        )


def expected_states(scaling):
    """(loss_scale, dynamic_counter, skipped_steps) after each step."""
    return reference_trajectory(
        KINDS,
        INITIAL_SCALE,
        dynamic=scaling == "dynamic",
        growth_steps=GROWTH_STEPS,
    )


def as_tuples(states):
    """Rows of floats, comparable with `reference_trajectory`."""
    return [tuple(float(v) for v in state) for state in states]


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("policy", POLICIES)
def test_ranks_agree_and_match_one_process(runs, policy, scaling):
    single = load(runs, f"single-{policy}-{scaling}")
    # The run trained: the weights moved far more than the tolerance.
    movement = np.abs(single["weights"][-1] - single["weights"][0]).max()
    assert movement > 10 * TOLERANCE[policy]
    for sync, ranks in rank_runs(runs, policy, scaling):
        for rank in ranks:
            assert rank["weights"].shape == single["weights"].shape, sync
            assert np.all(np.isfinite(rank["weights"])), sync
            # Identical on every rank, after every step.
            np.testing.assert_array_equal(
                rank["weights"], ranks[0]["weights"], err_msg=sync
            )
            np.testing.assert_array_equal(
                rank["optimizer_values"],
                ranks[0]["optimizer_values"],
                err_msg=sync,
            )
        difference = np.abs(ranks[0]["weights"] - single["weights"]).max()
        assert difference <= TOLERANCE[policy], (sync, difference)


def test_float32_control_matches_one_process_closely(runs):
    for scaling in SCALINGS:
        single = load(runs, f"single-float32-{scaling}")
        for sync, ranks in rank_runs(runs, "float32", scaling):
            for rank in ranks:
                difference = np.abs(rank["weights"] - single["weights"]).max()
                assert difference <= TOLERANCE["float32"], (sync, difference)


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("policy", POLICIES)
def test_non_finite_gradient_on_one_rank_skips_the_step_on_all(
    runs, policy, scaling
):
    for sync, ranks in rank_runs(runs, policy, scaling):
        # Only the last rank's slice holds the NaN sample.
        assert np.all(np.isfinite(ranks[0]["losses"])), sync
        assert np.isnan(ranks[-1]["losses"][NAN_STEP]), sync
        assert np.all(np.isfinite(np.delete(ranks[-1]["losses"], NAN_STEP))), (
            sync
        )
        for rank in ranks:
            # weights[i] holds the weights before step i.
            np.testing.assert_array_equal(
                rank["weights"][NAN_STEP + 1],
                rank["weights"][NAN_STEP],
                err_msg=f"{sync}: the step was not skipped",
            )
            assert not np.array_equal(
                rank["weights"][NAN_STEP + 2], rank["weights"][NAN_STEP + 1]
            ), sync
            # The same scale, counter and skipped count on every rank,
            # following the rule: the scale halves once (dynamic) or stays.
            assert as_tuples(rank["states"]) == expected_states(scaling), sync
            assert rank["states"][-1][2] == 1, sync


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("policy", POLICIES)
def test_one_process_loop_and_fit_follow_the_same_rule(runs, policy, scaling):
    single = load(runs, f"single-{policy}-{scaling}")
    fit = load(runs, f"fit-{policy}-{scaling}")
    assert as_tuples(single["states"]) == expected_states(scaling)
    assert as_tuples(fit["states"]) == expected_states(scaling)
    # The same ops on the same batches: model.fit equals the README loop.
    np.testing.assert_array_equal(fit["weights"], single["weights"])


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("policy", POLICIES)
def test_saved_ranks_reload_with_policies_and_scale_state(
    runs, policy, scaling
):
    for sync in SYNCS:
        for rank in range(WORLD_SIZE):
            name = f"rank{rank}-{policy}-{scaling}-{sync}"
            saved = json.loads((runs / f"{name}.json").read_text())
            loaded = json.loads((runs / f"loaded-{name}.json").read_text())
            assert loaded == saved, name
            assert loaded["policies"] == [policy, "float32"], name
            assert loaded["optimizer"] == (
                "keras_dtype_policy.loss_scaling.optimizer.LossScaleOptimizer"
            )
            assert loaded["dynamic"] == (scaling == "dynamic"), name
            trained = load(runs, name)
            assert (
                loaded["loss_scale"],
                loaded["dynamic_counter"],
                loaded["skipped_steps"],
            ) == as_tuples(trained["states"])[-1], name
            # The skipped step is not counted.
            assert loaded["iterations"] == STEPS - 1, name
            reloaded = load(runs, f"loaded-{name}")
            np.testing.assert_array_equal(
                reloaded["weights"], trained["weights"][-1], err_msg=name
            )
            np.testing.assert_array_equal(
                reloaded["optimizer_values"],
                trained["optimizer_values"],
                err_msg=name,
            )
