"""The package's wings and the direction of imports between them.

The policy core imports no other wing; low-precision training imports the
core; loss scaling imports the core and low-precision training (its
`LossScaleOptimizer` goes around a `LowPrecisionOptimizer`, and the compile
hook installs both); tf.keras 2 compatibility imports the core and loss
scaling; the tools may import every wing; no wing imports the tools. The
top-level modules (`__init__`, `experimental`, `mixed_precision`,
`patches`) assemble the wings (`__init__` exports the audit, a tool).
Imports inside functions count too: a lazy import is still a dependency,
and no two modules import each other, however indirectly. No module is
over 600 lines.
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
    # The command line reads `version` and `backend_check` at the top level.
    "tools": {
        "policies",
        "low_precision",
        "loss_scaling",
        "tf_keras_compat",
        "",
    },
}
TOP_LEVEL_MODULES = {
    "__init__",
    "__main__",
    "backend_check",
    "experimental",
    "mixed_precision",
    "patches",
    "version",
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


def module_file(module_name):
    """Returns the file of a package module, or None if it is no module."""
    relative = pathlib.Path(*module_name.split(".")[1:])
    for candidate in (
        PACKAGE_DIR / relative.with_suffix(".py"),
        PACKAGE_DIR / relative / "__init__.py",
    ):
        if candidate.is_file():
            return candidate
    return None


def import_graph():
    """Returns {module file: the package module files it imports}.

    `from keras_dtype_policy.a import b` names the module `a.b` where that
    is a module, else `a`. Imports inside functions count.
    """
    graph = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        targets = set()
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [f"{node.module}.{a.name}" for a in node.names]
                names = [
                    name if module_file(name) else node.module for name in names
                ]
            else:
                continue
            for name in names:
                if name == PACKAGE or name.startswith(PACKAGE + "."):
                    target = module_file(name)
                    if target is not None and target != path:
                        targets.add(target)
        graph[path] = targets
    return graph


def cycles(graph):
    """Returns the import cycles of `graph`, each as a sorted list."""
    found = []
    index = {}
    low = {}
    stack = []
    on_stack = set()

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_import_circles_not_even_through_imports_inside_functions():
    graph = import_graph()
    # `__init__` assembles everything, so a module importing the package
    # itself back closes a circle through it too.
    named = [
        [str(path.relative_to(PACKAGE_DIR)) for path in component]
        for component in cycles(graph)
    ]
    assert named == []


def test_the_circle_check_sees_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_module_is_over_600_lines():
    long_modules = {
        str(path.relative_to(PACKAGE_DIR)): length
        for path in PACKAGE_DIR.rglob("*.py")
        if (length := len(path.read_text().splitlines())) > 600
    }
    assert long_modules == {}
