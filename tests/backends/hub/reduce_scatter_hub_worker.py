"""A keras-hub GPT-2 backbone (from config) trained with
`shard_optimizer_state(model, reduce_scatter=True)` on four forced host
devices.

    KERAS_BACKEND=jax python reduce_scatter_hub_worker.py OUT_DIR

Under `stochastic_bfloat16_8bit` it trains the same batches with Keras'
train step and with the reduce-scatter step (the backbone's dropout draws
differ between the two), saves the second, reloads it on one device and
trains on. Prints one JSON line of findings.
"""

import json
import os
import pathlib
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402

import keras_dtype_policy as kdp  # noqa: E402

VOCABULARY = 1000
rng = np.random.RandomState(0)
IDS = rng.randint(0, VOCABULARY, size=(64, 33)).astype("int32")
X = {"token_ids": IDS[:, :-1], "padding_mask": np.ones((64, 32), "int32")}
Y = IDS[:, 1:]


def language_model():
    """GPT-2's backbone (dropout 0.1) under a float32 logits layer."""
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCABULARY,
        num_layers=2,
        num_heads=4,
        hidden_dim=128,
        intermediate_dim=256,
        max_sequence_length=64,
        dropout=0.1,
    )
    logits = keras.layers.Dense(VOCABULARY, dtype="float32")(backbone.output)
    model = keras.Model(backbone.input, logits)
    model.compile(
        keras.optimizers.Adam(1e-3),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def train(reduce_scatter):
    keras.utils.clear_session()
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    keras.utils.set_random_seed(0)
    kdp.set_dtype_policy("stochastic_bfloat16_8bit")
    model = language_model()
    kdp.shard_optimizer_state(model, reduce_scatter=reduce_scatter)
    history = model.fit(X, Y, batch_size=16, epochs=3, verbose=0)
    return model, history.history["loss"]


out = pathlib.Path(sys.argv[1])
_, keras_losses = train(False)
model, losses = train(True)
state_dtypes = sorted({str(v.dtype) for v in model.optimizer.variables})
saved = [keras.ops.convert_to_numpy(v) for v in model.optimizer.variables]
model.save(out / "gpt2.keras")
keras.distribution.set_distribution(None)
loaded = keras.saving.load_model(out / "gpt2.keras")
state_equal = all(
    np.array_equal(keras.ops.convert_to_numpy(v), s)
    for v, s in zip(loaded.optimizer.variables, saved, strict=True)
)
resumed = loaded.fit(X, Y, batch_size=16, epochs=1, verbose=0)
print(
    json.dumps(
        {
            "keras_losses": keras_losses,
            "losses": losses,
            "state_dtypes": state_dtypes,
            "state_equal": state_equal,
            "resumed_loss": resumed.history["loss"][0],
        }
    )
)
