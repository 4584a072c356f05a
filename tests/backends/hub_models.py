"""Tiny keras-hub tasks built from config, and data for them.

Nothing is downloaded. Import it only where keras-hub is installed (the
tests that do skip first with `pytest.importorskip("keras_hub")`).
"""

import keras
import keras_hub
import numpy as np

VOCABULARY, LENGTH = 50, 8


# The size of every tiny backbone: seconds to build and train.
TINY = {
    "vocabulary_size": VOCABULARY,
    "num_layers": 2,
    "num_heads": 2,
    "hidden_dim": 16,
    "intermediate_dim": 32,
    "max_sequence_length": 16,
}


def gpt2_causal_lm():
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(**TINY)
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def bert_classifier():
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.BertBackbone(**TINY)
    return keras_hub.models.BertTextClassifier(
        backbone=backbone, num_classes=2, preprocessor=None
    )


def causal_lm_data():
    rng = np.random.default_rng(0)
    token_ids = rng.integers(1, VOCABULARY, size=(4, LENGTH + 1))
    x = {
        "token_ids": token_ids[:, :-1].astype("int32"),
        "padding_mask": np.ones((4, LENGTH), "bool"),
    }
    return x, token_ids[:, 1:].astype("int32")


def classifier_data():
    rng = np.random.default_rng(0)
    x = {
        "token_ids": rng.integers(1, VOCABULARY, (4, LENGTH)).astype("int32"),
        "segment_ids": np.zeros((4, LENGTH), "int32"),
        "padding_mask": np.ones((4, LENGTH), "bool"),
    }
    return x, np.array([0, 1, 0, 1], "int32")
