"""One measurement of the quantized-state benchmark, in a fresh process.

Run by `quantized_state_memory.py` from the repository root, one process
per configuration, so that no other configuration's buffers, compiled
steps or allocator pools count in this one's peak:

    python -m tests.benchmarks.quantized_state_probe --backend jax \
        --configuration stochastic_bfloat16_8bit --width 2048 --depth 12 \
        --batch 64 --steps 3

It builds a stack of `--depth` Dense layers `--width` wide (ReLU between,
biases, a mean squared error on random targets), compiles it with the
configuration's policy and optimizer, builds the optimizer state and
counts the bytes of weights and state from the variables. It then reads
the process's resident memory at each stage: after importing the backend,
after building the model and its state, the high-water mark of the first
training step (which compiles), and the high-water mark of `--steps`
steps after it (the peak reset first). The result is one JSON line after
`MARKER` on standard output.
"""

import argparse
import json
import os
import sys

from tests.benchmarks import threads

MARKER = "QUANTIZED_STATE_RESULT "
# name: (policy, LowPrecisionOptimizer arguments or None for Adam as the
# policy gives it: bare, or wrapped by the compile hook).
CONFIGURATIONS = {
    "float32": ("float32", None),
    "mixed_bfloat16": ("mixed_bfloat16", None),
    "kahan_bfloat16": ("kahan_bfloat16", None),
    "stochastic_bfloat16": ("stochastic_bfloat16", None),
    "stochastic_bfloat16_8bit": (
        "stochastic_bfloat16",
        {"update": "stochastic_rounding", "state_dtype": "8bit", "seed": 0},
    ),
    "kahan_bfloat16_8bit": (
        "kahan_bfloat16",
        {"update": "kahan", "state_dtype": "8bit"},
    ),
    # float32 weights: `update` only says how the state is requantized.
    "mixed_bfloat16_8bit": (
        "mixed_bfloat16",
        {"update": "stochastic_rounding", "state_dtype": "8bit", "seed": 0},
    ),
    "stochastic_bfloat16_4bit": (
        "stochastic_bfloat16",
        {"update": "stochastic_rounding", "state_dtype": "4bit", "seed": 0},
    ),
}
# Gradient release (PyTorch; elsewhere the usual step): each variable
# updated in the backward pass, its gradient freed there.
RELEASE = "+release"
for _name in (
    "mixed_bfloat16",
    "kahan_bfloat16",
    "stochastic_bfloat16_8bit",
    "stochastic_bfloat16_4bit",
):
    _policy, _arguments = CONFIGURATIONS[_name]
    _arguments = _arguments or {
        "update": "nearest" if _name.startswith("mixed") else "kahan"
    }
    CONFIGURATIONS[_name + RELEASE] = (
        _policy,
        {**_arguments, "release_gradients": True},
    )
LEARNING_RATE = 1e-4


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", required=True)
    parser.add_argument(
        "--configuration", required=True, choices=tuple(CONFIGURATIONS)
    )
    parser.add_argument("--width", type=int, required=True)
    parser.add_argument("--depth", type=int, required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--threads", type=int, default=None)
    return parser


def probe(configuration, width, depth, batch, steps):
    """Measures one configuration; returns a dict of bytes.

    Call only once `KERAS_BACKEND` is set.

    Returns:
        A dict: the variables' bytes (`low_precision.memory_row`), and the
        resident memory `imported` (Keras and the backend loaded, a tensor
        made, and TensorFlow, which `keras.utils.set_random_seed` imports
        wherever it is installed), `built` (the model, its optimizer
        state and the data made),
        `first_peak` (the process's high-water mark after the first
        step), `steady_peak` (the high-water mark of the later steps, or
        None where it cannot be reset), `after` (resident after the
        steps) and `device_peak` (a GPU's peak memory through the whole
        process, None on a CPU).
    """
    import keras
    import numpy as np

    import keras_dtype_policy as kdp
    from tests.benchmarks import backend_support
    from tests.benchmarks import low_precision
    from tests.benchmarks import process_memory

    # Before the first reading: it imports TensorFlow where installed.
    keras.utils.set_random_seed(0)
    keras.ops.convert_to_numpy(keras.ops.ones((2, 2)) * 2)
    imported = process_memory.current_rss()
    policy, arguments = CONFIGURATIONS[configuration]
    with kdp.policy_scope(policy):
        model = keras.Sequential(
            [keras.Input((width,))]
            + [
                keras.layers.Dense(
                    width, activation="relu" if i < depth - 1 else None
                )
                for i in range(depth)
            ],
            name="dense_stack",
        )
    model.compile(
        optimizer=low_precision.make_optimizer(LEARNING_RATE, arguments),
        loss="mean_squared_error",
    )
    variables = low_precision.memory_row(model)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, width)).astype("float32")
    y = rng.standard_normal((batch, width)).astype("float32")
    built = process_memory.current_rss()
    model.train_on_batch(x, y)
    backend_support.sync(model.trainable_variables[0])
    first_peak = process_memory.peak_rss()
    can_reset = process_memory.reset_peak_rss()
    for _ in range(steps):
        model.train_on_batch(x, y)
    backend_support.sync(model.trainable_variables[0])
    steady_peak = process_memory.peak_rss() if can_reset else None
    optimizer = model.optimizer
    return {
        "configuration": configuration,
        "policy": policy,
        "optimizer": type(optimizer).__name__,
        "update": getattr(optimizer, "update", None),
        "state_dtype": getattr(optimizer, "state_dtype", None),
        "release_gradients": getattr(optimizer, "release_gradients", False),
        "backend": backend_support.backend(),
        "device": backend_support.device(),
        "variables": variables,
        "imported": imported,
        "built": built,
        "first_peak": first_peak,
        "steady_peak": steady_peak,
        "after": process_memory.current_rss(),
        # On a GPU: the device's peak over the whole process, else None.
        "device_peak": backend_support.peak_device_memory(),
    }


def main(argv=None):
    """Runs one probe and prints its result; returns the exit status."""
    args = build_parser().parse_args(argv)
    os.environ["KERAS_BACKEND"] = args.backend
    threads.limit_environment(args.threads)
    threads.limit_backend(args.threads)
    result = probe(
        args.configuration, args.width, args.depth, args.batch, args.steps
    )
    sys.stdout.write(MARKER + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
