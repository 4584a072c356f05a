"""The docs' custom training loop for this backend, run as written.

The loops are in docs/loss-scaling.md, each after a
`<!-- custom-loop: BACKEND -->` marker; tests/backends/package/test_docs.py
leaves them to this file.

Each backend has two loops: Keras 3's (`scale_loss`, `apply`) and tf.keras
2's (`get_scaled_loss`, `get_unscaled_gradients`, `apply_gradients`, tagged
`tf-keras-BACKEND`). All update the Keras variables as they go, except
Keras 3's JAX loop, which is pure and carries its state: it is written back
to the variables after each step here.
"""

import numpy as np
import pytest
from testing import BACKEND
from testing import FINITE
from testing import INF
from testing import NAN
from testing import check_custom_loop_result
from testing import reference_trajectory
from testing import run_readme_example
from testing import to_numpy


def make_step(namespace):
    """Returns `step(x, y)` for the docs loop, keeping variables current."""
    if "state" not in namespace:
        return namespace["train_step"]
    optimizer, model = namespace["optimizer"], namespace["model"]

    def step(x, y):
        _, namespace["state"] = namespace["train_step"](
            namespace["state"], x, y
        )
        trainable, _, optimizer_values = namespace["state"]
        for variable, value in zip(
            model.trainable_variables, trainable, strict=True
        ):
            variable.assign(value)
        for variable, value in zip(
            optimizer.variables, optimizer_values, strict=True
        ):
            variable.assign(value)

    return step


LOOPS = pytest.mark.parametrize(
    "tag", [BACKEND, f"tf-keras-{BACKEND}"], ids=["keras", "tf_keras"]
)


@LOOPS
def test_readme_custom_loop_trains(tag):
    namespace, printed = run_readme_example(tag)
    check_custom_loop_result(namespace, printed)


@LOOPS
def test_readme_custom_loop_follows_the_rule_under_faults(tag):
    namespace, _ = run_readme_example(tag)
    model, optimizer = namespace["model"], namespace["optimizer"]
    step = make_step(namespace)
    x, y = namespace["x"][:16], namespace["y"][:16]
    schedule = [NAN, FINITE, INF, INF, FINITE, NAN, FINITE, FINITE]
    start = (optimizer.loss_scale, optimizer.skipped_steps)
    states = []
    for kind in schedule:
        batch = x.copy()
        if kind != FINITE:
            batch[0] = np.nan if kind == NAN else np.inf
        weights = [to_numpy(w).copy() for w in model.trainable_weights]
        step(batch, y)
        states.append((optimizer.loss_scale, optimizer.dynamic_counter))
        for old, weight in zip(weights, model.trainable_weights, strict=True):
            new = to_numpy(weight)
            assert np.all(np.isfinite(new))
            if kind != FINITE:  # a skipped step leaves every weight alone
                np.testing.assert_array_equal(old, new)
    expected = reference_trajectory(
        schedule, start[0], growth_steps=optimizer.dynamic_growth_steps
    )
    assert states == [(scale, counter) for scale, counter, _ in expected]
    assert optimizer.skipped_steps == start[1] + 4
