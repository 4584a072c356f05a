"""float16 layers deep inside a keras-hub backbone get loss scaling.

A keras-hub backbone is a functional model whose transformer blocks are
custom layers holding their attention and Dense layers as attributes,
out of every model's `layers`. Here only the attention layers inside the
blocks, and their own layers, compute in float16 (a precision rule by
path; the dropout after each casts back to float32 before the residual
add, which TensorFlow needs in one dtype): compiling the task still
installs a `LossScaleOptimizer`, and a step trains. Tiny models built from
config: nothing is downloaded; `tox -e keras-hub` runs this file once per
backend.
"""

import keras
import numpy as np
import pytest

import keras_dtype_policy as kdp
from keras_dtype_policy.policies import layer_walk

keras_hub = pytest.importorskip(
    "keras_hub", reason="keras-hub is not installed (the `hub` extra)"
)
from hub_models import causal_lm_data  # noqa: E402
from hub_models import gpt2_causal_lm  # noqa: E402

# The blocks' attention layers and theirs; the blocks and models stay
# float32.
BLOCK = "gpt2_backbone/transformer_layer_*"
ATTENTION_IN_FLOAT16 = kdp.PrecisionRules(
    "float32",
    [
        kdp.PrecisionRule(
            "mixed_float16",
            paths=(f"{BLOCK}/self_attention", f"{BLOCK}/self_attention/*"),
        )
    ],
)


def layers_through_models(model):
    """The layers reached through `layers` alone (models only have it)."""
    for layer in getattr(model, "layers", ()):
        yield layer
        yield from layers_through_models(layer)


def test_float16_layers_inside_a_backbone_get_a_loss_scale_optimizer():
    task = kdp.apply_rules(gpt2_causal_lm(), ATTENTION_IN_FLOAT16)
    float16 = [
        path
        for path, layer in layer_walk.layer_paths(task)
        if layer.compute_dtype == "float16"
    ]
    assert "gpt2_backbone/transformer_layer_0/self_attention/query" in float16
    assert "gpt2_backbone/transformer_layer_0" not in float16
    assert task.compute_dtype == "float32"
    assert task.backbone.compute_dtype == "float32"
    assert not any(
        layer.compute_dtype == "float16"
        for layer in layers_through_models(task)
    ), "the float16 layers must be out of every model's `layers`"
    task.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    assert isinstance(task.optimizer, kdp.LossScaleOptimizer)
    x, y = causal_lm_data()
    before = [keras.ops.convert_to_numpy(w) for w in task.trainable_weights]
    task.fit(x, y, batch_size=4, epochs=1, verbose=0)
    after = [keras.ops.convert_to_numpy(w) for w in task.trainable_weights]
    assert all(np.all(np.isfinite(value)) for value in after)
    assert any(
        not np.array_equal(old, new)
        for old, new in zip(before, after, strict=True)
    )
