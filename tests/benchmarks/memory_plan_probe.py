"""One check of the memory plan, in a fresh process: predict, then
measure.

Run by `memory_plan_check.py` from the repository root, one process a
model and configuration:

    python -m tests.benchmarks.memory_plan_probe --backend jax \
        --configuration kahan_bfloat16 --model dense --width 1024 \
        --depth 8 --batch 64 --steps 3

Builds the model (`dense`: a stack of Dense layers, benchmark 12's kind
at another width and batch; `embedding`: an Embedding of `--vocabulary`
rows, Dense layers over a sequence of `--length` tokens, a pooled
softmax), trains it as benchmark 12's probe does and reads the process's
peak resident memory; then asks `kdp.plan` for the same configuration's
prediction of the built model. One JSON line after `MARKER`.
"""

import argparse
import json
import os
import sys

from tests.benchmarks import threads

MARKER = "MEMORY_PLAN_RESULT "
LEARNING_RATE = 1e-4


def build_parser():
    from tests.benchmarks.quantized_state_probe import CONFIGURATIONS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", required=True)
    parser.add_argument(
        "--configuration", required=True, choices=tuple(CONFIGURATIONS)
    )
    parser.add_argument("--model", choices=("dense", "embedding"))
    parser.add_argument("--width", type=int, required=True)
    parser.add_argument("--depth", type=int, required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--vocabulary", type=int, default=50000)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    return parser


def build_model(args):
    """The model and a batch of its data, as numpy arrays."""
    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    dense = [
        keras.layers.Dense(
            args.width, activation="relu" if i < args.depth - 1 else None
        )
        for i in range(args.depth)
    ]
    if args.model == "dense":
        model = keras.Sequential([keras.Input((args.width,)), *dense])
        x = rng.standard_normal((args.batch, args.width)).astype("float32")
        y = rng.standard_normal((args.batch, args.width)).astype("float32")
        return model, x, y, "mean_squared_error"
    model = keras.Sequential(
        [
            keras.Input((args.length,), dtype="int32"),
            keras.layers.Embedding(args.vocabulary, args.width),
            *dense,
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(10),
        ]
    )
    x = rng.integers(0, args.vocabulary, (args.batch, args.length))
    y = rng.integers(0, 10, (args.batch,))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return model, x.astype("int32"), y.astype("int32"), loss


def probe(args):
    """Measures one configuration, then predicts it; returns a dict."""
    import keras

    import keras_dtype_policy as kdp
    from tests.benchmarks import backend_support
    from tests.benchmarks import low_precision
    from tests.benchmarks import process_memory
    from tests.benchmarks.quantized_state_probe import CONFIGURATIONS

    keras.utils.set_random_seed(0)
    keras.ops.convert_to_numpy(keras.ops.ones((2, 2)) * 2)
    policy, arguments = CONFIGURATIONS[args.configuration]
    with kdp.policy_scope(policy):
        model, x, y, loss = build_model(args)
    model.compile(
        optimizer=low_precision.make_optimizer(LEARNING_RATE, arguments),
        loss=loss,
    )
    model.train_on_batch(x, y)
    backend_support.sync(model.trainable_variables[0])
    first_peak = process_memory.peak_rss()
    can_reset = process_memory.reset_peak_rss()
    for _ in range(args.steps):
        model.train_on_batch(x, y)
    backend_support.sync(model.trainable_variables[0])
    steady_peak = process_memory.peak_rss() if can_reset else None
    predicted = kdp.plan(
        model, batch_size=args.batch, configurations=[args.configuration]
    ).rows[0]
    return {
        "configuration": args.configuration,
        "backend": backend_support.backend(),
        "device": backend_support.device(),
        "model": args.model,
        "width": args.width,
        "depth": args.depth,
        "batch": args.batch,
        "parameters": model.count_params(),
        "first_peak": first_peak,
        "steady_peak": steady_peak,
        "measured": max(first_peak, steady_peak or 0),
        "predicted": predicted.peak,
        "prediction": {
            key: getattr(predicted, key)
            for key in (
                "weights",
                "gradients",
                "optimizer_state",
                "activations",
                "working_set",
                "baseline",
            )
        },
    }


def main(argv=None):
    """Runs one probe and prints its result; returns the exit status."""
    args = build_parser().parse_args(argv)
    os.environ["KERAS_BACKEND"] = args.backend
    threads.limit_environment(args.threads)
    threads.limit_backend(args.threads)
    result = probe(args)
    sys.stdout.write(MARKER + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
