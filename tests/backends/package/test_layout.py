"""The package's wings and the direction of imports between them.

The policy core imports no other wing; low-precision training imports the
core; loss scaling imports the core and low-precision training (its
`LossScaleOptimizer` goes around a `LowPrecisionOptimizer`, and the compile
hook installs both); tf.keras 2 compatibility imports the core and loss
scaling; the tools may import every wing; no wing imports the tools. The
top-level modules (`__init__`, `experimental`, `mixed_precision`,
`patches`) assemble the wings (`__init__` exports the audit, a tool);
`backend_dispatch` (which imports Keras alone), `types` (the
annotations' aliases) and `unconverted` (AutoGraph's mark, importing
nothing) are the top-level modules every wing may import.
Imports inside functions count too: a lazy import is still a dependency,
and no two modules import each other, however indirectly. No module is
over 600 lines, no function over 60.

The house rules of issue 42 are checked on the source too: only
`backend_dispatch` asks Keras for its backend; no class is recognised by
its name or its module's name; a backend module of `low_precision/`
imports its backend at its top, never inside a function.
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
    "backend_dispatch",
    "experimental",
    "internals_inventory",
    "mixed_precision",
    "patches",
    "types",
    "unconverted",
    "version",
}
# The top-level modules every wing may import: they import Keras alone
# (`types` and `unconverted`, not even Keras).
SHARED_TOP_LEVEL = {
    f"{PACKAGE}.backend_dispatch",
    f"{PACKAGE}.types",
    f"{PACKAGE}.unconverted",
}


def imported_package_modules(path):
    """Yields the `keras_dtype_policy...` module names that `path` imports.

    `from keras_dtype_policy import m` names `keras_dtype_policy.m`.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module == PACKAGE:
            names = [f"{PACKAGE}.{alias.name}" for alias in node.names]
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
            if name in SHARED_TOP_LEVEL:
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


MAX_FUNCTION_LINES = 60
# The modules that may call `keras.backend.backend()`: the dispatch point.
ASKS_FOR_THE_BACKEND = {"backend_dispatch.py"}
BACKENDS = {"jax", "tensorflow", "torch"}
NAME_ATTRIBUTES = {"__name__", "__qualname__"}


def package_trees():
    """Yields `(path relative to the package, ast)` for each module."""
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        yield path.relative_to(PACKAGE_DIR).as_posix(), tree


def long_functions(relative, tree):
    """Yields `file:line name (N lines)` per function over the limit."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                yield f"{relative}:{node.lineno} {node.name} ({length} lines)"


def is_backend_question(node):
    """Whether `node` calls `keras.backend.backend()` (or `backend.backend()`
    after `from keras import backend`)."""
    if not isinstance(node, ast.Call):
        return False
    function = node.func
    if not isinstance(function, ast.Attribute) or function.attr != "backend":
        return False
    owner = function.value
    if isinstance(owner, ast.Name):
        return owner.id == "backend"
    return (
        isinstance(owner, ast.Attribute)
        and owner.attr == "backend"
        and isinstance(owner.value, ast.Name)
        and owner.value.id == "keras"
    )


def backend_questions(relative, tree):
    """Yields `file:line` per call of `keras.backend.backend()`."""
    if relative in ASKS_FOR_THE_BACKEND:
        return
    for node in ast.walk(tree):
        if is_backend_question(node):
            yield f"{relative}:{node.lineno} {ast.unparse(node)}"


def is_name_attribute(node, names):
    """Whether `node` reads an attribute in `names` (`type(x).__name__`).

    A bare `__name__` (the module's own, as in `__name__ == "__main__"`)
    is a name, not an attribute, so it never counts.
    """
    return isinstance(node, ast.Attribute) and node.attr in names


def classes_recognised_by_name(relative, tree):
    """Yields `file:line code` per class recognised by a name string: a
    comparison with a `__name__`/`__qualname__` (or `__module__`)
    attribute, or `.startswith` on a `__module__`."""
    named = NAME_ATTRIBUTES | {"__module__"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(is_name_attribute(o, named) for o in operands):
                yield f"{relative}:{node.lineno} {ast.unparse(node)}"
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("startswith", "endswith")
            and is_name_attribute(node.func.value, {"__module__"})
        ):
            yield f"{relative}:{node.lineno} {ast.unparse(node)}"


def backend_imports_in_functions(relative, tree):
    """Yields `file:line function imports module` per backend imported
    inside a function."""
    found = {}
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                modules = [node.module or ""]
            else:
                continue
            for module in modules:
                if module.split(".")[0] in BACKENDS:
                    found.setdefault(
                        (node.lineno, module),
                        f"{relative}:{node.lineno} {function.name} imports "
                        f"{module}",
                    )
    yield from (found[key] for key in sorted(found))


def offenders(check, under=""):
    """The lines `check` yields over the package's modules under `under`."""
    return [
        line
        for relative, tree in package_trees()
        if relative.startswith(under)
        for line in check(relative, tree)
    ]


def test_no_function_is_over_60_lines_docstring_included():
    found = offenders(long_functions)
    assert not found, "Functions over 60 lines:\n" + "\n".join(found)


def test_only_the_dispatch_point_asks_keras_for_its_backend():
    found = offenders(backend_questions)
    assert not found, (
        "keras.backend.backend() outside backend_dispatch.py (ask "
        "backend_dispatch.name() or is_jax/is_tensorflow/is_torch):\n"
        + "\n".join(found)
    )


def test_no_class_is_recognised_by_its_name():
    found = offenders(classes_recognised_by_name)
    assert not found, (
        "Classes recognised by a name string (match them by identity):\n"
        + "\n".join(found)
    )


def test_low_precision_backend_modules_import_their_backend_at_the_top():
    found = offenders(backend_imports_in_functions, under="low_precision/")
    assert not found, (
        "Backends imported inside functions of low_precision/ (import "
        "the backend at the top of a backend module, and reach that module "
        "through backend_dispatch.module_for):\n" + "\n".join(found)
    )


@pytest.mark.parametrize(
    "source, check, expected",
    [
        ("def f():\n" + "    x = 1\n" * 60, long_functions, 1),
        ("def f():\n" + "    x = 1\n" * 59, long_functions, 0),
        ("import keras\nkeras.backend.backend()\n", backend_questions, 1),
        (
            "from keras import backend\nbackend.backend()\n",
            backend_questions,
            1,
        ),
        ("keras.config.floatx()\n", backend_questions, 0),
        ("type(x).__name__ == 'Adam'\n", classes_recognised_by_name, 1),
        ("'Adam' in {cls.__qualname__}\n", classes_recognised_by_name, 0),
        ("cls.__qualname__ not in NAMES\n", classes_recognised_by_name, 1),
        ("cls.__module__.startswith('torch')\n", classes_recognised_by_name, 1),
        (
            "if __name__ == '__main__':\n    pass\n",
            classes_recognised_by_name,
            0,
        ),
        ("def f():\n    import torch\n", backend_imports_in_functions, 1),
        (
            "def f():\n    from tensorflow.python import x\n",
            backend_imports_in_functions,
            1,
        ),
        (
            "import jax\ndef f():\n    import numpy\n",
            backend_imports_in_functions,
            0,
        ),
    ],
)
def test_the_house_checks_see_what_they_look_for(source, check, expected):
    found = list(check("example.py", ast.parse(source)))
    assert len(found) == expected, found
