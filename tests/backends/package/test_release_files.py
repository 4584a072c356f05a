"""Files saved by an earlier release load with the same state.

tests/fixtures/release_0_1_0 holds a model saved by release 0.1.0 (the flat
module layout) on jax: the package's `DTypePolicy`, the legacy `Policy` with
a fixed loss scale, and a dynamic `LossScaleOptimizer` trained four steps.
Their configs name the old module paths (`keras_dtype_policy.policy`,
`keras_dtype_policy.legacy_policy`); the registered names find the classes.
"""

import pathlib
import warnings

import keras
import numpy as np
import pytest
from testing import to_numpy

import keras_dtype_policy as kdp

FIXTURES = pathlib.Path(__file__).resolve().parents[2] / "fixtures"
RELEASE_0_1_0 = FIXTURES / "release_0_1_0"
EXPECTED = np.load(RELEASE_0_1_0 / "mixed_model.expected.npz")


@pytest.mark.parametrize("file_name", ["mixed_model.keras", "mixed_model.h5"])
def test_release_0_1_0_model_loads_with_its_state(file_name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model = keras.saving.load_model(RELEASE_0_1_0 / file_name)

    first, second, head = model.layers[1:]
    assert type(first.dtype_policy) is kdp.DTypePolicy
    assert first.dtype_policy.name == "mixed_float16"
    # As in tf.keras 2.4+, a saved experimental Policy comes back as the
    # non-experimental `mixed_precision.Policy` of the same name, without
    # its loss scale (0.1.0 gave a plain DTypePolicy; both equal it).
    assert type(second.dtype_policy) is kdp.mixed_precision.Policy
    assert second.dtype_policy == kdp.DTypePolicy("mixed_float16")
    assert second.dtype_policy.name == "mixed_float16"
    assert head.dtype_policy.name == "float32"

    predictions = to_numpy(model(EXPECTED["x"]))
    np.testing.assert_allclose(
        predictions, EXPECTED["predictions"], rtol=1e-2, atol=1e-3
    )

    optimizer = model.optimizer
    assert isinstance(optimizer, kdp.LossScaleOptimizer)
    assert isinstance(optimizer.inner_optimizer, keras.optimizers.Adam)
    if not optimizer.built:
        # An .h5 file's optimizer state waits for the first real build.
        optimizer.build(model.trainable_variables)
    assert int(to_numpy(optimizer.iterations)) == EXPECTED["iterations"]
    assert float(to_numpy(optimizer.loss_scale)) == EXPECTED["loss_scale"]
    assert (
        int(to_numpy(optimizer.dynamic_counter)) == EXPECTED["dynamic_counter"]
    )
