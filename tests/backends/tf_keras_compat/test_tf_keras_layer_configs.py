"""Layer configs that tf.keras 2 wrote and Keras 3 cannot read as they are.

tests/fixtures/tf_keras2/layers holds, for each difference, the smallest
model that shows it, saved as .h5 and .keras by tf-keras 2.21 with its
predictions (layer_fixtures.py there): DepthwiseConv2D's `groups`, layer
names with "/", `batch_input_shape` on a Sequential's first Embedding.
Predictions are compared within 8 ulps of the compute dtype.
"""

import json
import pathlib

import keras
import numpy as np
import pytest
from testing import to_numpy

from keras_dtype_policy import DTypePolicy

FIXTURES = (
    pathlib.Path(__file__).resolve().parents[2]
    / "fixtures"
    / "tf_keras2"
    / "layers"
)
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())
EPSILON = {"float16": 2.0**-10, "bfloat16": 2.0**-7}


@pytest.mark.parametrize("name", sorted(MANIFEST["models"]))
def test_loads_with_policies_and_predictions(name):
    policy = MANIFEST["models"][name]["policy"]
    tolerance = 8 * EPSILON[DTypePolicy(policy).compute_dtype]
    with np.load(FIXTURES / "predictions.npz") as npz:
        x, y = npz[f"{name}.x"], npz[f"{name}.y"]
    for suffix in (".h5", ".keras"):
        model = keras.saving.load_model(FIXTURES / f"{name}{suffix}")
        policies = {layer.dtype_policy.name for layer in model.layers}
        assert policy in policies, suffix
        np.testing.assert_allclose(
            to_numpy(model.predict(x, verbose=0)),
            y,
            rtol=tolerance,
            atol=tolerance,
            err_msg=suffix,
        )
