"""`export_for_serving`: a trained model served in the dtype chosen.

Each backend's own export format is checked: a TensorFlow SavedModel on
TensorFlow, a PyTorch `ExportedProgram` on PyTorch. On JAX, Keras exports
a SavedModel through jax2tf, which needs TensorFlow: the `jax` tox env
installs none, so the JAX case runs where TensorFlow is installed beside
JAX and is skipped, with that reason, where it is not.
"""

import importlib.util

import keras
import numpy as np
import pytest
from serving_models import CONFIGURATIONS
from serving_models import X
from serving_models import float32_reference
from serving_models import predicted
from serving_models import trained
from testing import BACKEND

import keras_dtype_policy as kdp


def exported_and_served(model, tmp_path, policy):
    """Exports `model` with the backend's own format; returns the served
    outputs of `X` as float32."""
    if BACKEND == "torch":
        import torch

        path = tmp_path / "served.pt2"
        # Keras' torch export traces one batch size unless told the
        # shapes: the batch served here.
        kdp.export_for_serving(
            model,
            path,
            format="torch",
            policy=policy,
            input_signature=[keras.InputSpec(shape=X.shape, dtype="float32")],
        )
        program = torch.export.load(str(path)).module()
        with torch.no_grad():
            served = program(torch.from_numpy(X))
        return served.float().numpy()
    if importlib.util.find_spec("tensorflow") is None:
        pytest.skip(
            "Keras exports a SavedModel from JAX through jax2tf, which needs "
            "TensorFlow; this environment has none"
        )
    import tensorflow as tf

    path = tmp_path / "served"
    kdp.export_for_serving(model, path, policy=policy)
    # Held: a loaded SavedModel's functions need its object alive.
    loaded = tf.saved_model.load(str(path))
    return tf.cast(loaded.serve(tf.constant(X)), "float32").numpy()


@pytest.mark.parametrize("configuration", sorted(CONFIGURATIONS))
def test_served_in_the_training_dtype_computes_what_the_model_does(
    configuration, tmp_path
):
    model = trained(configuration)
    served = exported_and_served(model, tmp_path, policy=None)
    # The same weights and compute dtype; the exported graph may order a
    # sum differently: within the compute dtype's rounding.
    np.testing.assert_allclose(served, predicted(model), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("configuration", ["kahan_bfloat16"])
def test_served_in_float32_computes_the_weights_in_float32(
    configuration, tmp_path
):
    model = trained(configuration)
    served = exported_and_served(model, tmp_path, policy="float32")
    # The reference: the float32 model `save_for_keras` writes, loaded by
    # Keras and run in float32.
    reference = float32_reference(model, tmp_path / "float32.keras")
    np.testing.assert_allclose(
        served, predicted(reference), rtol=1e-5, atol=1e-5
    )
    # And not the bfloat16 computation.
    assert np.max(np.abs(served - predicted(model))) > 0
    # The trained model is left as it was.
    assert model.layers[0].dtype_policy.name == "kahan_bfloat16"


def test_export_refuses_a_non_string_format(tmp_path):
    model = trained("kahan_bfloat16")
    with pytest.raises(TypeError, match="format=3"):
        kdp.export_for_serving(model, tmp_path / "x", format=3)
    with pytest.raises(TypeError, match="keras.Model"):
        kdp.export_for_serving("model.keras", tmp_path / "x")
