"""The `inspect` and `migrate` commands: a saved model file, read or
rewritten.

The package's Keras modules are imported inside the functions: the command
line's parser must work where Keras does not import.
"""

from keras_dtype_policy.tools.cli_arguments import CommandError
from keras_dtype_policy.tools.cli_arguments import add_import_option
from keras_dtype_policy.tools.cli_arguments import print_report
from keras_dtype_policy.tools.cli_errors import file_failure
from keras_dtype_policy.tools.cli_imports import import_modules
from keras_dtype_policy.tools.cli_inputs import check_model_path
from keras_dtype_policy.tools.cli_inputs import with_hint


def add_inspect(commands):
    """Adds the `inspect` command to the command line's subparsers."""
    inspect = commands.add_parser(
        "inspect",
        help="show a saved model's layers, policies and loss scaling",
        description="Load a .keras or legacy .h5 model file (tf.keras 2 "
        "files included), or a SavedModel directory that tf.keras 2 wrote "
        "(which needs TensorFlow), and show every layer's path, class, "
        "policy, "
        "compute and variable dtype, parameters and their bytes, and the "
        "optimizer's loss-scale settings and state, and the update and "
        "state dtype of a LowPrecisionOptimizer with its bytes a parameter. "
        "For a Keras weights file (.weights.h5) with optimizer state, show "
        "that state as its stored variables tell it.",
    )
    inspect.add_argument(
        "model",
        metavar="MODEL",
        help="a .keras or .h5 file, or a tf.keras 2 SavedModel directory",
    )
    inspect.add_argument(
        "--json", action="store_true", help="print JSON, for machines"
    )
    add_import_option(inspect)
    inspect.set_defaults(handler=run_inspect)


def add_migrate(commands):
    """Adds the `migrate` command to the command line's subparsers."""
    migrate = commands.add_parser(
        "migrate",
        help="rewrite a tf.keras 2 model file as a Keras 3 .keras file",
        description="Rewrite a model that tf.keras 2 saved (.h5, .keras, or "
        "a SavedModel directory, which needs TensorFlow) as a Keras 3 .keras "
        "file with this package's equivalents, weights kept, and the "
        "optimizer and its state for a compiled model (a SavedModel's loss "
        "scale and its counter too). "
        "Prints every change and any loss scale dropped, and checks that "
        "the new file loads with the same weights. The new file names the "
        "package's classes where the model uses them (Keras alone cannot "
        "load those); --to-keras writes one that Keras alone loads and "
        "trains on, from a package file too.",
    )
    migrate.add_argument(
        "old",
        metavar="OLD",
        help="the .h5 or .keras file, or the SavedModel directory",
    )
    migrate.add_argument("new", metavar="NEW", help="the .keras file to write")
    migrate.add_argument(
        "--force", action="store_true", help="replace NEW if it exists"
    )
    migrate.add_argument(
        "--policy",
        help="give every layer this policy (such as float32 or "
        "mixed_bfloat16), weights cast where a variable's dtype changes; "
        "layers the file pins to float32 stay float32; the optimizer state "
        "is carried over",
    )
    migrate.add_argument(
        "--to-keras",
        action="store_true",
        help="write a file Keras alone loads and trains on: each layer "
        "gets Keras' nearest policy (kahan_bfloat16 -> bfloat16), the "
        "optimizer is the Keras one inside the package's wrappers, its "
        "state dequantized and Kahan compensation folded into the weights",
    )
    add_import_option(migrate)
    migrate.set_defaults(handler=run_migrate)


def run_inspect(args):
    """Runs `inspect`: prints the report of a saved model."""
    from keras_dtype_policy.tf_keras_compat.keras_files import ModelFileError
    from keras_dtype_policy.tools import model_report
    from keras_dtype_policy.tools import weights_file_state

    import_modules(args.imports)
    check_model_path(args.model, "MODEL")
    try:
        report = model_report.build_report(args.model)
        format_report = model_report.format_report
    except ModelFileError as error:
        # A weights file of Keras 3 holds no model, but its optimizer
        # state can be told from the stored variables.
        report = _weights_file_report(args.model)
        if report is None:
            raise CommandError(with_hint(error)) from None
        format_report = weights_file_state.format_report
    except Exception as error:
        raise file_failure(args.model, error) from None
    print_report(report, format_report, args.json)


def _weights_file_report(path):
    from keras_dtype_policy.tools import weights_file_state

    try:
        return weights_file_state.build_report(path)
    except Exception as error:
        raise file_failure(path, error) from None


def run_migrate(args):
    """Runs `migrate`: rewrites a tf.keras 2 model as a Keras 3 file."""
    from keras_dtype_policy.tf_keras_compat import migrate
    from keras_dtype_policy.tf_keras_compat.keras_files import ModelFileError
    from keras_dtype_policy.tools.migration_report import format_migration

    import_modules(args.imports)
    check_model_path(args.old, "OLD")
    try:
        migration = migrate.migrate(
            args.old,
            args.new,
            overwrite=args.force,
            policy=args.policy,
            to_keras=args.to_keras,
        )
    except ModelFileError as error:
        raise CommandError(with_hint(error)) from None
    except Exception as error:
        raise file_failure(args.old, error) from None
    print("\n".join(format_migration(migration)))
