"""Keras' `OrbaxCheckpoint` (JAX) resumes the package's configurations.

A model trains one epoch of 4 steps under `keras.callbacks.OrbaxCheckpoint`
(written synchronously), a fresh process loads the checkpoint directory
with `keras.saving.load_model` (Keras rebuilds the model from the config
the checkpoint holds, compiles it and restores every variable by its path:
weights, the 8-bit codes and scales, Kahan's compensation, the rounding
seed, the loss scale) and trains one more epoch; the weights and the
optimizer state then equal, bit for bit, those of a run of two epochs in
one process. Orbax is JAX's; orbax-checkpoint is installed by `tox -e
orbax-jax` only (it pulls tensorstore), and the tests skip without it,
saying so.
"""

import importlib.util
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
from testing import BACKEND

import keras_dtype_policy as kdp

pytestmark = [
    pytest.mark.skipif(
        BACKEND != "jax",
        reason="Keras' OrbaxCheckpoint saves JAX arrays; the other backends "
        "have their own checkpoints (test_tf_checkpoints.py, the .keras "
        "and .weights.h5 tests)",
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("orbax") is None,
        reason="orbax-checkpoint is not installed (`tox -e orbax-jax` "
        "installs it; it pulls tensorstore, so no other env does)",
    ),
]

# A policy, and the `LowPrecisionOptimizer` arguments around Adam (None:
# the optimizer the policy's compile hook installs).
CONFIGURATIONS = {
    # Keras alone's path, for comparison.
    "float32": ("float32", None),
    "stochastic_bfloat16_8bit": (
        "stochastic_bfloat16",
        {"update": "stochastic_rounding", "state_dtype": "8bit", "seed": 3},
    ),
    "kahan_bfloat16": ("kahan_bfloat16", None),
    "mixed_float16": ("mixed_float16", None),
}
X = np.random.RandomState(0).randn(32, 12).astype("float32")
Y = np.tanh(X[:, :4])

# Run in a fresh process: load the checkpoint, train one more epoch, and
# write every weight and optimizer variable.
RESUME = """
import sys
import keras
import numpy as np
import keras_dtype_policy  # noqa: F401  (registers the package's classes)

checkpoint, data, output = sys.argv[1:4]
arrays = np.load(data)
model = keras.saving.load_model(checkpoint)
model.fit(arrays["x"], arrays["y"], batch_size=8, epochs=1, verbose=0,
          shuffle=False)
np.savez(output, *[np.asarray(keras.ops.convert_to_numpy(
    keras.ops.cast(v, "float32") if "float" in str(v.dtype) else v))
    for v in model.weights + model.optimizer.variables])
"""


def compiled(configuration):
    policy, arguments = CONFIGURATIONS[configuration]
    keras.utils.set_random_seed(0)
    # Functional: a loaded `Sequential`'s variable paths lose the model's
    # name, and Orbax then restores none of them (Keras' limit, in the
    # saving docs).
    with kdp.policy_scope(policy):
        inputs = keras.Input((12,), name="x")
        hidden = keras.layers.Dense(32, activation="relu", name="hidden")
        outputs = keras.layers.Dense(4, name="out")(hidden(inputs))
        model = keras.Model(inputs, outputs, name="model")
    optimizer = keras.optimizers.Adam(1e-2)
    if arguments:
        optimizer = kdp.LowPrecisionOptimizer(optimizer, **arguments)
    model.compile(optimizer, "mse")
    return model


def values(model):
    return [
        np.asarray(
            keras.ops.convert_to_numpy(
                keras.ops.cast(v, "float32") if "float" in str(v.dtype) else v
            )
        )
        for v in model.weights + model.optimizer.variables
    ]


@pytest.mark.parametrize("configuration", sorted(CONFIGURATIONS))
def test_resumed_in_a_fresh_process_equals_the_straight_run(
    configuration, tmp_path
):
    straight = compiled(configuration)
    straight.fit(X, Y, batch_size=8, epochs=2, verbose=0, shuffle=False)

    interrupted = compiled(configuration)
    checkpoint = tmp_path / "checkpoint"
    callback = keras.callbacks.OrbaxCheckpoint(
        str(checkpoint), save_on_background=False
    )
    interrupted.fit(
        X,
        Y,
        batch_size=8,
        epochs=1,
        verbose=0,
        shuffle=False,
        callbacks=[callback],
    )
    data, output = tmp_path / "data.npz", tmp_path / "resumed.npz"
    np.savez(data, x=X, y=Y)
    environment = dict(os.environ, KERAS_BACKEND="jax")
    subprocess.run(
        [sys.executable, "-c", textwrap.dedent(RESUME)]
        + [str(checkpoint), str(data), str(output)],
        check=True,
        env=environment,
        timeout=300,
    )
    with np.load(output) as resumed:
        got = [resumed[f"arr_{i}"] for i in range(len(resumed.files))]
    want = values(straight)
    assert len(got) == len(want)
    for index, (value, expected) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_array_equal(value, expected, err_msg=str(index))
