"""The three tasks of the low-precision benchmark: data and models.

- digits: the demo's convnet on scikit-learn's handwritten digits
  (`keras_dtype_policy.tools.demo`), scored by test accuracy;
- char_lm: a character-level transformer language model (2 blocks,
  d=64) on text from a deterministic generator, scored by the loss on
  held-out text;
- regression: an MLP fitting a smooth function of 16 inputs, scored by
  the mean squared error on held-out inputs.

Every model is built under the policy in force (`policy_scope`): all its
weights take the policy's variable dtype (the demo's softmax, which has no
weights, computes in float32), and the loss computes in float32 (Keras'
losses cast to their own dtype).

Import this module only once `KERAS_BACKEND` is set: it imports Keras.
"""

import dataclasses

import keras
import numpy as np
from keras import ops

# The generated text's alphabet: letters, space and full stop.
ALPHABET = "abcdefghijklmnopqrstuvwxyz ."
SEQUENCE = 32
WORDS = 48


@dataclasses.dataclass
class Task:
    """One task: its data, how to build and compile its model.

    Attributes:
        name: The task's name.
        description: One line for the report.
        x_train: Training inputs, in the order they are trained on.
        y_train: Training targets.
        x_test: Held-out inputs.
        y_test: Held-out targets.
        build: A function returning the model, built under the policy in
            force.
        loss: The loss.
        metric: The score reported: "accuracy" or "loss".
        batch_size: The batch size.
        learning_rate: Adam's learning rate.
    """

    name: str
    description: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    build: object
    loss: object
    metric: str
    batch_size: int
    learning_rate: float


def digits_task(steps, learning_rate):
    """The demo's convnet on the digits, `steps` steps of batch 32."""
    from keras_dtype_policy.tools import demo

    data = demo.load_digits()
    x, y = _epochs(data.x_train, data.y_train, steps, demo.BATCH_SIZE, 0)

    return Task(
        name="digits",
        description="the demo's convnet (8x8x1, Conv 32-64, Dense 128-10) "
        "on scikit-learn's digits, batch 32",
        x_train=x,
        y_train=y,
        x_test=data.x_test,
        y_test=data.y_test,
        build=demo.build_model,
        loss="sparse_categorical_crossentropy",
        metric="accuracy",
        batch_size=demo.BATCH_SIZE,
        learning_rate=learning_rate,
    )


def generated_text(characters, seed):
    """Returns `characters` of text from a fixed word-level Markov chain.

    The vocabulary (`WORDS` made-up words of 2 to 7 letters) and each
    word's three possible successors come from a generator seeded with 0;
    `seed` only picks the walk through the chain, so that the training
    and test texts differ but follow the same rules.
    """
    rules = np.random.default_rng(0)
    words = [
        "".join(rules.choice(list(ALPHABET[:26]), rules.integers(2, 8)))
        for _ in range(WORDS)
    ]
    successors = rules.integers(0, WORDS, (WORDS, 3))
    walk = np.random.default_rng(seed)
    text, word = [], 0
    length = 0
    while length < characters:
        ending = " " if walk.random() > 0.1 else ". "
        text.append(words[word] + ending)
        length += len(text[-1])
        word = successors[word, walk.integers(0, 3)]
    return "".join(text)[:characters]


def _windows(text, count):
    codes = np.array([ALPHABET.index(c) for c in text], dtype="int32")
    starts = np.arange(count) * SEQUENCE
    x = np.stack([codes[s : s + SEQUENCE] for s in starts])
    y = np.stack([codes[s + 1 : s + SEQUENCE + 1] for s in starts])
    return x, y


class PositionEmbedding(keras.layers.Layer):
    """Adds a learned embedding of each position to its input."""

    def build(self, input_shape):
        self.positions = self.add_weight(
            shape=tuple(input_shape[1:]),
            initializer=keras.initializers.RandomNormal(stddev=0.02),
            name="positions",
        )

    def call(self, x):
        return x + self.positions


