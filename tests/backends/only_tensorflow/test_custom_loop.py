"""The README's TensorFlow custom training loop, run as written."""

import numpy as np
from testing import check_custom_loop_result
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
