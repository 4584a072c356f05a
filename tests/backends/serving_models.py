"""A small model trained under each configuration, for the export tests.

`tf_keras_compat/test_serving_export.py` (SavedModel, `ExportedProgram`)
and `tf_keras_compat/test_onnx_export.py` serve it.
"""

import keras
import numpy as np

import keras_dtype_policy as kdp

# A policy name, or the `LowPrecisionOptimizer` arguments of a
# `mixed_bfloat16` model.
CONFIGURATIONS = {
    "kahan_bfloat16": None,
    "stochastic_bfloat16_8bit": None,
    "kahan_float16": None,
    "mixed_bfloat16_8bit": {"update": "nearest", "state_dtype": "8bit"},
}
X = np.random.RandomState(0).randn(16, 12).astype("float32")
Y = np.tanh(X[:, :4])


def trained(configuration):
    """A two-layer model trained two epochs under `configuration`."""
    arguments = CONFIGURATIONS[configuration]
    policy = "mixed_bfloat16" if arguments else configuration
    keras.utils.set_random_seed(0)
    with kdp.policy_scope(policy):
        model = keras.Sequential(
            [
                keras.Input((12,)),
                keras.layers.Dense(32, activation="relu"),
                keras.layers.Dense(4),
            ]
        )
    optimizer = keras.optimizers.Adam(1e-2)
    if arguments:
        optimizer = kdp.LowPrecisionOptimizer(optimizer, **arguments)
    model.compile(optimizer, "mse")
    model.fit(X, Y, batch_size=8, epochs=2, verbose=0)
    return model


def predicted(model):
    """`model.predict(X)` as float32 numpy."""
    return keras.ops.convert_to_numpy(
        keras.ops.cast(model.predict(X, verbose=0), "float32")
    )


def float32_reference(model, path):
    """The float32 model `save_for_keras` writes, loaded by Keras: the
    weights with their Kahan compensation added, in float32."""
    kdp.save_for_keras(model, path, policy="float32")
    reference = keras.saving.load_model(path)
    assert reference.layers[0].dtype_policy.compute_dtype == "float32"
    return reference


def assert_serves_the_float32_model(outputs, model, tmp_path):
    """`outputs`, served of `X` with `policy="float32"`, are float32 and
    within 1e-5 of the float32 model's."""
    assert outputs.dtype == np.float32
    reference = float32_reference(model, tmp_path / "float32.keras")
    np.testing.assert_allclose(
        outputs, predicted(reference), rtol=1e-5, atol=1e-5
    )


def assert_serves_float16(outputs, model):
    """`outputs`, served of `X` from a float16 model, are float16 and
    within float16's rounding of `model.predict`."""
    assert outputs.dtype == np.float16
    np.testing.assert_allclose(
        outputs.astype("float32"), predicted(model), rtol=5e-3, atol=5e-3
    )
