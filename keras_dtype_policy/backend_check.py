"""Whether Keras imports its backend, and what to tell the user if not.

Imports no Keras at module level: the package's `__init__` and the command
line both ask `keras_import_error()`, which imports Keras once and returns
the `ImportError` to raise or report, naming the backend and how to choose
another, the backend's own error as its `__cause__`.
"""

import functools
import importlib.util
import json
import os
import sys

BACKENDS = ("jax", "tensorflow", "torch")
PACKAGE = __name__.rpartition(".")[0]


@functools.cache
def keras_import_error():
    """Imports Keras once; returns None, or the `ImportError` it gave.

    Returns:
        None where Keras and its backend import, otherwise the
        `ImportError` for the user, whose `__cause__` is Keras' own error.
    """
    try:
        import keras  # noqa: F401
    except Exception as error:
        found = backend_import_error(error)
        found.__cause__ = error
        return found
    return None


def backend_import_error(error):
    """Returns the `ImportError` to raise when `import keras` failed."""
    if isinstance(error, ModuleNotFoundError) and error.name == "keras":
        return ImportError(
            "keras_dtype_policy needs Keras 3, which is not installed: "
            "pip install keras"
        )
    backend, source = configured_backend()
    others = [
        name
        for name in BACKENDS
        if name != backend and importlib.util.find_spec(name) is not None
    ]
    if others:
        choose = f"export KERAS_BACKEND={others[0]}"
        choose += f" (installed: {', '.join(others)})"
    else:
        choose = "install jax, tensorflow or torch; export KERAS_BACKEND=NAME"
    if backend not in BACKENDS:
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


def configured_backend():
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


def running_the_command_line():
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
            return module == PACKAGE or module.startswith(PACKAGE + ".")
    return False
