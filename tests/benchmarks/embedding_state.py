"""The embeddings' optimizer state in float32 and the rest in 8 bits.

    KERAS_BACKEND=jax python tests/benchmarks/embedding_state.py

bitsandbytes' advice (its `StableEmbedding` keeps 32-bit state), measured
on a tiny embedding task under `"stochastic_bfloat16"`: a bag of 8 tokens
drawn from a Zipf(1.1) law over 2,000 tokens, a 64-wide embedding
averaged, Dense(128, tanh), Dense(1); the target is a tanh of the tokens'
mean random 8-dimensional code. Adam at 3e-3, 3 epochs of 200 batches of
64, three seeds. Prints, for all-8-bit state, the two ways of keeping the
embeddings' state in float32 (`MultiOptimizer`, the `state_dtype` dict)
and all-float32 state: the optimizer state's bytes and the held-out loss
of each seed. docs/low-precision-training.md has the figures.
"""

import keras
import numpy as np

import keras_dtype_policy as kdp
from keras_dtype_policy import LowPrecisionOptimizer

VOCAB, WIDTH, TOKENS, BATCHES, BATCH, EPOCHS = 2000, 64, 8, 200, 64, 3
SEEDS = (0, 1, 2)


def make_data():
    rng = np.random.RandomState(0)
    p = 1.0 / np.arange(1, VOCAB + 1) ** 1.1
    codes = rng.randn(VOCAB, 8).astype("float32")
    w = rng.randn(8, 1).astype("float32")

    def draw(samples):
        x = rng.choice(VOCAB, size=(samples, TOKENS), p=p / p.sum())
        return x.astype("int32"), np.tanh(codes[x].mean(1) @ w)

    return draw(BATCHES * BATCH), draw(4096)


def make_model(seed):
    keras.utils.set_random_seed(seed)
    with kdp.policy_scope("stochastic_bfloat16"):
        inputs = keras.Input((TOKENS,), dtype="int32")
        x = keras.layers.Embedding(VOCAB, WIDTH, name="embedding")(inputs)
        x = keras.layers.GlobalAveragePooling1D()(x)
        x = keras.layers.Dense(128, activation="tanh")(x)
        outputs = keras.layers.Dense(1, dtype="float32")(x)
    return keras.Model(inputs, outputs)


def adam(state_dtype, seed=1):
    return LowPrecisionOptimizer(
        keras.optimizers.Adam(3e-3),
        "stochastic_rounding",
        state_dtype=state_dtype,
        seed=seed,
    )


def multi_optimizer():
    return keras.optimizers.MultiOptimizer(
        keras.optimizers.OptimizerMap(
            adam("8bit"), {"embedding/.*": adam("float32", seed=2)}
        )
    )


CASES = {
    "all 8-bit": lambda: adam("8bit"),
    "MultiOptimizer, embeddings float32": multi_optimizer,
    "state_dtype dict, embeddings float32": lambda: adam(
        {"embedding/.*": "float32", ".*": "8bit"}
    ),
    "all float32": lambda: adam("float32"),
}


def state_bytes(optimizer):
    return sum(
        keras.ops.convert_to_numpy(v).nbytes for v in optimizer.variables
    )


def main():
    (x, y), (x_test, y_test) = make_data()
    print(f"held-out target variance {float(y_test.var()):.4f}")
    for name, make in CASES.items():
        if name.startswith("MultiOptimizer") and not hasattr(
            keras.optimizers, "MultiOptimizer"
        ):
            continue
        losses = []
        for seed in SEEDS:
            model = make_model(seed)
            model.compile(make(), "mse")
            model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0)
            losses.append(model.evaluate(x_test, y_test, verbose=0))
        size = state_bytes(model.optimizer) / 1024
        print(
            f"{name:38s} state {size:7.1f} KiB  held-out loss "
            + " ".join(f"{v:.5f}" for v in losses)
            + f"  mean {np.mean(losses):.5f}"
        )


if __name__ == "__main__":
    main()
