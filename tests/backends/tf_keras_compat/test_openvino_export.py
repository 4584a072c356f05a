"""`export_for_serving(..., format="openvino")`, run by OpenVINO on the CPU.

Keras converts through `torch.jit.trace` on PyTorch and a TensorFlow
function on TensorFlow and JAX (jax2tf: TensorFlow must be installed
beside JAX). The `torch` env installs OpenVINO; `tox -e
openvino-tensorflow` and `tox -e openvino-jax` run the others. Where
OpenVINO (or TensorFlow, on JAX) is missing, the tests skip with that
reason.

What each configuration serves (OpenVINO 2026.4, compiled with the
float32 precision hint, without which a CPU with bfloat16 instructions
computes in bfloat16):
- `policy="float32"`: every configuration, computing what the float32
  model `save_for_keras` writes (within 1e-5);
- `policy=None` under a float16 policy: a float16 graph, within float16's
  rounding of `predict`;
- `policy=None` under a bfloat16 policy: on PyTorch a bfloat16 graph
  whose outputs OpenVINO's Python API hands out as a float16 numpy array
  holding bfloat16 bits (read them with
  `.view(np.uint16).view(ml_dtypes.bfloat16)`); on TensorFlow the
  conversion of the bfloat16 graph fails. Serve such a model with
  `policy="float32"`.

On JAX, Keras' OpenVINO export fails for every model, with or without
the package (Keras 3.15.1, JAX 0.10.2, OpenVINO 2026.4): jax2tf emits
an `XlaCallModule` op, which OpenVINO does not convert, although Keras
asks for `native_serialization=False`. The JAX run checks that failure,
so that a release that mends it shows here.
"""

import importlib.util

import ml_dtypes
import numpy as np
import pytest
from serving_models import CONFIGURATIONS
from serving_models import X
from serving_models import assert_serves_float16
from serving_models import assert_serves_the_float32_model
from serving_models import predicted
from serving_models import trained
from testing import BACKEND

import keras_dtype_policy as kdp


def require_openvino(jax_too=False):
    needed = ["openvino"] + (["tensorflow"] if BACKEND == "jax" else [])
    for module in needed:
        if importlib.util.find_spec(module) is None:
            pytest.skip(
                f"{module} is not installed: Keras' OpenVINO export on "
                f"{BACKEND} needs it (`tox -e openvino-{BACKEND}` installs it)"
            )
    if BACKEND == "jax" and not jax_too:
        pytest.skip(
            "Keras' OpenVINO export fails on JAX with or without the "
            "package (see the module's docstring and "
            "test_jax_export_fails_in_keras_own_conversion)"
        )


def exported(model, tmp_path, policy):
    path = tmp_path / "served.xml"
    kdp.export_for_serving(
        model, path, format="openvino", policy=policy, verbose=False
    )
    return path


def served(path):
    import openvino

    # OpenVINO's CPU plugin computes in bfloat16 by default on a CPU with
    # bfloat16 instructions (AVX512_BF16 or AMX: 5e-3 off the float32
    # model on the Xeon of 2026-11-29); float32 is asked for, as a user who
    # needs the model's numbers must.
    compiled = openvino.Core().compile_model(
        str(path), "CPU", {"INFERENCE_PRECISION_HINT": "f32"}
    )
    return compiled(X)[0]


@pytest.mark.parametrize("configuration", sorted(CONFIGURATIONS))
def test_served_in_float32_computes_the_float32_model(configuration, tmp_path):
    require_openvino()
    model = trained(configuration)
    outputs = served(exported(model, tmp_path, policy="float32"))
    assert_serves_the_float32_model(outputs, model, tmp_path)


def test_float16_model_served_in_float16(tmp_path):
    require_openvino()
    model = trained("kahan_float16")
    assert_serves_float16(served(exported(model, tmp_path, policy=None)), model)


def test_bfloat16_model_served_in_bfloat16(tmp_path):
    require_openvino()
    model = trained("kahan_bfloat16")
    if BACKEND != "torch":
        # OpenVINO does not convert the bfloat16 TensorFlow function.
        with pytest.raises(Exception, match="(?i)conver|bf16|bfloat16"):
            served(exported(model, tmp_path, policy=None))
        return
    outputs = served(exported(model, tmp_path, policy=None))
    # bfloat16 bits in a float16 array: numpy has no bfloat16.
    assert outputs.dtype == np.float16
    values = outputs.view(np.uint16).view(ml_dtypes.bfloat16)
    np.testing.assert_allclose(
        values.astype("float32"), predicted(model), rtol=2e-2, atol=2e-2
    )


def test_jax_export_fails_in_keras_own_conversion(tmp_path):
    if BACKEND != "jax":
        pytest.skip("what JAX's jax2tf emits: the JAX run's")
    require_openvino(jax_too=True)
    model = trained("kahan_bfloat16")
    with pytest.raises(Exception, match="XlaCallModule"):
        exported(model, tmp_path, policy="float32")
