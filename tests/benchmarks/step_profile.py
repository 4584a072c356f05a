"""Benchmark 18: where a `fit` step's time goes, kernel by kernel.

    KERAS_BACKEND=jax python -m tests.benchmarks.step_profile \\
        --configuration stochastic_bfloat16+8bit --batch 64 --trace DIR

Builds benchmark 9's residual MLP (`low_precision_speed.build`: 4.3M
parameters, Adam) under one of its configurations, runs one untimed
epoch of `fit` (it compiles), then traces `--steps` steps of `fit` with
`jax.profiler` into `DIR`. `step_profile_report` reads the trace and sums
the time of each compiled kernel a step. JAX only: its whole step is one
XLA program whose kernels the trace names; TensorFlow's trace of `fit`
(`tf.profiler.experimental`) showed its graph's kernels in one run and
only the enclosing function in another, and PyTorch's step is no
compiled program (its profiler is `torch.profiler`).

Never pin the process to one core with `taskset` while a thread pool is
wider than one thread: TensorFlow's XLA-compiled steps took 67 ms instead
of 35 that way (a spinning pool thread shares the core).
"""

import argparse
import os
import sys

STEPS = 10


def trace(configuration, batch, steps, directory):
    """Fits benchmark 9's model under `configuration` and traces it."""
    import jax
    import numpy as np

    from keras_dtype_policy.policies.global_policy import policy_scope
    from tests.benchmarks import low_precision_speed

    with policy_scope("float32"):
        reference = low_precision_speed.residual_mlp()
    model = low_precision_speed.build(configuration, reference.get_weights())
    rng = np.random.default_rng(0)
    width = low_precision_speed.WIDTH
    x = rng.normal(size=(batch * steps, width)).astype("float32")
    y = rng.integers(0, 10, size=(batch * steps,))
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0)
    jax.profiler.start_trace(directory)
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0)
    jax.profiler.stop_trace()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configuration", default="stochastic_bfloat16+8bit")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--trace", required=True)
    args = parser.parse_args(argv)
    backend = os.environ.get("KERAS_BACKEND", "tensorflow")
    if backend != "jax":
        parser.error(
            "step_profile traces JAX's compiled step: set KERAS_BACKEND=jax."
            f" Received: KERAS_BACKEND={backend!r}"
        )
    from tests.benchmarks import threads

    threads.limit_environment(args.threads)
    from tests.benchmarks import low_precision_speed

    if args.configuration not in low_precision_speed.CONFIGURATIONS:
        parser.error(
            "--configuration must be one of benchmark 9's: "
            f"{', '.join(low_precision_speed.CONFIGURATIONS)}. "
            f"Received: {args.configuration!r}"
        )
    threads.limit_backend(args.threads)
    trace(args.configuration, args.batch, args.steps, args.trace)
    print(f"traced {args.steps} steps into {os.path.abspath(args.trace)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
