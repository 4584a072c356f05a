"""The `doctor` and `demo` commands: this machine, and training on it.

The package's Keras modules are imported inside the functions: the command
line's parser must work where Keras does not import.
"""

from keras_dtype_policy.tools.cli_arguments import USAGE_ERROR
from keras_dtype_policy.tools.cli_arguments import CommandError
from keras_dtype_policy.tools.cli_arguments import check_plot_path
from keras_dtype_policy.tools.cli_arguments import positive_int
from keras_dtype_policy.tools.cli_arguments import print_report
from keras_dtype_policy.tools.cli_arguments import require


def add_demo(commands):
    """Adds the `demo` command to the command line's subparsers."""
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
        type=positive_int,
        default=5,
        help="epochs per run (default: 5)",
    )
    demo.add_argument(
        "--samples",
        type=positive_int,
        metavar="N",
        help="train on at most N images, for a quick run (default: all)",
    )
    demo.add_argument(
        "--plot",
        metavar="PATH",
        help="write a PNG of the loss scale and the loss over the steps "
        "(needs the 'plot' extra)",
    )
    demo.set_defaults(handler=run_demo)


def add_doctor(commands):
    """Adds the `doctor` command to the command line's subparsers."""
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
    doctor.set_defaults(handler=run_doctor)


def run_demo(args):
    """Runs `demo`: trains under a policy and under float32."""
    from keras_dtype_policy.policies import hardware
    from keras_dtype_policy.tools import advice
    from keras_dtype_policy.tools import terminal
    from keras_dtype_policy.tools.demo import run_demo as train

    require("sklearn", "the demo needs scikit-learn", "demo")
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
        plot_path = check_plot_path(args.plot)
    train(
        policy=policy,
        epochs=args.epochs,
        max_samples=args.samples,
        plot_path=plot_path,
        verbose=terminal.fit_verbosity(),
        advice=choice,
    )


def run_doctor(args):
    """Runs `doctor`: prints the devices and the policy to train under."""
    from keras_dtype_policy.tools import doctor

    try:
        report = doctor.build_report()
    except RuntimeError as error:
        raise CommandError(str(error)) from None
    print_report(report, doctor.format_report, args.json)


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
