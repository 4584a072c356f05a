"""`--import MODULE`: the user's modules, imported before a model loads."""

import importlib
import importlib.util
import os
import pathlib
import sys

from keras_dtype_policy.tools.cli_arguments import CommandError


def import_modules(names):
    """Imports the modules named by `--import`, in order.

    Like `python -m`, a module in the current directory is found.

    Args:
        names: Module names, or paths of `.py` files.
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
