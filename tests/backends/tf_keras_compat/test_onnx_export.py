"""`export_for_serving(..., format="onnx")`, served by ONNX Runtime.

Keras exports ONNX through each backend's own converter: `torch.onnx`
(with onnxscript) on PyTorch, tf2onnx on TensorFlow, jax2onnx on JAX.
None of them is a test dependency of the backends' default environments
but PyTorch's (onnx, onnxruntime and onnxscript are small); `tox -e
onnx-tensorflow` and `tox -e onnx-jax` install the others. Where the
converter or ONNX Runtime is missing, the tests skip with that reason.

What each configuration serves (ONNX Runtime 1.30+, CPU):
- `policy="float32"`: every configuration, computing what the float32
  model `save_for_keras` writes (within 1e-5);
- `policy=None` under a float16 policy: a float16 graph, within float16's
  rounding of `predict`;
- `policy=None` under a bfloat16 policy: the file holds bfloat16 weights,
  but ONNX Runtime's CPU provider has no bfloat16 kernel for most
  operators (Relu, MatMul): serve such a model with `policy="float32"`.
"""

import importlib.util

import pytest
from serving_models import CONFIGURATIONS
from serving_models import X
from serving_models import assert_serves_float16
from serving_models import assert_serves_the_float32_model
from serving_models import trained
from testing import BACKEND

import keras_dtype_policy as kdp

CONVERTER = {"torch": "onnxscript", "tensorflow": "tf2onnx", "jax": "jax2onnx"}


def require_onnx():
    for module in ("onnx", "onnxruntime", CONVERTER[BACKEND]):
        if importlib.util.find_spec(module) is None:
            pytest.skip(
                f"{module} is not installed: Keras' ONNX export on "
                f"{BACKEND} needs it (`tox -e onnx-{BACKEND}` installs it)"
            )


def exported(model, tmp_path, policy):
    path = tmp_path / "served.onnx"
    kdp.export_for_serving(
        model, path, format="onnx", policy=policy, verbose=False
    )
    return path


def served(path):
    import onnxruntime

    session = onnxruntime.InferenceSession(
        str(path), providers=["CPUExecutionProvider"]
    )
    name = session.get_inputs()[0].name
    (outputs,) = session.run(None, {name: X})
    return outputs


@pytest.mark.parametrize("configuration", sorted(CONFIGURATIONS))
def test_served_in_float32_computes_the_float32_model(configuration, tmp_path):
    require_onnx()
    model = trained(configuration)
    outputs = served(exported(model, tmp_path, policy="float32"))
    assert_serves_the_float32_model(outputs, model, tmp_path)
    # The trained model is left as it was.
    assert model.optimizer.iterations.numpy() == 4


def test_float16_model_served_in_float16(tmp_path):
    require_onnx()
    model = trained("kahan_float16")
    assert_serves_float16(served(exported(model, tmp_path, policy=None)), model)


def test_bfloat16_model_keeps_bfloat16_weights_in_the_file(tmp_path):
    require_onnx()
    import onnx

    model = trained("kahan_bfloat16")
    graph = onnx.load(str(exported(model, tmp_path, policy=None))).graph
    weights = [tensor for tensor in graph.initializer if len(tensor.dims) == 2]
    assert weights
    assert {tensor.data_type for tensor in weights} == {
        onnx.TensorProto.BFLOAT16
    }