def char_lm_task(steps, learning_rate, width=64, heads=2, blocks=2):
    """A small causal transformer on generated text, batch 32."""
    batch_size = 32
    train_count = 2048
    x_all, y_all = _windows(
        generated_text((train_count + 1) * SEQUENCE + 1, seed=1), train_count
    )
    x, y = _epochs(x_all, y_all, steps, batch_size, 1)
    x_test, y_test = _windows(generated_text(257 * SEQUENCE + 1, seed=2), 256)

    def build():
        inputs = keras.Input((SEQUENCE,), dtype="int32")
        h = keras.layers.Embedding(len(ALPHABET), width)(inputs)
        h = PositionEmbedding()(h)
        for _ in range(blocks):
            a = keras.layers.LayerNormalization()(h)
            a = keras.layers.MultiHeadAttention(heads, width // heads)(
                a, a, use_causal_mask=True
            )
            h = h + a
            f = keras.layers.LayerNormalization()(h)
            f = keras.layers.Dense(4 * width, activation="gelu")(f)
            f = keras.layers.Dense(width)(f)
            h = h + f
        h = keras.layers.LayerNormalization()(h)
        logits = keras.layers.Dense(len(ALPHABET))(h)
        return keras.Model(inputs, logits, name="char_lm")

    return Task(
        name="char_lm",
        description=f"a causal transformer ({blocks} blocks, d={width}, "
        f"{heads} heads, 32 characters) on generated text, batch 32",
        x_train=x,
        y_train=y,
        x_test=x_test,
        y_test=y_test,
        build=build,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metric="loss",
        batch_size=batch_size,
        learning_rate=learning_rate,
    )


def regression_task(steps, learning_rate, features=16, hidden=256):
    """An MLP fitting a smooth function of `features` inputs, batch 64."""
    batch_size = 64
    rng = np.random.default_rng(3)
    a = rng.standard_normal((features, 4)) / np.sqrt(features)

    def target(x):
        z = x @ a
        value = np.sin(z[:, 0]) + 0.5 * z[:, 1] * z[:, 2] + 0.3 * z[:, 3]
        return value[:, None].astype("float32")

    x_all = rng.standard_normal((4096, features)).astype("float32")
    x, y = _epochs(x_all, target(x_all), steps, batch_size, 3)
    x_test = rng.standard_normal((1024, features)).astype("float32")

    def build():
        return keras.Sequential(
            [
                keras.Input((features,)),
                keras.layers.Dense(hidden, activation="relu"),
                keras.layers.Dense(hidden, activation="relu"),
                keras.layers.Dense(1),
            ],
            name="regression_mlp",
        )

    return Task(
        name="regression",
        description=f"an MLP {features}-{hidden}-{hidden}-1 "
        "fitting a smooth function, mean squared error, "
        "batch 64",
        x_train=x,
        y_train=y,
        x_test=x_test,
        y_test=target(x_test),
        build=build,
        loss="mean_squared_error",
        metric="loss",
        batch_size=batch_size,
        learning_rate=learning_rate,
    )


def _epochs(x, y, steps, batch_size, seed):
    """Returns `steps` batches of `(x, y)`, reshuffled for every epoch."""
    rng = np.random.default_rng(seed)
    needed = steps * batch_size
    orders = []
    while sum(len(o) for o in orders) < needed:
        orders.append(rng.permutation(len(x)))
    order = np.concatenate(orders)[:needed]
    return x[order], y[order]


def variable_bytes(variables):
    """Returns the bytes of `variables`, from their shapes and dtypes."""
    total = 0
    for variable in variables:
        size = int(np.prod(variable.shape, dtype=np.int64))
        total += size * np.dtype(_numpy_dtype(variable.dtype)).itemsize
    return total


def _numpy_dtype(dtype):
    name = keras.backend.standardize_dtype(dtype)
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return name


def evaluate(model, task):
    """Returns the task's score and loss on its held-out data."""
    results = model.evaluate(
        task.x_test, task.y_test, batch_size=256, verbose=0, return_dict=True
    )
    loss = float(results["loss"])
    if task.metric == "accuracy":
        return float(results["accuracy"]), loss
    return loss, loss


def cast_weights(weights):
    """Returns float32 NumPy weights (to copy into any policy's model)."""
    return [np.asarray(ops.convert_to_numpy(w), "float32") for w in weights]
