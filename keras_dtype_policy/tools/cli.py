"""The `keras-dtype-policy` command line (also `python -m keras_dtype_policy`).

Every command runs on the backend that `KERAS_BACKEND` names. A user error
(a missing file, a file that is no model, an unknown policy, a bad option,
a backend that does not import) prints one line,
`keras-dtype-policy: error: ...`, on standard error and exits with status 2
for a bad command line and 1 for anything else, without a traceback.
`--help` and `--version` need no backend.

Output is plain lines where standard output is no terminal or `NO_COLOR` is
set (see `terminal`); at a terminal the demo shows Keras' progress bar.
"""

import argparse
import importlib
import importlib.util
import json
import os
import pathlib
import re
import sys

PROG = "keras-dtype-policy"
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


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, like the others."""

    def error(self, message):
        raise CommandError(
            f"{message} (see '{self.prog} --help')", status=USAGE_ERROR
        )


def build_parser():
    """Returns the parser of the command line and its commands."""
    from keras_dtype_policy import __version__

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
    _add_demo(commands)
    _add_inspect(commands)
    _add_migrate(commands)
    _add_doctor(commands)
    _add_audit(commands)
    _add_find_nonfinite(commands)
    return parser


def _add_demo(commands):
    demo = commands.add_parser(
        "demo",
        help="train a small convnet on real digits under a policy",
        description="Train a small convnet on scikit-learn's handwritten "
        "digits (shipped with scikit-learn, nothing is downloaded) under a "
        "policy and then under float32, and show each layer's dtypes, the "
        "loss-scale trajectory, and step time, peak memory and test "
        "accuracy side by side. Needs the 'demo' extra.",
    )
    demo.add_argument(
        "--policy",
        help="the policy to demonstrate, such as mixed_float16 or "
        "mixed_bfloat16 (default: the policy 'doctor' recommends; where "
        "that is float32, mixed_bfloat16, or mixed_float16 on a GPU that "
        "computes float16 fast, next to the advice)",
    )
    demo.add_argument(
        "--epochs",
        type=_positive_int,
        default=5,
        help="epochs per run (default: 5)",
    )
    demo.add_argument(
        "--samples",
        type=_positive_int,
        metavar="N",
        help="train on at most N images, for a quick run (default: all)",
    )
    demo.add_argument(
        "--plot",
        metavar="PATH",
        help="write a PNG of the loss scale and the loss over the steps "
        "(needs the 'plot' extra)",
    )
    demo.set_defaults(handler=_run_demo)


def _add_inspect(commands):
    inspect = commands.add_parser(
        "inspect",
        help="show a saved model's layers, policies and loss scaling",
        description="Load a .keras or legacy .h5 model file (tf.keras 2 "
        "files included), or a SavedModel directory that tf.keras 2 wrote "
        "(which needs TensorFlow), and show every layer's path, class, "
        "policy, "
        "compute and variable dtype, parameters and their bytes, and the "
        "optimizer's loss-scale settings and state.",
    )
    inspect.add_argument(
        "model",
        metavar="MODEL",
        help="a .keras or .h5 file, or a tf.keras 2 SavedModel directory",
    )
    inspect.add_argument(
        "--json", action="store_true", help="print JSON, for machines"
    )
    _add_import_option(inspect)
    inspect.set_defaults(handler=_run_inspect)


def _add_migrate(commands):
    migrate = commands.add_parser(
        "migrate",
        help="rewrite a tf.keras 2 model file as a Keras 3 .keras file",
        description="Rewrite a model that tf.keras 2 saved (.h5, .keras, or "
        "a SavedModel directory, which needs TensorFlow) as a Keras 3 .keras "
        "file with this package's equivalents, weights kept, and the "
        "optimizer and its state for a compiled model (a SavedModel's loss "
        "scale and its counter too). "
        "Prints every change and any loss scale dropped, and checks that "
        "the new file loads with the same weights.",
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
        "layers the file pins to float32 stay float32",
    )
    _add_import_option(migrate)
    migrate.set_defaults(handler=_run_migrate)


def _add_doctor(commands):
    doctor = commands.add_parser(
        "doctor",
        help="show the devices, their float16/bfloat16 speed, and a policy",
        description="Show the backend and its devices, whether each "
        "computes float16 and bfloat16 fast, and the policy this machine "
        "trains best under.",
    )
    doctor.add_argument(
        "--json", action="store_true", help="print JSON, for machines"
    )
    doctor.set_defaults(handler=_run_doctor)


def _add_audit(commands):
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
        type=_positive_int,
        default=256,
        metavar="N",
        help="use at most N samples (default: 256)",
    )
    audit.add_argument(
        "--learning-rate",
        type=_positive_float,
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
    _add_import_option(audit)
    audit.set_defaults(handler=_run_audit)


def _add_find_nonfinite(commands):
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
        type=_positive_int,
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
    _add_import_option(command)
    command.set_defaults(handler=_run_find_nonfinite)


def _add_import_option(command):
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
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return error.status
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`| head`): nothing more to say to it.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return FAILURE
    return status or 0


def _check_backend():
    """Reports, in one line, a backend that Keras could not import."""
    import keras_dtype_policy

    error = getattr(keras_dtype_policy, "_backend_error", None)
    if error is not None:
        raise CommandError(str(error))


def _run_demo(args):
    from keras_dtype_policy.policies import hardware
    from keras_dtype_policy.tools import advice
    from keras_dtype_policy.tools import terminal

    _require("sklearn", "the demo needs scikit-learn", "demo")
    try:
        choice = advice.demo_choice(hardware.list_devices())
    except RuntimeError:
        choice = None
    policy = args.policy
    if policy is None:
        policy = "mixed_bfloat16" if choice is None else choice.policy
    _check_demo_policy(policy)
    plot_path = None
    if args.plot is not None:
        plot_path = _check_plot_path(args.plot)
    from keras_dtype_policy.tools.demo import run_demo

    run_demo(
        policy=policy,
        epochs=args.epochs,
        max_samples=args.samples,
        plot_path=plot_path,
        verbose=terminal.fit_verbosity(),
        advice=choice,
    )


def _run_inspect(args):
    from keras_dtype_policy.tf_keras_compat.model_files import ModelFileError
    from keras_dtype_policy.tools import model_report

    _import_modules(args.imports)
    try:
        report = model_report.build_report(args.model)
    except ModelFileError as error:
        raise CommandError(_with_hint(error)) from None
    _print_report(report, model_report.format_report, args.json)


def _run_migrate(args):
    from keras_dtype_policy.tf_keras_compat import migrate
    from keras_dtype_policy.tf_keras_compat.model_files import ModelFileError
    from keras_dtype_policy.tools.migration_report import format_migration

    _import_modules(args.imports)
    try:
        migration = migrate.migrate(
            args.old, args.new, overwrite=args.force, policy=args.policy
        )
    except ModelFileError as error:
        raise CommandError(_with_hint(error)) from None
    print("\n".join(format_migration(migration)))


def _run_audit(args):
    from keras_dtype_policy.tf_keras_compat import model_files
    from keras_dtype_policy.tools import audit

    _check_policy_option(args.policy)
    plot_path = None
    if args.plot is not None:
        plot_path = _check_plot_path(args.plot)
    _import_modules(args.imports)
    x, y = _read_audit_data(args.data, args.samples)
    try:
        model, _ = model_files.load_model(
            model_files.read_model_file(args.model)
        )
    except model_files.ModelFileError as error:
        raise CommandError(_with_hint(error)) from None
    if isinstance(x, dict):
        x = _inputs_by_name(model, x, args.data)
    try:
        table = audit.audit(
            model, policy=args.policy, x=x, y=y, samples=args.samples
        )
    except (TypeError, ValueError) as error:
        raise CommandError(f"{args.model}: {error}") from None
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


def _run_find_nonfinite(args):
    from keras_dtype_policy.tf_keras_compat import model_files
    from keras_dtype_policy.tools import nonfinite

    _import_modules(args.imports)
    x, y = _read_audit_data(args.data, args.samples)
    try:
        model, _ = model_files.load_model(
            model_files.read_model_file(args.model)
        )
    except model_files.ModelFileError as error:
        raise CommandError(_with_hint(error)) from None
    if isinstance(x, dict):
        x = _inputs_by_name(model, x, args.data)
    try:
        report = nonfinite.find_nonfinite(
            model, x, y, loss_scale=args.loss_scale
        )
    except (TypeError, ValueError) as error:
        raise CommandError(f"{args.model}: {error}") from None
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


def _read_audit_data(path, samples):
    """Returns `(x, y)` from an `.npz` file; x a dict for named inputs."""
    if path is None:
        return None, None
    import numpy as np

    try:
        with np.load(path) as data:
            arrays = {key: data[key][:samples] for key in data.files}
    except (OSError, ValueError) as error:
        raise CommandError(f"--data {path}: cannot be read: {error}") from None
    y = arrays.pop("y", None)
    if "x" in arrays:
        return arrays["x"], y
    if not arrays:
        raise CommandError(f"--data {path}: holds no array 'x'")
    return arrays, y


def _inputs_by_name(model, arrays, path):
    names = [tensor.name for tensor in model.inputs]
    missing = [name for name in names if name not in arrays]
    if missing:
        raise CommandError(
            f"--data {path}: holds no array 'x' and none for the model's "
            f"inputs {', '.join(missing)}"
        )
    values = [arrays[name] for name in names]
    return values[0] if len(values) == 1 else values


def _run_doctor(args):
    from keras_dtype_policy.tools import doctor

    try:
        report = doctor.build_report()
    except RuntimeError as error:
        raise CommandError(str(error)) from None
    _print_report(report, doctor.format_report, args.json)


def _import_modules(names):
    """Imports the modules named by `--import`, in order.

    Like `python -m`, a module in the current directory is found.
    """
    if names and "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    for name in names:
        try:
            if name.endswith(".py"):
                _import_file(name)
            else:
                importlib.import_module(name)
        except CommandError:
            raise
        except ModuleNotFoundError as error:
            if error.name and (
                name == error.name or name.startswith(error.name + ".")
            ):
                raise CommandError(
                    f"--import {name}: no module named {error.name!r} on "
                    "PYTHONPATH or in the current directory"
                ) from None
            raise CommandError(_import_failure(name, error)) from None
        except Exception as error:
            raise CommandError(_import_failure(name, error)) from None


def _import_file(path):
    if not pathlib.Path(path).is_file():
        raise CommandError(f"--import {path}: no such file")
    name = pathlib.Path(path).stem
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise


def _import_failure(name, error):
    lines = str(error).strip().splitlines()
    detail = f": {lines[0]}" if lines else ""
    return (
        f"--import {name}: importing it failed: {type(error).__name__}{detail}"
    )


def _with_hint(error):
    """Returns the message of a `ModelFileError`, with what to do about a
    class that Keras could not locate: import the module that defines it."""
    from keras_dtype_policy.tf_keras_compat.model_files import innermost_cause

    message = str(error)
    cause = innermost_cause(error)
    if "Could not locate class" not in str(cause):
        return message
    module = re.search(r"'module': '([\w.]+)'", str(cause))
    if module and not module.group(1).startswith("keras"):
        return (
            f"{message} (import the module that defines it: --import "
            f"{module.group(1)})"
        )
    return f"{message} (import the module that defines it: --import MODULE)"


def _print_report(report, format_report, as_json):
    """Prints `report` as JSON, or as the lines `format_report` makes."""
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        print("\n".join(format_report(report)))


def _positive_float(text):
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(
            f"must be a number above 0, not {text!r}"
        )
    return value


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(
            f"must be a whole number of at least 1, not {text!r}"
        )
    return value


def _check_demo_policy(name):
    import keras

    from keras_dtype_policy.policies import names as policy_names

    try:
        compute_dtype, _ = policy_names.parse_policy_name(name)
    except (TypeError, ValueError) as error:
        raise CommandError(f"--policy: {error}", status=USAGE_ERROR) from None
    if not keras.backend.is_float_dtype(compute_dtype):
        raise CommandError(
            f"--policy: the demo trains under a floating-point policy, such "
            f"as mixed_float16 or mixed_bfloat16, not {name!r}",
            status=USAGE_ERROR,
        )


def _check_plot_path(text):
    path = pathlib.Path(text)
    if path.suffix.lower() != ".png":
        raise CommandError(
            f"--plot: the file's name must end in .png, not {text!r}",
            status=USAGE_ERROR,
        )
    if not path.parent.is_dir():
        raise CommandError(f"--plot: no such directory: {path.parent}")
    _require("matplotlib", "--plot needs matplotlib", "plot")
    return path


def _require(module, what, extra):
    """Imports `module`, or reports the extra that installs it."""
    try:
        importlib.import_module(module)
    except ImportError:
        raise CommandError(
            f"{what}, which is not installed: pip install "
            f"'keras_dtype_policy[{extra}]'"
        ) from None
