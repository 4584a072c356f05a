"""The package imports no backend library of its own accord."""

import ast
import pathlib
import subprocess
import sys

import keras_dtype_policy
from keras_dtype_policy import backend_dispatch

BACKEND_LIBRARIES = ("tensorflow", "jax", "jaxlib", "torch")
PACKAGE_DIR = pathlib.Path(keras_dtype_policy.__file__).parent


def module_level_imports(path):
    """Yields the top-level module names imported outside any function."""
    tree = ast.parse(path.read_text(), filename=str(path))
    nodes = list(tree.body)
    while nodes:
        node = nodes.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module.split(".")[0]
        nodes.extend(ast.iter_child_nodes(node))


def module_path(module):
    """The file of a module of the package, by its dotted name."""
    parts = module.split(".")[1:]
    return PACKAGE_DIR.joinpath(*parts).with_suffix(".py")


def package_imports(path):
    """Yields the package's modules that `path` imports outside functions."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("keras_dtype_policy."):
                # `from package import module` names a module too.
                yield node.module
                yield from (f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            yield from (
                alias.name
                for alias in node.names
                if alias.name.startswith("keras_dtype_policy.")
            )


def backend_modules():
    """`{file: backend}` of the modules `backend_dispatch` imports lazily,
    and of those they import in turn: each may import its backend."""
    allowed = {}
    pending = [
        (module_path(module), backend)
        for (backend, _), module in backend_dispatch._MODULES.items()
    ]
    while pending:
        path, backend = pending.pop()
        if path in allowed or not path.exists():
            continue
        allowed[path] = backend
        pending.extend(
            (module_path(module), backend) for module in package_imports(path)
        )
    return allowed


def test_no_module_imports_a_backend_at_module_level():
    # Except the backend modules `backend_dispatch` imports on first use,
    # each importing its own backend (and other modules of that backend).
    allowed = backend_modules()
    offenders = {
        str(path.relative_to(PACKAGE_DIR)): name
        for path in PACKAGE_DIR.rglob("*.py")
        for name in module_level_imports(path)
        if name in BACKEND_LIBRARIES and allowed.get(path) != name
    }
    assert offenders == {}


def test_importing_the_package_loads_no_backend_library():
    code = (
        "import sys, keras\n"
        "before = set(sys.modules)\n"
        "import keras_dtype_policy\n"
        "new = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        f"print(sorted(new & set({BACKEND_LIBRARIES!r})))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip().splitlines()[-1] == "[]"
