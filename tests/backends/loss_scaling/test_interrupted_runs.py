"""A run interrupted mid-training and resumed in a new process continues
exactly as an uninterrupted one: same weights, loss scale and counters."""

import os
import pathlib
import subprocess
import sys

import numpy as np

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


def test_resumed_runs_match_the_uninterrupted_one(tmp_path):
    # One test for both ways of resuming, not one each: the two runs they
    # start from then happen once, on whichever xdist worker takes it (a
    # module-scoped fixture runs again on each worker that gets a test).
    full = run("full", tmp_path)
    assert full.returncode == 0, full.stderr[-3000:]
    interrupted = run("interrupted", tmp_path)
    assert interrupted.returncode != 0
    assert "simulated interruption" in interrupted.stderr
    assert not (tmp_path / "interrupted.npz").exists()
    full = np.load(tmp_path / "full.npz")
    assert float(full["skipped_steps"]) == 5  # one overflow per epoch
    for resume in ("resume_backup", "resume_checkpoint"):
        result = run(resume, tmp_path)
        assert result.returncode == 0, f"{resume}: {result.stderr[-3000:]}"
        resumed = np.load(tmp_path / f"{resume}.npz")
        assert sorted(full.files) == sorted(resumed.files), resume
        for key in ("loss_scale", "dynamic_counter", "skipped_steps"):
            assert full[key] == resumed[key], f"{resume}: {key}"
        for key in full.files:
            np.testing.assert_array_equal(
                full[key], resumed[key], err_msg=f"{resume}: {key}"
            )
