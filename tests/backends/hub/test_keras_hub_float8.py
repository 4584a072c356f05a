"""keras-hub models under a global float8 policy: trained, saved, reloaded.

keras-hub backbones make their layers in code and pass their `dtype` to
each; under `float8_from_mixed_bfloat16` their Dense and EinsumDense layers
train in float8 and every other layer, the backbone and the task included,
in mixed_bfloat16. keras-hub saves the float8 layers of a backbone in a
`DTypePolicyMap` whose policies take their source from the global policy
when the file is loaded (as for a model that Keras' `quantize("float8")`
made): the file is loaded under the source policy. The expectations are
the same on every backend. Tiny models built from config: nothing is
downloaded; `tox -e keras-hub` runs this file once per backend.
"""

import keras
import numpy as np
import pytest

import keras_dtype_policy as kdp
from keras_dtype_policy.policies import layer_walk

keras_hub = pytest.importorskip(
    "keras_hub", reason="keras-hub is not installed (the `hub` extra)"
)
from hub_models import bert_classifier  # noqa: E402
from hub_models import causal_lm_data  # noqa: E402
from hub_models import classifier_data  # noqa: E402
from hub_models import gpt2_causal_lm  # noqa: E402

FLOAT8 = "float8_from_mixed_bfloat16"


def float8_layers(model):
    return {
        path
        for path, layer in layer_walk.layer_paths(model)
        if layer.quantization_mode == "float8"
    }


def values(model):
    return [keras.ops.convert_to_numpy(w.value) for w in model.weights]


def train(task, data):
    x, y = data
    task.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    before = task.evaluate(x, y, verbose=0)
    task.fit(x, y, batch_size=4, epochs=3, verbose=0)
    return before, task.evaluate(x, y, verbose=0)


def test_gpt2_trains_saves_and_reloads_under_a_float8_policy(tmp_path):
    kdp.set_dtype_policy(FLOAT8)
    task = gpt2_causal_lm()
    found = float8_layers(task)
    classes = {
        type(layer).__name__
        for path, layer in layer_walk.layer_paths(task)
        if path in found
    }
    assert classes == {"Dense", "EinsumDense"}
    for path, layer in layer_walk.layer_paths(task):
        if path not in found:
            assert layer.compute_dtype in ("bfloat16", "float32"), path
            assert layer.quantization_mode is None, path
    assert task.dtype_policy.name == "mixed_bfloat16"
    before, after = train(task, causal_lm_data())
    assert after < before
    path = tmp_path / "gpt2.keras"
    task.save(path)
    # Saving leaves the global policy as it was (keras-hub's policy map
    # writes into the float8 policies it saves).
    assert kdp.dtype_policy().name == FLOAT8
    kdp.set_dtype_policy("float32")
    with kdp.policy_scope("mixed_bfloat16"):
        reloaded = keras.saving.load_model(path)
    assert float8_layers(reloaded) == found
    for left, right in zip(values(task), values(reloaded), strict=True):
        np.testing.assert_array_equal(left, right)
    x, _ = causal_lm_data()
    np.testing.assert_array_equal(
        np.asarray(task.predict(x, verbose=0), "float32"),
        np.asarray(reloaded.predict(x, verbose=0), "float32"),
    )


def test_bert_classifier_keeps_its_head_out_of_float8_by_a_rule(tmp_path):
    """keras-hub makes a task's head outside its backbone's policy map, so
    a float8 head does not reload (keras-hub's own `quantize("float8")`
    fails the same way); a rule keeps it in mixed_bfloat16."""
    rules = kdp.PrecisionRules(FLOAT8).extend(
        kdp.PrecisionRule("mixed_bfloat16", names="logits")
    )
    with kdp.precision_scope(rules):
        task = bert_classifier()
    assert task.get_layer("logits").quantization_mode is None
    found = float8_layers(task)
    assert found
    before, after = train(task, classifier_data())
    assert after < before
    path = tmp_path / "bert.keras"
    task.save(path)
    with kdp.policy_scope("mixed_bfloat16"):
        reloaded = keras.saving.load_model(path)
    assert float8_layers(reloaded) == found
    x, y = classifier_data()
    np.testing.assert_array_equal(
        np.asarray(task.predict(x, verbose=0), "float32"),
        np.asarray(reloaded.predict(x, verbose=0), "float32"),
    )
    reloaded.fit(x, y, batch_size=4, verbose=0)
