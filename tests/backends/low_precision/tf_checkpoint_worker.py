"""Runs of the low-precision optimizer saved with `tf.train.Checkpoint`.

    KERAS_BACKEND=tensorflow python tf_checkpoint_worker.py CONFIG FOLDER

Reads the checkpoint FOLDER/checkpoint into a fresh model and optimizer of
the configuration CONFIG (a key of `CONFIGS`), trains `STEPS` more steps
and writes the final state to FOLDER/resumed.npz: a resume in a process
that never saw the first run. Prints one JSON line naming the file.
test_tf_checkpoints.py imports the configurations and runs from here.
"""

import dataclasses
import json
import sys
from collections.abc import Callable

import keras
import numpy as np

import keras_dtype_policy as kdp

STEPS, BATCH, FEATURES = 4, 8, 64


@dataclasses.dataclass(frozen=True)
class Config:
    """One way to train with the low-precision optimizer.

    Attributes:
        policy: The policy the model's layers are made under.
        make: Makes the unbuilt optimizer, its seed fixed.
    """

    policy: str
    make: Callable


def low_precision(**options):
    return lambda: kdp.LowPrecisionOptimizer(
        keras.optimizers.Adam(1e-2), seed=3, **options
    )


def loss_scaled_low_precision(**options):
    return lambda: kdp.LossScaleOptimizer(low_precision(**options)())


# What the compile hook installs for each policy name, with a fixed seed
# (the hook draws one).
CONFIGS = {
    "kahan_bfloat16": Config("kahan_bfloat16", low_precision(update="kahan")),
    "stochastic_bfloat16": Config(
        "stochastic_bfloat16", low_precision(update="stochastic_rounding")
    ),
    "stochastic_bfloat16_8bit": Config(
        "stochastic_bfloat16_8bit",
        low_precision(update="stochastic_rounding", state_dtype="8bit"),
    ),
    "kahan_bfloat16_8bit": Config(
        "kahan_bfloat16_8bit", low_precision(update="kahan", state_dtype="8bit")
    ),
    "stochastic_bfloat16_4bit": Config(
        "stochastic_bfloat16_4bit",
        low_precision(update="stochastic_rounding", state_dtype="4bit"),
    ),
    "mixed_bfloat16_8bit": Config(
        "mixed_bfloat16", low_precision(state_dtype="8bit")
    ),
    "loss_scaled_kahan_float16": Config(
        "kahan_float16",
        loss_scaled_low_precision(update="kahan", state_dtype="float32"),
    ),
}


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * BATCH, FEATURES)).astype("float32")
    y = np.tanh(x[:, :8] - x[:, 8:16]).astype("float32")
    return x, y


def new_model(config):
    """A compiled MLP whose first kernel (64 x 64) is large enough for
    8-bit and 4-bit state; the optimizer is not built."""
    keras.utils.set_random_seed(0)
    with kdp.policy_scope(config.policy):
        model = keras.Sequential(
            [
                keras.Input((FEATURES,)),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(8),
            ]
        )
    model.compile(config.make(), "mse")
    return model


def fit(model):
    """Trains `model` `STEPS` steps, always on the same batches."""
    x, y = data()
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)


def state(model):
    """The bits of the model's weights and its optimizer's variables, by
    name (`bits`)."""
    arrays = {f"weight {i}": bits(w) for i, w in enumerate(model.weights)}
    arrays.update(
        {
            f"optimizer {i}": bits(v)
            for i, v in enumerate(model.optimizer.variables)
        }
    )
    return arrays


def bits(variable):
    """The value of `variable` as unsigned integers of its width: equal
    only where every bit is (a NaN and the sign of a zero too), and saved
    by `np.savez` whatever the dtype (bfloat16 is not NumPy's own)."""
    array = np.asarray(keras.ops.convert_to_numpy(variable))
    return array.view(f"uint{8 * array.itemsize}")


def resumed_model(config, prefix):
    """A fresh model, its optimizer built, with the checkpoint at `prefix`
    read into both."""
    import tensorflow as tf

    model = new_model(config)
    model.optimizer.build(model.trainable_variables)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    checkpoint.read(prefix).assert_consumed()
    return model


def main(name, folder):
    model = resumed_model(CONFIGS[name], f"{folder}/checkpoint")
    fit(model)
    path = f"{folder}/resumed.npz"
    np.savez(path, **state(model))
    print(json.dumps({"state": path}))


if __name__ == "__main__":
    main(*sys.argv[1:])
