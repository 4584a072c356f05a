"""Benchmark 18's report: a traced step's time, summed kernel by kernel.

    python -m tests.benchmarks.step_profile_report DIR --steps 10 \\
        [--top 20] [--output FILE.json]

Reads the `*.xplane.pb` trace that `step_profile` wrote (the XSpace
protocol buffer of JAX's profiler) and sums, per kernel kind, the time a
step spent in it: XLA's kernels by their HLO name with the trailing
number removed (`select_convert_fusion.17` counts as
`select_convert_fusion`). Runs where TensorFlow is installed: the
protocol buffer's Python module ships with it
(`tensorflow.tsl.profiler.protobuf.xplane_pb2`), so read the trace from
the `tensorflow` tox environment.
"""

import argparse
import collections
import json
import pathlib
import re
import sys

# An HLO instruction's name: lowercase, its number after a dot. The
# trace's other events are Python frames (`$...`), runtime scopes
# (`ThunkExecutor::Execute`, `DevicePut`) and the like.
_XLA_KERNEL = re.compile(r"^[a-z][a-z0-9_\-]*(\.\d+)?$")


def kernel_kind(name):
    """The kind of an XLA kernel's traced name (its name without the
    number), or None for an event that is not an XLA kernel."""
    if not _XLA_KERNEL.match(name):
        return None
    return re.sub(r"\.\d+$", "", name)


def kernel_times(events, steps):
    """Milliseconds a step and kernels a step of each kind.

    Args:
        events: `(name, duration in picoseconds)` pairs.
        steps: How many steps the trace holds.

    Returns:
        A list of dicts (`kind`, `ms_per_step`, `kernels_per_step`),
        longest first.
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1. Received: steps={steps}")
    total = collections.Counter()
    count = collections.Counter()
    for name, duration in events:
        kind = kernel_kind(name)
        if kind is not None:
            total[kind] += duration
            count[kind] += 1
    return [
        {
            "kind": kind,
            "ms_per_step": picoseconds / 1e9 / steps,
            "kernels_per_step": count[kind] / steps,
        }
        for kind, picoseconds in total.most_common()
    ]


def trace_events(directory):
    """`(name, duration in picoseconds)` of every event of the newest
    trace under `directory`."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    files = sorted(pathlib.Path(directory).rglob("*.xplane.pb"))
    if not files:
        raise ValueError(
            f"No *.xplane.pb trace under the directory. Received: {directory}"
        )
    space = xplane_pb2.XSpace()
    space.ParseFromString(files[-1].read_bytes())
    for plane in space.planes:
        names = {k: v.name for k, v in plane.event_metadata.items()}
        for line in plane.lines:
            for event in line.events:
                yield names.get(event.metadata_id, ""), event.duration_ps


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    rows = kernel_times(trace_events(args.trace), args.steps)
    kernels = sum(row["ms_per_step"] for row in rows)
    print(f"kernels: {kernels:.2f} ms a step")
    for row in rows[: args.top]:
        print(
            f"{row['ms_per_step']:8.2f} ms {row['kernels_per_step']:6.1f}x "
            f"{row['kind']}"
        )
    if args.output:
        pathlib.Path(args.output).write_text(
            json.dumps({"kernels_ms_per_step": kernels, "rows": rows}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
