"""What the command line's commands share: errors, statuses, options, output.

Imports no Keras, so that `--help` and `--version` work where Keras does
not import.
"""

import argparse
import importlib
import json
import pathlib

USAGE_ERROR = 2
FAILURE = 1
UNSAFE = 3  # `audit`: the policy is not safe for the model
NONFINITE = 3  # `find-nonfinite`: something was not finite


class CommandError(Exception):
    """A user error that the command line reports in one line.

    Args:
        message: What went wrong, and what to do about it.
        status: The exit status.
    """

    def __init__(self, message, status=FAILURE):
        super().__init__(message)
        self.status = status


def add_import_option(command):
    """Adds the repeatable `--import MODULE` option to a command."""
    command.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE (a name such as my_package.layers, found on "
        "PYTHONPATH or in the current directory, or a .py file) before "
        "loading, so that the custom classes it registers with "
        "keras.saving.register_keras_serializable resolve; repeatable",
    )


def positive_float(text):
    """An argument type: a finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(
            f"must be a number above 0, not {text!r}"
        )
    return value


def positive_int(text):
    """An argument type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(
            f"must be a whole number of at least 1, not {text!r}"
        )
    return value


def check_plot_path(text):
    """Returns the `--plot` path, a `.png` in an existing directory."""
    path = pathlib.Path(text)
    if path.suffix.lower() != ".png":
        raise CommandError(
            f"--plot: the file's name must end in .png, not {text!r}",
            status=USAGE_ERROR,
        )
    if not path.parent.is_dir():
        raise CommandError(f"--plot: no such directory: {path.parent}")
    require("matplotlib", "--plot needs matplotlib", "plot")
    return path


def require(module, what, extra):
    """Imports `module`, or reports the extra that installs it."""
    try:
        importlib.import_module(module)
    except ImportError:
        raise CommandError(
            f"{what}, which is not installed: pip install "
            f"'keras_dtype_policy[{extra}]'"
        ) from None


def print_report(report, format_report, as_json):
    """Prints `report` as JSON, or as the lines `format_report` makes."""
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        print("\n".join(format_report(report)))
