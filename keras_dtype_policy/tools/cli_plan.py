"""The `plan` command: a model's memory in each configuration, before
training.

The package's Keras modules are imported inside the functions: the command
line's parser must work where Keras does not import.
"""

import json

from keras_dtype_policy.tools.cli_arguments import USAGE_ERROR
from keras_dtype_policy.tools.cli_arguments import CommandError
from keras_dtype_policy.tools.cli_arguments import add_import_option
from keras_dtype_policy.tools.cli_arguments import positive_int
from keras_dtype_policy.tools.cli_errors import file_failure
from keras_dtype_policy.tools.cli_imports import import_modules
from keras_dtype_policy.tools.cli_inputs import check_model_path


def add_plan(commands):
    """Adds the `plan` command to the command line's subparsers."""
    plan = commands.add_parser(
        "plan",
        help="predict a model's training peak memory in each configuration",
        description="Predict the peak memory of a training step with Adam "
        "under each dtype policy and optimizer-state configuration of the "
        "package: weights, gradients, optimizer state, activations at the "
        "batch, the step's working set and the backend's baseline (both "
        "measured on a CPU). The model is built from its config without "
        "allocating its weights. Configurations that fit --budget come "
        "first, the one that fits the largest model first.",
    )
    plan.add_argument(
        "model",
        metavar="MODEL",
        nargs="?",
        help="a .keras file (or use --config)",
    )
    plan.add_argument(
        "--config",
        metavar="PATH",
        help="a model's JSON config instead of MODEL, such as a keras-hub "
        "preset's config.json",
    )
    plan.add_argument(
        "--batch-size",
        type=positive_int,
        required=True,
        help="the training batch size",
    )
    plan.add_argument(
        "--budget",
        help="the memory there is, such as 16GiB or 500MB (default: none)",
    )
    plan.add_argument(
        "--configurations",
        metavar="NAMES",
        help="comma-separated configurations to plan (default: all)",
    )
    plan.add_argument(
        "--json", action="store_true", help="print JSON, for machines"
    )
    add_import_option(plan)
    plan.set_defaults(handler=run_plan)


def run_plan(args):
    """Runs `plan`: prints the memory plan of a model file or config."""
    from keras_dtype_policy.tools import memory_plan

    if (args.model is None) == (args.config is None):
        raise CommandError(
            "give either MODEL or --config PATH (see 'keras-dtype-policy "
            "plan --help')",
            status=USAGE_ERROR,
        )
    import_modules(args.imports)
    try:
        budget = memory_plan.parse_budget(args.budget)
        names = memory_plan.configuration_names(args.configurations)
    except ValueError as error:
        raise CommandError(str(error), status=USAGE_ERROR) from None
    path = args.model or args.config
    check_model_path(path, "MODEL" if args.model else "--config")
    if args.config is not None and not path.lower().endswith(".json"):
        raise CommandError(f"--config {path}: not a .json config")
    try:
        result = memory_plan.plan(
            path,
            batch_size=args.batch_size,
            budget=budget,
            configurations=names,
        )
    except Exception as error:
        raise file_failure(path, error) from None
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(result)
