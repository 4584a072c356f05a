"""The README's JAX custom training loop, run as written."""

import numpy as np
from testing import check_custom_loop_result
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
