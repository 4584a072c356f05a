"""`export_for_serving(..., format="litert")`, run by the LiteRT interpreter.

Keras converts a TensorFlow function with `tf.lite.TFLiteConverter` on
TensorFlow, and through `litert_torch` on PyTorch; it has no LiteRT export
on JAX. The files are served by `ai_edge_litert`'s interpreter where
installed, else by the one TensorFlow ships (`tf.lite.Interpreter`).

What each configuration serves on TensorFlow (tensorflow-cpu 2.21):
- `policy="float32"`: every configuration, computing what the float32
  model `save_for_keras` writes (within 1e-5);
- `policy="float32"` with the converter's float16 weights (the
  `optimizations` and `target_spec` arguments go to the converter): a
  file of float16 weights that computes in float32;
- `policy=None` under a bfloat16 or float16 policy: the converter keeps
  the half-precision matrix products as TensorFlow ("Flex") ops, which the
  interpreter refuses without the Flex delegate; Keras alone's
  `mixed_float16` model fails the same way.

On PyTorch (`tox -e litert-torch`: litert-torch pulls JAX and
transformers, so no default env installs it; elsewhere the tests skip
saying so), Keras converts with `litert_torch` for a fixed input shape:
`policy="float32"` serves every configuration's float32 model (within
1e-5), a float16 model serves float16, and a bfloat16 graph is refused
by the converter ("unsupported ScalarType BFloat16"), Keras alone's too.
"""

import importlib.util
import warnings

import keras
import numpy as np
import pytest
from serving_models import CONFIGURATIONS
from serving_models import X
from serving_models import assert_serves_float16
from serving_models import assert_serves_the_float32_model
from serving_models import float32_reference
from serving_models import predicted
from serving_models import trained
from testing import BACKEND

import keras_dtype_policy as kdp

FLEX_REFUSED = "Select TensorFlow op|Flex"


def require_converter(tensorflow_only=None):
    """Skips where Keras cannot convert here: JAX, PyTorch without
    litert_torch, or PyTorch for a TensorFlow converter's test."""
    if BACKEND == "jax":
        pytest.skip("Keras has no LiteRT export on JAX (tested below)")
    if BACKEND == "torch":
        if tensorflow_only:
            pytest.skip(tensorflow_only)
        if importlib.util.find_spec("litert_torch") is None:
            pytest.skip(
                "Keras' LiteRT export on PyTorch needs litert_torch, which "
                "pulls JAX and transformers: `tox -e litert-torch` installs "
                "it"
            )


def interpreter(path):
    """A LiteRT interpreter of the file at `path`, its tensors allocated."""
    try:
        from ai_edge_litert.interpreter import Interpreter
    except ImportError:
        import tensorflow as tf

        Interpreter = tf.lite.Interpreter
    with warnings.catch_warnings():
        # TensorFlow's interpreter warns that it moved to ai_edge_litert.
        warnings.simplefilter("ignore", UserWarning)
        served = Interpreter(model_path=str(path))
    served.allocate_tensors()
    return served


def served(path):
    """The outputs of the file at `path` on `X`."""
    runner = interpreter(path).get_signature_runner()
    (name,) = runner.get_input_details()
    (outputs,) = runner(**{name: X}).values()
    return outputs


def exported(model, tmp_path, policy, **converter):
    path = tmp_path / "served.tflite"
    if BACKEND == "torch":
        # litert_torch converts for fixed shapes (Keras sets an unknown
        # batch to 1): the batch served here.
        converter["input_signature"] = [
            keras.InputSpec(shape=X.shape, dtype="float32")
        ]
    kdp.export_for_serving(
        model, path, format="litert", policy=policy, verbose=False, **converter
    )
    return path


@pytest.mark.parametrize("configuration", sorted(CONFIGURATIONS))
def test_served_in_float32_computes_the_float32_model(configuration, tmp_path):
    require_converter()
    model = trained(configuration)
    outputs = served(exported(model, tmp_path, policy="float32"))
    assert_serves_the_float32_model(outputs, model, tmp_path)


def test_converter_float16_weights_serve_the_float32_model(tmp_path):
    require_converter(
        tensorflow_only="TensorFlow's TFLiteConverter arguments "
        "(litert_torch takes a quant_config instead)"
    )
    import tensorflow as tf

    # bfloat16 weights without compensation: float16 holds them exactly.
    model = trained("stochastic_bfloat16_8bit")
    path = exported(
        model,
        tmp_path,
        policy="float32",
        optimizations=[tf.lite.Optimize.DEFAULT],
        target_spec={"supported_types": [tf.float16]},
    )
    kernels = [
        detail["dtype"]
        for detail in interpreter(path).get_tensor_details()
        if tuple(detail["shape"]) in ((12, 32), (32, 12), (32, 4), (4, 32))
    ]
    assert np.float16 in kernels
    outputs = served(path)
    assert outputs.dtype == np.float32
    reference = float32_reference(model, tmp_path / "float32.keras")
    np.testing.assert_allclose(
        outputs, predicted(reference), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("configuration", ["kahan_bfloat16", "kahan_float16"])
def test_half_precision_graph_needs_the_flex_delegate(configuration, tmp_path):
    require_converter(
        tensorflow_only="TensorFlow's converter keeps the half-precision "
        "products as Flex ops; litert_torch's graph is its own"
    )
    model = trained(configuration)
    with pytest.raises(RuntimeError, match=FLEX_REFUSED):
        served(exported(model, tmp_path, policy=None))
    # Keras alone's mixed_float16 model meets the same refusal.
    alone = keras.Sequential(
        [keras.Input((12,)), keras.layers.Dense(4, dtype="mixed_float16")]
    )
    path = tmp_path / "keras_alone.tflite"
    alone.export(str(path), format="litert", verbose=False)
    with pytest.raises(RuntimeError, match=FLEX_REFUSED):
        served(path)


def test_jax_has_no_litert_export(tmp_path):
    if BACKEND != "jax":
        pytest.skip("Keras' refusal on JAX: the JAX run's")
    model = trained("kahan_bfloat16")
    path = tmp_path / "served.tflite"
    with pytest.raises(ValueError, match="TensorFlow or PyTorch"):
        kdp.export_for_serving(model, path, format="litert", policy="float32")
    assert not path.exists()


def test_torch_serves_float16_and_refuses_bfloat16(tmp_path):
    if BACKEND != "torch":
        pytest.skip("litert_torch's half-precision graphs: the torch run's")
    require_converter()
    model = trained("kahan_float16")
    assert_serves_float16(served(exported(model, tmp_path, policy=None)), model)
    # litert_torch has no bfloat16 ("unsupported ScalarType BFloat16"),
    # with or without the package: serve such a model in float32.
    with pytest.raises(RuntimeError, match="BFloat16"):
        exported(trained("kahan_bfloat16"), tmp_path, policy=None)
    alone = keras.Sequential(
        [keras.Input((12,)), keras.layers.Dense(4, dtype="bfloat16")]
    )
    with pytest.raises(RuntimeError, match="BFloat16"):
        alone.export(
            str(tmp_path / "keras_alone.tflite"),
            format="litert",
            verbose=False,
            input_signature=[keras.InputSpec(shape=X.shape, dtype="float32")],
        )
