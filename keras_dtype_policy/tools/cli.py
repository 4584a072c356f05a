"""The `keras-dtype-policy` command line (also `python -m keras_dtype_policy`).

Every command runs on the backend that `KERAS_BACKEND` names. A user error
(a missing file, a file that is no model, an unknown policy, a bad option,
a backend that does not import, a damaged or hostile file) prints one line,
`keras-dtype-policy: error: ...`, on standard error and exits with status 2
for a bad command line and 1 for anything else, without a traceback.
`--help` and `--version` need no backend: the commands (`cli_machine`,
`cli_model_files`, `cli_numerics`, `cli_plan`) import Keras only when they run.

Output is plain lines where standard output is no terminal or `NO_COLOR` is
set (see `terminal`); at a terminal the demo shows Keras' progress bar.
"""

import argparse
import os
import sys

from keras_dtype_policy import backend_check
from keras_dtype_policy.tools import cli_machine
from keras_dtype_policy.tools import cli_model_files
from keras_dtype_policy.tools import cli_numerics
from keras_dtype_policy.tools import cli_plan
from keras_dtype_policy.tools.cli_arguments import FAILURE
from keras_dtype_policy.tools.cli_arguments import NONFINITE
from keras_dtype_policy.tools.cli_arguments import UNSAFE
from keras_dtype_policy.tools.cli_arguments import USAGE_ERROR
from keras_dtype_policy.tools.cli_arguments import CommandError
from keras_dtype_policy.tools.cli_errors import describe
from keras_dtype_policy.tools.cli_errors import one_line
from keras_dtype_policy.version import __version__

__all__ = ["NONFINITE", "UNSAFE", "CommandError", "build_parser", "main"]

PROG = "keras-dtype-policy"


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, like the others."""

    def error(self, message):
        raise CommandError(
            f"{message} (see '{self.prog} --help')", status=USAGE_ERROR
        )


def build_parser():
    """Returns the parser of the command line and its commands."""
    parser = _Parser(
        prog=PROG,
        description="Mixed precision for every Keras 3 backend. Every "
        "command runs on the backend that the KERAS_BACKEND environment "
        "variable names (jax, tensorflow or torch): export "
        "KERAS_BACKEND=jax, for one. Output is plain lines where it goes "
        "to no terminal or NO_COLOR is set.",
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {__version__}"
    )
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND"
    )
    cli_machine.add_demo(commands)
    cli_model_files.add_inspect(commands)
    cli_model_files.add_migrate(commands)
    cli_machine.add_doctor(commands)
    cli_numerics.add_audit(commands)
    cli_numerics.add_find_nonfinite(commands)
    cli_plan.add_plan(commands)
    return parser


def main(argv=None):
    """Runs the command line.

    Args:
        argv: The arguments, without the program name; defaults to
            `sys.argv[1:]`.

    Returns:
        The exit status: 0 on success.
    """
    try:
        args = build_parser().parse_args(argv)
        _check_backend()
        status = args.handler(args)
    except CommandError as error:
        print(f"{PROG}: error: {one_line(error)}", file=sys.stderr)
        return error.status
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`| head`): nothing more to say to it.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return FAILURE
    except Exception as error:
        # The last resort: whatever a file made fail, one line, no
        # traceback (the commands name the usual failures themselves).
        print(f"{PROG}: error: {one_line(describe(error))}", file=sys.stderr)
        return FAILURE
    return status or 0


def _check_backend():
    """Reports, in one line, a backend that Keras could not import."""
    error = backend_check.keras_import_error()
    if error is not None:
        raise CommandError(str(error))
