"""The README's JAX custom training loop, run as written."""

import numpy as np
from testing import FINITE
from testing import INF
from testing import NAN
from testing import check_custom_loop_result
from testing import reference_trajectory
from testing import run_readme_example
from testing import to_numpy


def test_readme_custom_loop_trains_and_skips_overflows():
    namespace, printed = run_readme_example("jax")
    check_custom_loop_result(namespace, printed)
    optimizer = namespace["optimizer"]
    state = namespace["state"]
    trainable = [to_numpy(v).copy() for v in state[0]]
    skipped = optimizer.skipped_steps
    _, new_state = namespace["train_step"](
        state, namespace["x"] * 1e6, namespace["y"]
    )
    for old, new in zip(trainable, new_state[0], strict=True):
        np.testing.assert_array_equal(old, to_numpy(new))
    for variable, value in zip(optimizer.variables, new_state[2], strict=True):
        variable.assign(value)
    assert optimizer.skipped_steps == skipped + 1


def test_readme_custom_loop_follows_the_rule_under_faults():
    namespace, _ = run_readme_example("jax")
    optimizer, state = namespace["optimizer"], namespace["state"]
    x, y = namespace["x"][:16], namespace["y"][:16]
    schedule = [NAN, FINITE, INF, INF, FINITE, NAN, FINITE, FINITE]
    start = (optimizer.loss_scale, optimizer.skipped_steps)
    states = []
    for kind in schedule:
        batch = x.copy()
        if kind != FINITE:
            batch[0] = np.nan if kind == NAN else np.inf
        _, state = namespace["train_step"](state, batch, y)
        for variable, value in zip(optimizer.variables, state[2], strict=True):
            variable.assign(value)
        states.append((optimizer.loss_scale, optimizer.dynamic_counter))
        for value in state[0]:
            assert np.all(np.isfinite(to_numpy(value)))
    expected = reference_trajectory(
        schedule, start[0], growth_steps=optimizer.dynamic_growth_steps
    )
    assert states == [(scale, counter) for scale, counter, _ in expected]
    assert optimizer.skipped_steps == start[1] + 4
