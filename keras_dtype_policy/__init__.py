"""Dtype policies and loss scaling for every Keras 3 backend.

Importing the package registers its classes with Keras serialization and
installs its compile hook (see `install` and `uninstall`). If Keras cannot
import its backend, the import raises an `ImportError` that names the
backend and how to choose another, the backend's own error chained.
"""

import importlib.util
import json
import os
import sys

__version__ = "0.1.0"

_BACKENDS = ("jax", "tensorflow", "torch")


def _backend_import_error(error):
    """Returns the `ImportError` to raise when `import keras` failed."""
    if isinstance(error, ModuleNotFoundError) and error.name == "keras":
        return ImportError(
            "keras_dtype_policy needs Keras 3, which is not installed: "
            "pip install keras"
        )
    backend, source = _configured_backend()
    others = [
        name
        for name in _BACKENDS
        if name != backend and importlib.util.find_spec(name) is not None
    ]
    if others:
        choose = f"export KERAS_BACKEND={others[0]}"
        choose += f" (installed: {', '.join(others)})"
    else:
        choose = "install jax, tensorflow or torch; export KERAS_BACKEND=NAME"
    if backend not in _BACKENDS:
        return ImportError(
            f"{backend!r} ({source}) is not a Keras backend: choose jax, "
            f"tensorflow or torch: {choose}"
        )
    detail = (str(error).strip().splitlines() or [""])[0]
    return ImportError(
        f"Keras could not import its backend {backend} ({source}): "
        f"{type(error).__name__}: {detail}. "
        f"Install {backend}, or choose another backend: {choose}"
    )


def _configured_backend():
    """Returns the backend Keras is set to, and what sets it."""
    if os.environ.get("KERAS_BACKEND"):
        return os.environ["KERAS_BACKEND"], "set by KERAS_BACKEND"
    home = os.environ.get("KERAS_HOME") or os.path.expanduser("~/.keras")
    try:
        with open(os.path.join(home, "keras.json")) as f:
            backend = json.load(f).get("backend")
    except (OSError, ValueError, AttributeError):
        backend = None
    if isinstance(backend, str) and backend:
        return backend, (
            f"set in {os.path.join(home, 'keras.json')}, as KERAS_BACKEND "
            "is not set"
        )
    return "tensorflow", "Keras' default, as KERAS_BACKEND is not set"


def _running_the_command_line():
    """True while the command line imports the package.

    That is, the `keras-dtype-policy` script, or `python -m
    keras_dtype_policy` (while Python locates the module to run,
    `sys.argv[0]` is `"-m"`). The command line then reports a broken
    backend itself, in one line, with `--help` and `--version` still
    working.
    """
    program = os.path.basename(sys.argv[0]) if sys.argv else ""
    if program.startswith("keras-dtype-policy"):
        return True
    if program != "-m":
        return False
    args = getattr(sys, "orig_argv", [])
    for index, arg in enumerate(args[1:], start=1):
        if arg.startswith("-m"):
            module = arg[2:] or (
                args[index + 1] if index + 1 < len(args) else ""
            )
            return module == __name__ or module.startswith(__name__ + ".")
    return False


# Keras imports its backend here. Where the command line runs, the error
# waits in `_backend_error` for the command line to report it.
try:
    import keras  # noqa: F401
except Exception as error:
    _backend_error = _backend_import_error(error)
    if not _running_the_command_line():
        raise _backend_error from error
else:
    _backend_error = None

if _backend_error is None:
    from keras_dtype_policy import experimental
    from keras_dtype_policy import mixed_precision
    from keras_dtype_policy.loss_scaling.callbacks import LossScaleMonitor
    from keras_dtype_policy.loss_scaling.loss_scale import DynamicLossScale
    from keras_dtype_policy.loss_scaling.loss_scale import FixedLossScale
    from keras_dtype_policy.loss_scaling.loss_scale import LossScale
    from keras_dtype_policy.loss_scaling.loss_scale import get_loss_scale
    from keras_dtype_policy.loss_scaling.optimizer import LossScaleOptimizer
    from keras_dtype_policy.low_precision.optimizer import LowPrecisionOptimizer
    from keras_dtype_policy.patches import install
    from keras_dtype_policy.patches import is_installed
    from keras_dtype_policy.patches import uninstall
    from keras_dtype_policy.policies.global_policy import dtype_policy
    from keras_dtype_policy.policies.global_policy import policy_scope
    from keras_dtype_policy.policies.global_policy import set_dtype_policy
    from keras_dtype_policy.policies.hardware import SlowFloat16Warning
    from keras_dtype_policy.policies.policy import DTypePolicy
    from keras_dtype_policy.policies.precision_rules import PrecisionRule
    from keras_dtype_policy.policies.precision_rules import PrecisionRules
    from keras_dtype_policy.policies.precision_rules import float16_rules
    from keras_dtype_policy.policies.rules_application import apply_rules
    from keras_dtype_policy.policies.rules_application import precision_scope
    from keras_dtype_policy.tf_keras_compat import legacy_policy_configs  # noqa: F401
    from keras_dtype_policy.tf_keras_compat.bridge import model_from_json
    from keras_dtype_policy.tf_keras_compat.legacy_policy import Policy
    from keras_dtype_policy.tf_keras_compat.legacy_policy import (
        get_layer_policy,
    )
    from keras_dtype_policy.tf_keras_compat.legacy_policy import global_policy
    from keras_dtype_policy.tf_keras_compat.legacy_policy import (
        set_global_policy,
    )
    from keras_dtype_policy.tf_keras_compat.legacy_policy import set_policy
    from keras_dtype_policy.tf_keras_compat.load_override import load_model
    from keras_dtype_policy.tools.audit import audit
    from keras_dtype_policy.tools.lost_updates import lost_updates
    from keras_dtype_policy.tools.nonfinite import find_nonfinite

    install()

__all__ = [
    "DTypePolicy",
    "DynamicLossScale",
    "FixedLossScale",
    "LossScale",
    "LossScaleMonitor",
    "LossScaleOptimizer",
    "LowPrecisionOptimizer",
    "Policy",
    "PrecisionRule",
    "PrecisionRules",
    "SlowFloat16Warning",
    "apply_rules",
    "audit",
    "dtype_policy",
    "experimental",
    "find_nonfinite",
    "float16_rules",
    "get_layer_policy",
    "get_loss_scale",
    "global_policy",
    "install",
    "is_installed",
    "load_model",
    "lost_updates",
    "mixed_precision",
    "model_from_json",
    "policy_scope",
    "precision_scope",
    "set_dtype_policy",
    "set_global_policy",
    "set_policy",
    "uninstall",
]
