"""Where a layer call's time goes, under each arm's policy.

Not part of the suite: a tool for looking into benchmark 1. From the
repository root:

    python -m tests.benchmarks.profile_layer_call --backend torch \
        --policy mixed_bfloat16 --input tensor

For each arm it prints the time of `convert_input` alone (interleaved,
medians) and the time of whole layer calls, then profiles the layer calls
with cProfile and prints the functions that take the most time of their
own, with `convert_input`'s cumulative time per call.
"""

import argparse
import cProfile
import io
import os
import pstats

FUNCTION = "convert_input"


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--backend", required=True, choices=("tensorflow", "jax", "torch")
    )
    parser.add_argument("--policy", default="mixed_bfloat16")
    parser.add_argument(
        "--input", default="tensor", choices=("tensor", "numpy")
    )
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--top", type=int, default=15)
    return parser


def convert_block(layer, x, calls):
    """Returns a callable running `calls` calls of the layer's policy's
    `convert_input`, as `Layer.__call__` makes them."""
    policy = layer.dtype_policy
    autocast = layer.autocast
    dtype = layer.input_dtype

    def block():
        for _ in range(calls):
            policy.convert_input(x, autocast, dtype)

    return block


def profile(block):
    """Returns the pstats of one call of `block` under cProfile."""
    profiler = cProfile.Profile()
    profiler.runcall(block)
    return pstats.Stats(profiler)


def cumulative_per_call(stats_, name):
    """Returns (calls, cumulative seconds per call) of functions `name`."""
    calls = 0
    seconds = 0.0
    for (_, _, function), row in stats_.stats.items():
        if function == name:
            calls += row[1]
            seconds += row[3]
    return calls, (seconds / calls if calls else 0.0)


def top_functions(stats_, count):
    """Returns the text of the `count` functions with most own time."""
    stream = io.StringIO()
    stats_.stream = stream
    stats_.sort_stats("tottime").print_stats(count)
    return stream.getvalue()


def main(argv=None):
    args = build_parser().parse_args(argv)
    os.environ["KERAS_BACKEND"] = args.backend
    from tests.benchmarks import layer_call
    from tests.benchmarks import measure
    from tests.benchmarks import stats
    from tests.benchmarks.sizes import ARMS
    from tests.benchmarks.sizes import FULL

    layers = layer_call.make_layers(
        args.policy, FULL.layer_units, FULL.layer_shape[-1]
    )
    x = layer_call.make_input(args.input, FULL.layer_shape)
    print(f"backend {args.backend}, policy {args.policy}, input {args.input}")
    for title, make_block in (
        ("convert_input alone", convert_block),
        ("layer call", layer_call.call_block),
    ):
        measurements = {
            arm: measure.timed(
                make_block(layers[arm], x, args.calls), args.calls
            )
            for arm in ARMS
        }
        samples = measure.interleaved(measurements, args.repeats, warmup=1)
        medians = {arm: stats.summarize(samples[arm])["median"] for arm in ARMS}
        cells = ", ".join(f"{arm} {medians[arm] * 1e6:.2f} us" for arm in ARMS)
        difference = (medians["plugin"] - medians["keras"]) * 1e6
        print(f"{title}: {cells}; plugin - keras {difference:+.2f} us")
    for arm in ARMS:
        profiled = profile(layer_call.call_block(layers[arm], x, args.calls))
        calls, seconds = cumulative_per_call(profiled, FUNCTION)
        print(
            f"\n=== {arm}: {FUNCTION} {calls} calls, "
            f"{seconds * 1e6:.2f} us each under cProfile"
        )
        print(top_functions(profiled, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
