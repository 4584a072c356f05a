"""The audit and precision rules inside keras-hub tasks (tiny, from config).

keras-hub backbones and tasks are functional models whose layers hold
layers (TransformerEncoder, MultiHeadAttention, EinsumDense): the audit
has one row per leaf, by path, and its recommended rules reach exactly
those leaves. Every expectation holds on each backend.
"""

import numpy as np
import pytest

keras_hub = pytest.importorskip(
    "keras_hub", reason="the keras-hub tests need keras-hub (the tox env)"
)

import keras  # noqa: E402

import keras_dtype_policy as kdp  # noqa: E402
from keras_dtype_policy.policies import rules_application  # noqa: E402

BATCH = 8
LENGTH = 16


def bert_classifier():
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=50,
        num_layers=2,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=LENGTH,
    )
    return keras_hub.models.BertTextClassifier(
        backbone, num_classes=2, preprocessor=None
    )


def gpt2_causal_lm():
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=50,
        num_layers=2,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=LENGTH,
    )
    return keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)


def token_inputs(with_segments):
    rng = np.random.default_rng(0)
    inputs = {
        "token_ids": rng.integers(0, 50, (BATCH, LENGTH)).astype("int32"),
        "padding_mask": np.ones((BATCH, LENGTH), "int32"),
    }
    if with_segments:
        inputs["segment_ids"] = np.zeros((BATCH, LENGTH), "int32")
    return inputs


def leaves(model):
    """The leaf layers as Keras walks them, apart from the audit's walk."""
    return [
        layer
        for layer in model._flatten_layers(include_self=False)
        if not isinstance(layer, keras.layers.InputLayer)
        and not list(layer._flatten_layers(include_self=False))
    ]


def policies_by_path(copy, model):
    """The policies of a copy's layers, by their paths in `model` (Keras
    names some layers anew in each copy: MultiHeadAttention's softmax)."""
    return {
        path: layer.dtype_policy.name
        for layer, path in rules_application.zip_layer_paths(
            copy, model, "the test"
        )
    }


# keras-hub names the attention block of an encoder and of a decoder
# differently.
TASKS = {
    "bert": (bert_classifier, True, "self_attention_layer"),
    "gpt2": (gpt2_causal_lm, False, "self_attention"),
}


@pytest.mark.parametrize("name", sorted(TASKS))
def test_the_audit_has_a_row_per_leaf_of_a_task(name):
    build, segments, attention = TASKS[name]
    task = build()
    table = kdp.audit(task, "mixed_float16", x=token_inputs(segments))
    paths = [row.path for row in table]
    assert len(table) == len(leaves(task))
    assert len(set(paths)) == len(paths)
    backbone = task.backbone.name
    query = f"{backbone}/transformer_layer_0/{attention}/query"
    assert table.row(query).class_name == "EinsumDense"
    assert table.row(query).compute_dtype == "float16"
    assert f"{backbone}/transformer_layer_1/feedforward_output_dense" in paths
    assert table.safe, table.reasons


def test_an_overflowing_leaf_is_flagged_and_the_rules_reach_it_alone():
    task = bert_classifier()
    dense = task.backbone.get_layer("transformer_layer_1")
    dense = dense._feedforward_intermediate_dense
    dense.kernel.assign(keras.ops.convert_to_numpy(dense.kernel) * 1e6)
    table = kdp.audit(task, "mixed_float16", x=token_inputs(True))
    flagged = table.keep_float32
    path = "bert_backbone/transformer_layer_1/feedforward_intermediate_dense"
    assert path in flagged
    # Only layers of the second transformer layer, where the values are
    # large, are flagged; the same names in the first one are not.
    assert all(
        p.startswith("bert_backbone/transformer_layer_1/") for p in flagged
    )
    before = policies_by_path(kdp.apply_rules(task, table.rules), task)
    fixed = kdp.apply_rules(task, table.recommended_rules)
    after = policies_by_path(fixed, task)
    changed = sorted(p for p in after if after[p] != before[p])
    assert changed == sorted(flagged)
    assert all(after[p] == "float32" for p in flagged)


def test_a_task_and_its_backbone_report_the_policy_of_their_layers(tmp_path):
    task = bert_classifier()
    converted = kdp.apply_rules(task, "mixed_float16")
    assert converted.dtype_policy.name == "mixed_float16"
    assert converted.backbone.dtype_policy.name == "mixed_float16"
    assert {layer.compute_dtype for layer in leaves(converted)} == {"float16"}
    path = tmp_path / "bert.keras"
    task.save(path)
    loaded = kdp.load_model(path, policy="mixed_float16")
    assert loaded.compute_dtype == "float16"
    assert loaded.backbone.compute_dtype == "float16"
    # The layers still compute as they did: the containers' policy casts
    # no input (a functional model converts to its inputs' dtypes).
    inputs = token_inputs(True)
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(loaded(inputs)).astype("float32"),
        keras.ops.convert_to_numpy(converted(inputs)).astype("float32"),
        rtol=1e-3,
        atol=1e-3,
    )
