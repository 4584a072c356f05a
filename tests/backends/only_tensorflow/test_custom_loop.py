"""The README's TensorFlow custom training loop, run as written."""

import numpy as np
from testing import FINITE
from testing import INF
from testing import NAN
from testing import check_custom_loop_result
from testing import reference_trajectory
from testing import run_readme_example
from testing import to_numpy


def test_readme_custom_loop_trains_and_skips_overflows():
    namespace, printed = run_readme_example("tensorflow")
    check_custom_loop_result(namespace, printed)
    model, optimizer = namespace["model"], namespace["optimizer"]
    weights = [to_numpy(w).copy() for w in model.weights]
    skipped, scale = optimizer.skipped_steps, optimizer.loss_scale
    namespace["train_step"](namespace["x"] * 1e6, namespace["y"])
    assert optimizer.skipped_steps == skipped + 1
    assert optimizer.loss_scale == max(scale / 2, 1.0)
    for old, new in zip(weights, model.weights, strict=True):
        np.testing.assert_array_equal(old, to_numpy(new))


def test_readme_custom_loop_follows_the_rule_under_faults():
    namespace, _ = run_readme_example("tensorflow")
    model, optimizer = namespace["model"], namespace["optimizer"]
    x, y = namespace["x"][:16], namespace["y"][:16]
    schedule = [NAN, FINITE, INF, INF, FINITE, NAN, FINITE, FINITE]
    start = (optimizer.loss_scale, optimizer.skipped_steps)
    states = []
    for kind in schedule:
        batch = x.copy()
        if kind != FINITE:
            batch[0] = np.nan if kind == NAN else np.inf
        namespace["train_step"](batch, y)
        states.append((optimizer.loss_scale, optimizer.dynamic_counter))
        for weight in model.weights:
            assert np.all(np.isfinite(to_numpy(weight)))
    expected = reference_trajectory(
        schedule, start[0], growth_steps=optimizer.dynamic_growth_steps
    )
    assert states == [(scale, counter) for scale, counter, _ in expected]
    assert optimizer.skipped_steps == start[1] + 4
