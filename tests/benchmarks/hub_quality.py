"""Quality of the low-precision policies on keras-hub models.

Two keras-hub models built from configs (nothing downloaded), Adam at
3e-3, dropout 0. Each task runs over several seeds: a seed draws the
initial weights (made in float32, then cast into every configuration's
variables) and the batches, which all configurations share. The score
is the loss on held-out batches after training (lower is better). Both
tasks carry label noise, so the loss levels off above zero instead of
vanishing, and a configuration that learns worse shows it:

- gpt2: `GPT2CausalLM` (2 layers, hidden 64, 2 heads, vocabulary 64) on
  next-token prediction of sequences `x[t + 1] = x[t] + 1 (mod 64)` from
  random starts, one target in ten replaced by a random token (the best
  possible loss is 0.729), 96 steps of batch 32 (levelled from about 96);
- bert: `BertTextClassifier` (2 layers, hidden 64) on sequences of random
  tokens labelled by whether the first token is below the second, one
  label in twenty flipped (the best possible loss is 0.199), 192 steps of
  batch 32.

Each configuration's model is built and compiled once per task, then
reset to each seed's weights and a fresh optimizer state, so the
compiled step is reused. Skipped, with the reason in the results, where
keras-hub is not installed. Import this module only once
`KERAS_BACKEND` is set. `KDP_HUB_QUALITY_ONLY`, a comma-separated list of
configurations, runs a subset (mixed_bfloat16, the reference, always)."""

import keras
import numpy as np

import keras_dtype_policy as kdp
from tests.benchmarks import subsets

VOCABULARY = 64
LENGTH = 16
BATCH = 32
STEPS = {"gpt2": 96, "bert": 192}
HELD_OUT = 256
LABEL_NOISE = 0.05
TOKEN_NOISE = 0.1
LEARNING_RATE = 3e-3
SEEDS = {"full": 5, "quick": 1}
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
    "stochastic_bfloat16_8bit",
)


def run(sizes=None):
    """Runs both tasks under every configuration and seed; returns a dict.

    Args:
        sizes: A `sizes.Sizes`; its name picks the number of seeds (five
            for "full", one for "quick"). None means full.

    Returns:
        A dict: the keras-hub version, the seeds, the steps, and per task
        and configuration the held-out loss of each seed, or a "skipped"
        entry naming why.
    """
    try:
        import keras_hub
    except ImportError as error:
        return {"skipped": f"keras_hub is not installed ({error})"}
    name = "full" if sizes is None else sizes.name
    seeds = list(range(SEEDS.get(name, SEEDS["full"])))
    results = {
        "keras_hub": keras_hub.__version__,
        "seeds": seeds,
        "steps": STEPS,
        "batch": BATCH,
        "tasks": {},
    }
    for task_name, task in (("gpt2", _gpt2_task), ("bert", _bert_task)):
        build, data = task(keras_hub)
        initial = [_initial_weights(build, seed) for seed in seeds]
        batches = [data(seed) for seed in seeds]
        losses = {}
        for configuration in subsets.chosen(
            "KDP_HUB_QUALITY_ONLY", CONFIGURATIONS, ("mixed_bfloat16",)
        ):
            losses[configuration] = _train(
                configuration, build, initial, batches
            )
        results["tasks"][task_name] = losses
    return results


def _initial_weights(build, seed):
    keras.utils.set_random_seed(seed)
    with kdp.policy_scope("float32"):
        model = build()
    weights = [keras.ops.convert_to_numpy(v) for v in model.weights]
    keras.utils.clear_session()
    return weights


def _train(configuration, build, initial, batches):
    """One model per configuration, trained once from each seed's start."""
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
    elif configuration == "stochastic_bfloat16_8bit":
        policy = "stochastic_bfloat16"
        optimizer = kdp.LowPrecisionOptimizer(
            optimizer, update="stochastic_rounding", state_dtype="8bit", seed=0
        )
    keras.utils.set_random_seed(0)
    with kdp.policy_scope(policy):
        model = build()
    model.compile(
        optimizer,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    # The policy may wrap the optimizer in `compile`: reset what it holds.
    optimizer = model.optimizer
    optimizer.build(model.trainable_variables)
    # A quantized slot's state is its codes and scales, which are among
    # the optimizer's variables.
    state = list(optimizer.variables)
    fresh = [keras.ops.convert_to_numpy(v) for v in state]
    losses = []
    for weights, (x, y, x_test, y_test) in zip(initial, batches, strict=True):
        for variable, value in zip(model.weights, weights, strict=True):
            variable.assign(keras.ops.cast(value, variable.dtype))
        for variable, value in zip(state, fresh, strict=True):
            variable.assign(value)
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
        scores = model.evaluate(
            x_test, y_test, batch_size=HELD_OUT, verbose=0, return_dict=True
        )
        losses.append(round(float(scores["loss"]), 4))
    keras.utils.clear_session()
    return losses


def _gpt2_task(keras_hub):
    def build():
        backbone = keras_hub.models.GPT2Backbone(**SIZE)
        return keras_hub.models.GPT2CausalLM(
            backbone=backbone, preprocessor=None
        )

    def data(seed):
        rng = np.random.default_rng(seed)
        count = BATCH * STEPS["gpt2"] + HELD_OUT
        start = rng.integers(0, VOCABULARY, (count, 1))
        tokens = (start + np.arange(LENGTH + 1)) % VOCABULARY
        x = {
            "token_ids": tokens[:, :-1].astype("int32"),
            "padding_mask": np.ones((count, LENGTH), "bool"),
        }
        targets = tokens[:, 1:]
        noisy = rng.random(targets.shape) < TOKEN_NOISE
        noise = rng.integers(0, VOCABULARY, targets.shape)
        targets = np.where(noisy, noise, targets)
        return _split(x, targets.astype("int32"))

    return build, data


def _bert_task(keras_hub):
    def build():
        backbone = keras_hub.models.BertBackbone(**SIZE)
        return keras_hub.models.BertTextClassifier(
            backbone=backbone, num_classes=2, preprocessor=None, dropout=0.0
        )

    def data(seed):
        rng = np.random.default_rng(1000 + seed)
        count = BATCH * STEPS["bert"] + HELD_OUT
        tokens = rng.integers(0, VOCABULARY, (count, LENGTH)).astype("int32")
        x = {
            "token_ids": tokens,
            "segment_ids": np.zeros((count, LENGTH), "int32"),
            "padding_mask": np.ones((count, LENGTH), "bool"),
        }
        labels = tokens[:, 0] < tokens[:, 1]
        labels ^= rng.random(count) < LABEL_NOISE
        return _split(x, labels.astype("int32"))

    return build, data


def _split(x, y):
    train = len(y) - HELD_OUT
    x_train = {key: value[:train] for key, value in x.items()}
    x_test = {key: value[train:] for key, value in x.items()}
    return x_train, y[:train], x_test, y[train:]
