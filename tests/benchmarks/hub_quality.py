"""Quality of the low-precision policies on keras-hub models.

Two keras-hub models built from configs (nothing downloaded), trained
from the same initial weights on the same batches under each
configuration, Adam at 3e-3, dropout 0; the score is the loss on
held-out batches after training (lower is better):

- gpt2: `GPT2CausalLM` (2 layers, hidden 64, 2 heads, vocabulary 64) on
  next-token prediction of sequences `x[t + 1] = x[t] + 1 (mod 64)` from
  random starts, 48 steps of batch 32;
- bert: `BertTextClassifier` (2 layers, hidden 64) on sequences of random
  tokens labelled by whether the first token is below 32, 48 steps of
  batch 32.

Skipped, with the reason in the results, where keras-hub is not
installed. Import this module only once `KERAS_BACKEND` is set.
"""

import keras
import numpy as np

import keras_dtype_policy as kdp

VOCABULARY = 64
LENGTH = 16
BATCH = 32
STEPS = 48
LEARNING_RATE = 3e-3
SIZE = {
    "vocabulary_size": VOCABULARY,
    "num_layers": 2,
    "num_heads": 2,
    "hidden_dim": 64,
    "intermediate_dim": 128,
    "max_sequence_length": LENGTH,
    "dropout": 0.0,
}
CONFIGURATIONS = (
    "float32",
    "mixed_bfloat16",
    "bfloat16",
    "kahan_bfloat16",
    "stochastic_bfloat16",
    "mixed_bfloat16_state",
)


def run(sizes=None):
    """Runs both tasks under every configuration; returns a dict."""
    try:
        import keras_hub
    except ImportError as error:
        return {"skipped": f"keras_hub is not installed ({error})"}
    results = {"keras_hub": keras_hub.__version__, "tasks": {}}
    for name, task in (("gpt2", _gpt2_task), ("bert", _bert_task)):
        build, x, y, x_test, y_test = task(keras_hub)
        losses = {}
        for configuration in CONFIGURATIONS:
            losses[configuration] = _train(
                configuration, build, x, y, x_test, y_test
            )
        results["tasks"][name] = losses
    return results


def _train(configuration, build, x, y, x_test, y_test):
    policy = configuration
    optimizer = keras.optimizers.Adam(LEARNING_RATE)
    if configuration == "mixed_bfloat16_state":
        policy = "mixed_bfloat16"
        optimizer = kdp.LowPrecisionOptimizer(
            optimizer,
            update="stochastic_rounding",
            state_dtype="bfloat16",
            seed=0,
        )
    keras.utils.set_random_seed(0)
    with kdp.policy_scope(policy):
        model = build()
    model.compile(
        optimizer,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    scores = model.evaluate(
        x_test, y_test, batch_size=len(y_test), verbose=0, return_dict=True
    )
    keras.utils.clear_session()
    return round(float(scores["loss"]), 4)


def _gpt2_task(keras_hub):
    rng = np.random.default_rng(0)
    count = BATCH * STEPS + 256
    start = rng.integers(0, VOCABULARY, count)
    tokens = (start[:, None] + np.arange(LENGTH + 1)[None]) % VOCABULARY
    x = {
        "token_ids": tokens[:, :-1].astype("int32"),
        "padding_mask": np.ones((count, LENGTH), "bool"),
    }
    y = tokens[:, 1:].astype("int32")

    def build():
        backbone = keras_hub.models.GPT2Backbone(**SIZE)
        return keras_hub.models.GPT2CausalLM(
            backbone=backbone, preprocessor=None
        )

    return (build, *_split(x, y))


def _bert_task(keras_hub):
    rng = np.random.default_rng(1)
    count = BATCH * STEPS + 256
    tokens = rng.integers(0, VOCABULARY, (count, LENGTH)).astype("int32")
    x = {
        "token_ids": tokens,
        "segment_ids": np.zeros((count, LENGTH), "int32"),
        "padding_mask": np.ones((count, LENGTH), "bool"),
    }
    y = (tokens[:, 0] < VOCABULARY // 2).astype("int32")

    def build():
        backbone = keras_hub.models.BertBackbone(**SIZE)
        return keras_hub.models.BertTextClassifier(
            backbone=backbone, num_classes=2, preprocessor=None, dropout=0.0
        )

    return (build, *_split(x, y))


def _split(x, y):
    train = BATCH * STEPS
    x_train = {key: value[:train] for key, value in x.items()}
    x_test = {key: value[train:] for key, value in x.items()}
    return x_train, y[:train], x_test, y[train:]
