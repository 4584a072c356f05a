"""The package imports no backend library of its own accord."""

import ast
import pathlib
import subprocess
import sys

import keras_dtype_policy

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


def test_no_module_imports_a_backend_at_module_level():
    offenders = {
        str(path.relative_to(PACKAGE_DIR)): name
        for path in PACKAGE_DIR.rglob("*.py")
        for name in module_level_imports(path)
        if name in BACKEND_LIBRARIES
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
