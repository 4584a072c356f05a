"""The `keras-dtype-policy` command line."""

import argparse
import sys


def build_parser():
    parser = argparse.ArgumentParser(
        prog="keras-dtype-policy",
        description="Mixed precision for every Keras 3 backend. Runs on the "
        "backend that KERAS_BACKEND names.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="Train a small model under a policy and show its dtypes."
    )
    demo.add_argument(
        "--policy", default="mixed_bfloat16", help="Default: mixed_bfloat16."
    )
    demo.add_argument("--epochs", type=int, default=3, help="Default: 3.")
    return parser


def main(argv=None):
    """Runs the command line; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from keras_dtype_policy import policy_names
        from keras_dtype_policy.demo import run_demo

        try:
            policy_names.parse_policy_name(args.policy)
        except (TypeError, ValueError) as error:
            print(f"keras-dtype-policy: error: {error}", file=sys.stderr)
            return 2
        if args.epochs < 1:
            print(
                "keras-dtype-policy: error: --epochs must be at least 1. "
                f"Received: {args.epochs}",
                file=sys.stderr,
            )
            return 2
        run_demo(policy=args.policy, epochs=args.epochs)
    return 0
