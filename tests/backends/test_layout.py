"""The package's wings and the direction of imports between them.

The policy core imports no other wing; low-precision training imports the
core; loss scaling imports the core and low-precision training (its
`LossScaleOptimizer` goes around a `LowPrecisionOptimizer`, and the compile
hook installs both); tf.keras 2 compatibility imports the core and loss
scaling; the tools may import every wing; no wing imports the tools. The
top-level modules (`__init__`, `experimental`, `mixed_precision`,
`patches`) assemble the wings (`__init__` exports the audit, a tool).
Imports inside functions count too: a lazy import is still a dependency.
"""

import ast
import pathlib

import pytest

import keras_dtype_policy

PACKAGE = "keras_dtype_policy"
PACKAGE_DIR = pathlib.Path(keras_dtype_policy.__file__).parent

# wing -> the wings it may import (besides itself).
ALLOWED = {
    "policies": set(),
    "low_precision": {"policies"},
    "loss_scaling": {"policies", "low_precision"},
    "tf_keras_compat": {"policies", "low_precision", "loss_scaling"},
    # The tools read the package version from the top-level package.
    "tools": {
        "policies",
        "low_precision",
        "loss_scaling",
        "tf_keras_compat",
        "",
    },
}
# (module, imported module) pairs that run against ALLOWED, each a known
# debt: the deserialization of an inner optimizer, shared by both optimizer
# wrappers, still lives in loss scaling.
KNOWN_EXCEPTIONS = {
    (
        "low_precision/optimizer.py",
        "keras_dtype_policy.loss_scaling.inner_optimizer_config",
    ),
}
TOP_LEVEL_MODULES = {
    "__init__",
    "__main__",
    "experimental",
    "mixed_precision",
    "patches",
}


def imported_package_modules(path):
    """Yields the `keras_dtype_policy...` module names that `path` imports."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            if name == PACKAGE or name.startswith(PACKAGE + "."):
                yield name


def wing_of(module_name):
    """Returns the wing a package module belongs to; "" for the top level."""
    parts = module_name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ALLOWED else ""


def test_every_module_lives_in_a_wing_or_is_a_known_top_level_module():
    top = {path.stem for path in PACKAGE_DIR.glob("*.py")}
    wings = {path.parent.name for path in PACKAGE_DIR.glob("*/__init__.py")}
    assert top == TOP_LEVEL_MODULES
    assert wings == set(ALLOWED)


@pytest.mark.parametrize("wing", sorted(ALLOWED))
def test_imports_point_down_or_sideways(wing):
    offenders = []
    for path in sorted((PACKAGE_DIR / wing).glob("*.py")):
        for name in imported_package_modules(path):
            target = wing_of(name)
            if target == wing or target in ALLOWED[wing]:
                continue
            if (f"{wing}/{path.name}", name) not in KNOWN_EXCEPTIONS:
                offenders.append(f"{wing}/{path.name} imports {name}")
    assert offenders == []


@pytest.mark.parametrize("wing", sorted(ALLOWED))
def test_each_wing_says_in_one_docstring_line_what_lives_there(wing):
    docstring = ast.get_docstring(
        ast.parse((PACKAGE_DIR / wing / "__init__.py").read_text())
    )
    assert docstring and len(docstring.splitlines()) == 1


def test_the_layout_check_sees_a_forbidden_import(tmp_path):
    path = tmp_path / "example.py"
    path.write_text("def f():\n    from keras_dtype_policy.tools import cli\n")
    assert list(imported_package_modules(path)) == ["keras_dtype_policy.tools"]
    assert wing_of("keras_dtype_policy.tools") == "tools"
    assert wing_of("keras_dtype_policy.patches") == ""
