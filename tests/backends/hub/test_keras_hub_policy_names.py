"""keras-hub backbones given this package's policy names as `dtype=`.

keras-hub resolves a backbone's `dtype=` through the public
`keras.dtype_policies.get` and passes the same `dtype` to every layer it
makes. "kahan_bfloat16" and "stochastic_bfloat16" give bfloat16 weights
and, when the task is compiled, a `LowPrecisionOptimizer`;
"float8_from_mixed_bfloat16" trains the backbone's Dense and EinsumDense
layers in float8 and gives the backbone itself the source policy (Keras
would quantize the already float8 layers again and fail). Through the
constructor and through `from_preset` of a preset saved here. Tiny models
built from config: nothing is downloaded; `tox -e keras-hub` runs this
file once per backend.
"""

import keras
import numpy as np
import pytest

import keras_dtype_policy as kdp
from keras_dtype_policy.policies import layer_walk
from keras_dtype_policy.policies.float8 import Float8SourcePolicy

keras_hub = pytest.importorskip(
    "keras_hub", reason="keras-hub is not installed (the `hub` extra)"
)
from hub_models import TINY  # noqa: E402
from hub_models import causal_lm_data  # noqa: E402

# Policy name -> the update and the state dtype of the optimizer the
# compile hook installs.
LOW_PRECISION = {
    "kahan_bfloat16": ("kahan", None),
    "stochastic_bfloat16": ("stochastic_rounding", None),
    "stochastic_bfloat16_8bit": ("stochastic_rounding", "8bit"),
}
FLOAT8 = "float8_from_mixed_bfloat16"


def float_weight_dtypes(model):
    return {
        w.dtype for w in model.weights if keras.backend.is_float_dtype(w.dtype)
    }


def float8_layers(model):
    return {
        path
        for path, layer in layer_walk.layer_paths(model)
        if layer.quantization_mode == "float8"
    }


def compiled_task(backbone):
    task = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    task.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return task


def train(backbone):
    """Compiles a causal LM task on `backbone`, trains it 3 steps."""
    task = compiled_task(backbone)
    x, y = causal_lm_data()
    before = [keras.ops.convert_to_numpy(w.value) for w in task.weights]
    history = task.fit(x, y, batch_size=4, epochs=3, verbose=0)
    after = [keras.ops.convert_to_numpy(w.value) for w in task.weights]
    assert np.all(np.isfinite(history.history["loss"]))
    assert any(
        not np.array_equal(old, new)
        for old, new in zip(before, after, strict=True)
    )
    return task


def gpt2(dtype):
    keras.utils.set_random_seed(0)
    return keras_hub.models.GPT2Backbone(**TINY, dtype=dtype)


def saved_preset(tmp_path, dtype=None):
    """A GPT-2 preset saved under `tmp_path` (float32 by default)."""
    preset = tmp_path / "gpt2_preset"
    gpt2(dtype).save_to_preset(str(preset))
    return str(preset)


def check_low_precision(backbone, name, fit=True):
    """The policy, the weights' dtype, the optimizer the compile hook
    installs, and (with `fit`) 3 training steps."""
    assert backbone.dtype_policy == kdp.DTypePolicy(name)
    assert type(backbone.dtype_policy) is kdp.DTypePolicy
    assert float_weight_dtypes(backbone) == {"bfloat16"}
    task = train(backbone) if fit else compiled_task(backbone)
    assert isinstance(task.optimizer, kdp.LowPrecisionOptimizer)
    update, state_dtype = LOW_PRECISION[name]
    assert task.optimizer.update == update
    assert task.optimizer.state_dtype == state_dtype


def check_float8(backbone, fit=True):
    assert isinstance(backbone.dtype_policy, Float8SourcePolicy)
    assert backbone.dtype_policy == keras.DTypePolicy("mixed_bfloat16")
    assert backbone.dtype_policy.float8_policy.name == FLOAT8
    found = float8_layers(backbone)
    classes = {
        type(layer).__name__
        for path, layer in layer_walk.layer_paths(backbone)
        if path in found
    }
    assert classes == {"Dense", "EinsumDense"}
    # The same layers as under a global float8 policy (the package's
    # float8 training of `test_keras_hub_float8.py`).
    with kdp.policy_scope(FLOAT8):
        assert float8_layers(gpt2(None)) == found
    if fit:
        train(backbone)


@pytest.mark.parametrize("name", sorted(LOW_PRECISION))
def test_a_backbone_trains_under_a_low_precision_name(name):
    check_low_precision(gpt2(name), name)


@pytest.mark.parametrize("name", sorted(LOW_PRECISION))
def test_from_preset_takes_a_low_precision_name(tmp_path, name):
    preset = saved_preset(tmp_path)
    saved = gpt2(None)
    backbone = keras_hub.models.Backbone.from_preset(preset, dtype=name)
    assert isinstance(backbone, keras_hub.models.GPT2Backbone)
    for loaded, original in zip(backbone.weights, saved.weights, strict=True):
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(keras.ops.cast(loaded, "float32")),
            keras.ops.convert_to_numpy(
                keras.ops.cast(keras.ops.cast(original, "bfloat16"), "float32")
            ),
        )
    # Training is the constructor's test: the same backbone.
    check_low_precision(backbone, name, fit=False)


def test_a_backbone_trains_in_float8_under_a_float8_name():
    check_float8(gpt2(FLOAT8))


def test_from_preset_takes_a_float8_name(tmp_path):
    # A float8 preset: a float one lacks the float8 layers' scales, which
    # Keras' `quantize("float8")` makes after a float preset is loaded.
    preset = saved_preset(tmp_path, FLOAT8)
    check_float8(
        keras_hub.models.GPT2Backbone.from_preset(preset, dtype=FLOAT8),
        fit=False,
    )
