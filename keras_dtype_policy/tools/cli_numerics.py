"""The `audit` and `find-nonfinite` commands: a model's numerics.

The package's Keras modules are imported inside the functions: the command
line's parser must work where Keras does not import.
"""

import json

from keras_dtype_policy.tools.cli_arguments import NONFINITE
from keras_dtype_policy.tools.cli_arguments import UNSAFE
from keras_dtype_policy.tools.cli_arguments import USAGE_ERROR
from keras_dtype_policy.tools.cli_arguments import CommandError
from keras_dtype_policy.tools.cli_arguments import add_import_option
from keras_dtype_policy.tools.cli_arguments import check_plot_path
from keras_dtype_policy.tools.cli_arguments import positive_float
from keras_dtype_policy.tools.cli_arguments import positive_int
from keras_dtype_policy.tools.cli_errors import file_failure
from keras_dtype_policy.tools.cli_inputs import load_model_and_data


def add_audit(commands):
    """Adds the `audit` command to the command line's subparsers."""
    audit = commands.add_parser(
        "audit",
        help="compare a model under a policy with float32, layer by layer",
        description="Run a .keras or .h5 model on real or generated inputs "
        "in float32 and under a candidate policy, and show per layer the "
        "relative error of its output, the fractions of its outputs that "
        "overflow or flush to zero in the compute dtype and, with labels "
        "and the model's compiled loss, of its weight gradients that flush "
        "to zero without and with loss scaling; then the layers to keep in "
        "float32 and whether the policy is safe. Exits with status 3 when "
        "it is not.",
    )
    audit.add_argument("model", metavar="MODEL", help="a .keras or .h5 file")
    audit.add_argument(
        "--policy",
        default="mixed_float16",
        help="the candidate policy (default: mixed_float16)",
    )
    audit.add_argument(
        "--data",
        metavar="FILE.npz",
        help="inputs in array 'x' (or one array per model input, by name) "
        "and labels in 'y' (default: generated inputs, no labels)",
    )
    audit.add_argument(
        "--samples",
        type=positive_int,
        default=256,
        metavar="N",
        help="use at most N samples (default: 256)",
    )
    audit.add_argument(
        "--learning-rate",
        type=positive_float,
        metavar="LR",
        help="also count, per weight, the updates of one Adam step at LR "
        "that weights stored in the policy's compute dtype (bfloat16, "
        "float16) would round away; needs labels (--data with 'y') and "
        "the model's compiled loss",
    )
    audit.add_argument(
        "--json", action="store_true", help="print JSON, for machines"
    )
    audit.add_argument(
        "--plot",
        metavar="PATH",
        help="write a PNG of the per-layer numbers (needs the 'plot' extra)",
    )
    add_import_option(audit)
    audit.set_defaults(handler=run_audit)


def add_find_nonfinite(commands):
    """Adds the `find-nonfinite` command to the command line's subparsers."""
    command = commands.add_parser(
        "find-nonfinite",
        help="name the first layer (and gradients) that go inf or NaN",
        description="Run one batch of real inputs through a .keras or .h5 "
        "model, layer by layer, and name the first layer whose output holds "
        "a NaN or Inf or overflows its compute dtype, with the values it "
        "saw; with labels in the data and the model's compiled loss, also "
        "the variables whose gradients are not finite. Exits with status 3 "
        "when something is not finite.",
    )
    command.add_argument("model", metavar="MODEL", help="a .keras or .h5 file")
    command.add_argument(
        "--data",
        metavar="FILE.npz",
        required=True,
        help="inputs in array 'x' (or one array per model input, by name) "
        "and, optionally, labels in 'y'",
    )
    command.add_argument(
        "--samples",
        type=positive_int,
        default=32,
        metavar="N",
        help="the batch: the first N samples (default: 32)",
    )
    command.add_argument(
        "--loss-scale",
        type=float,
        default=1.0,
        metavar="S",
        help="multiply the loss by S before the gradients, as loss scaling "
        "does (default: 1; 32768 is where a dynamic scale starts)",
    )
    add_import_option(command)
    command.set_defaults(handler=run_find_nonfinite)


def run_audit(args):
    """Runs `audit`; returns `UNSAFE` where the policy is not safe."""
    from keras_dtype_policy.tools import audit

    _check_policy_option(args.policy)
    plot_path = None
    if args.plot is not None:
        plot_path = check_plot_path(args.plot)
    model, x, y = load_model_and_data(args)
    try:
        table = audit.audit(
            model, policy=args.policy, x=x, y=y, samples=args.samples
        )
    except (TypeError, ValueError) as error:
        raise CommandError(f"{args.model}: {error}") from None
    except Exception as error:
        raise file_failure(args.model, error) from None
    lost = None
    if args.learning_rate is not None:
        lost = _lost_updates(model, x, y, args)
    if args.json:
        report = table.to_dict()
        if lost is not None:
            report["lost_updates"] = lost.to_dict()
        print(json.dumps(report, indent=2))
    else:
        print(str(table))
        if lost is not None:
            print()
            print(str(lost))
    if plot_path is not None:
        table.plot(plot_path)
    return 0 if table.safe else UNSAFE


def _lost_updates(model, x, y, args):
    """Returns `lost_updates` for the audit's `--learning-rate`."""
    from keras_dtype_policy.policies.policy import DTypePolicy
    from keras_dtype_policy.tools.lost_updates import lost_updates

    dtype = DTypePolicy(args.policy).compute_dtype
    if dtype not in ("bfloat16", "float16"):
        raise CommandError(
            f"--learning-rate: {args.policy} computes in {dtype}: no "
            "update of a weight in that dtype is counted as lost; give a "
            "bfloat16 or float16 policy",
            status=USAGE_ERROR,
        )
    if y is None:
        raise CommandError(
            "--learning-rate needs labels: --data with an array 'y'",
            status=USAGE_ERROR,
        )
    try:
        return lost_updates(model, x, y, args.learning_rate, dtype=dtype)
    except (TypeError, ValueError) as error:
        raise CommandError(f"{args.model}: {error}") from None
    except Exception as error:
        raise file_failure(args.model, error) from None


def run_find_nonfinite(args):
    """Runs `find-nonfinite`; returns `NONFINITE` where something was."""
    from keras_dtype_policy.tools import nonfinite

    model, x, y = load_model_and_data(args)
    try:
        report = nonfinite.find_nonfinite(
            model, x, y, loss_scale=args.loss_scale
        )
    except (TypeError, ValueError) as error:
        raise CommandError(f"{args.model}: {error}") from None
    except Exception as error:
        raise file_failure(args.model, error) from None
    print(str(report))
    return NONFINITE if report else 0


def _check_policy_option(name):
    from keras_dtype_policy.policies import precision_rules

    try:
        precision_rules.PrecisionRules(name)
    except ValueError:
        raise CommandError(
            f"--policy: expected a floating-point policy, such as "
            f"mixed_float16 or mixed_bfloat16, not {name!r}",
            status=USAGE_ERROR,
        ) from None
