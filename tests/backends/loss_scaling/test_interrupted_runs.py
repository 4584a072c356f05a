"""A run interrupted mid-training and resumed in a new process continues
exactly as an uninterrupted one: same weights, loss scale and counters."""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

WORKER = pathlib.Path(__file__).with_name("resume_worker.py")


def run(mode, work_dir):
    result = subprocess.run(
        [sys.executable, str(WORKER), mode, str(work_dir)],
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work_dir = tmp_path_factory.mktemp("resume")
    full = run("full", work_dir)
    assert full.returncode == 0, full.stderr[-3000:]
    interrupted = run("interrupted", work_dir)
    assert interrupted.returncode != 0
    assert "simulated interruption" in interrupted.stderr
    assert not (work_dir / "interrupted.npz").exists()
    return work_dir


@pytest.mark.parametrize("resume", ["resume_backup", "resume_checkpoint"])
def test_resumed_run_matches_the_uninterrupted_one(runs, resume):
    result = run(resume, runs)
    assert result.returncode == 0, result.stderr[-3000:]
    full = np.load(runs / "full.npz")
    resumed = np.load(runs / f"{resume}.npz")
    assert sorted(full.files) == sorted(resumed.files)
    assert float(full["skipped_steps"]) == 5  # one overflow per epoch
    for key in ("loss_scale", "dynamic_counter", "skipped_steps"):
        assert full[key] == resumed[key], key
    for key in full.files:
        np.testing.assert_array_equal(full[key], resumed[key], err_msg=key)
