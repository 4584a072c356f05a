"""One measurement of benchmark 14, a keras-hub model, in a fresh process.

Run by `hub_peak_memory.py` from the repository root, one process per
configuration and size:

    python -m tests.benchmarks.hub_peak_memory_probe --backend torch \
        --configuration stochastic_bfloat16_8bit+release --layers 8 \
        --batch 8 --steps 40

It builds a `GPT2CausalLM` from a config (nothing downloaded; hidden 512,
vocabulary 8192, `--layers` transformer layers), compiles it with the
configuration's policy and optimizer (`quantized_state_probe
.CONFIGURATIONS`), and fine-tunes it on next-token prediction of
sequences `x[t + 1] = x[t] + 1 (mod vocabulary)` from random starts. It
prints one JSON line after `MARKER`: the parameters, the resident memory
after importing, the process's peak through training, the loss of the
first and the last steps. Needs keras-hub.
"""

import argparse
import json
import os
import sys

from tests.benchmarks import threads

MARKER = "HUB_PEAK_RESULT "
VOCABULARY = 8192
HIDDEN = 512
LENGTH = 128
LEARNING_RATE = 1e-4


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", required=True)
    parser.add_argument("--configuration", required=True)
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--threads", type=int, default=None)
    return parser


def probe(configuration, layers, batch, steps):
    """Fine-tunes one model; returns a dict of bytes and losses.

    Call only once `KERAS_BACKEND` is set.
    """
    import keras
    import keras_hub
    import numpy as np

    import keras_dtype_policy as kdp
    from tests.benchmarks import low_precision
    from tests.benchmarks import process_memory
    from tests.benchmarks.quantized_state_probe import CONFIGURATIONS

    keras.utils.set_random_seed(0)
    keras.ops.convert_to_numpy(keras.ops.ones((2, 2)) * 2)
    imported = process_memory.current_rss()
    policy, arguments = CONFIGURATIONS[configuration]
    with kdp.policy_scope(policy):
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=VOCABULARY,
            num_layers=layers,
            num_heads=8,
            hidden_dim=HIDDEN,
            intermediate_dim=4 * HIDDEN,
            max_sequence_length=LENGTH,
            dropout=0.0,
        )
        model = keras_hub.models.GPT2CausalLM(
            backbone=backbone, preprocessor=None
        )
    model.compile(
        optimizer=low_precision.make_optimizer(LEARNING_RATE, arguments),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(steps):
        start = rng.integers(0, VOCABULARY, (batch, 1))
        tokens = (start + np.arange(LENGTH + 1)) % VOCABULARY
        x = {
            "token_ids": tokens[:, :-1].astype("int32"),
            "padding_mask": np.ones((batch, LENGTH), "bool"),
        }
        logs = model.train_on_batch(
            x, tokens[:, 1:].astype("int32"), return_dict=True
        )
        losses.append(float(logs["loss"]))
    return {
        "configuration": configuration,
        "parameters": int(model.count_params()),
        "release_gradients": bool(
            getattr(model.optimizer, "release_gradients", False)
        ),
        "imported": imported,
        "peak": process_memory.peak_rss(),
        "first_losses": losses[:4],
        "last_losses": losses[-4:],
    }


def main(argv=None):
    """Runs one probe and prints its result; returns the exit status."""
    args = build_parser().parse_args(argv)
    os.environ["KERAS_BACKEND"] = args.backend
    threads.limit_environment(args.threads)
    threads.limit_backend(args.threads)
    result = probe(args.configuration, args.layers, args.batch, args.steps)
    sys.stdout.write(MARKER + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
