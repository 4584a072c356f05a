"""The private names of Keras the package relies on: all listed, all there.

`patches.KERAS_INTERNALS` lists every private Keras attribute, method and
`keras.src` module the package uses without patching it. Each entry must
exist where the inventory says on the installed Keras (a Keras release
that moves one fails here, naming it and its owner); the package's source
is scanned so that a new reliance cannot slip in unlisted.

Entries of one backend (Keras' torch optimizers, PyTorch's `_foreach`
kernels) are checked on that backend only, and are skipped, saying so, on
the others, where Keras does not define or import them. Entries of a
range of Keras releases are checked inside that range only.
"""

import ast
import importlib
import pathlib
import re

import keras
import numpy as np
import pytest
from testing import BACKEND

import keras_dtype_policy
from keras_dtype_policy import patches

PACKAGE_DIR = pathlib.Path(keras_dtype_policy.__file__).parent
RELEASE = tuple(int(part) for part in keras.__version__.split(".")[:2])
INTERNALS = {entry.target: entry for entry in patches.KERAS_INTERNALS}


def built_optimizer(optimizer):
    variable = keras.Variable(np.ones((2, 3), "float32"))
    optimizer.build([variable])
    return optimizer


def compiled_model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    return model


def quantized_dense():
    layer = keras.layers.Dense(4)
    layer.build((None, 8))
    layer.quantize("int8")
    return layer


def built_dense():
    layer = keras.layers.Dense(4)
    layer.build((None, 8))
    return layer


# Owner -> a function making an instance on which the owner's instance
# attributes must be set (Adam with AMSGrad, for `_velocity_hats`).
INSTANCES = {
    "keras.src.optimizers.base_optimizer.BaseOptimizer": lambda: (
        built_optimizer(keras.optimizers.SGD(0.1))
    ),
    "keras.src.optimizers.adam.Adam": lambda: built_optimizer(
        keras.optimizers.Adam(amsgrad=True)
    ),
    "keras.src.optimizers.nadam.Nadam": lambda: built_optimizer(
        keras.optimizers.Nadam()
    ),
    "keras.src.backend.common.variables.Variable": lambda: keras.Variable(
        np.zeros(3, "float32")
    ),
    "keras.src.layers.layer.Layer": built_dense,
    "keras.src.layers.core.dense.Dense": quantized_dense,
    "keras.src.models.model.Model": compiled_model,
    "keras.src.dtype_policies.dtype_policy.DTypePolicy": lambda: (
        keras.DTypePolicy("mixed_float16")
    ),
    # Keras 3.15 and later (the entry's `releases`).
    "keras.src.optimizers.multi_optimizer.MultiOptimizer": lambda: (
        keras.optimizers.MultiOptimizer(
            keras.optimizers.OptimizerMap(keras.optimizers.SGD())
        )
    ),
}


def resolve(path):
    """Returns the module, class or attribute at dotted `path`; raises
    LookupError if there is none."""
    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            if not hasattr(found, name):
                raise LookupError(f"{'.'.join(parts[:split])} has no {name}")
            found = getattr(found, name)
        return found
    raise LookupError(f"no module {parts[0]}")


def moved(entry, detail):
    return (
        f"KERAS_INTERNALS: {entry.target} is not where the inventory says "
        f"(owner {entry.owner}) on keras {keras.__version__} ({BACKEND}): "
        f"{detail}. Used by {', '.join(entry.users)}: {entry.why}"
    )


def skip_reason(entry):
    """Why `entry` is not checked here, or None."""
    if entry.backend is not None and entry.backend != BACKEND:
        return (
            f"{entry.target}: Keras' {entry.backend} backend only; the "
            f"package uses it only when KERAS_BACKEND={entry.backend}"
        )
    if entry.releases is not None:
        first, first_without = entry.releases
        if not first <= RELEASE < first_without:
            return (
                f"{entry.target}: Keras {first} up to {first_without} only; "
                f"policies/keras_internals.py finds its successor in "
                f"{keras.__version__}"
            )
    return None


@pytest.mark.parametrize("target", sorted(INTERNALS))
def test_every_listed_internal_is_where_the_inventory_says(target):
    entry = INTERNALS[target]
    reason = skip_reason(entry)
    if reason:
        pytest.skip(reason)
    try:
        owner = resolve(entry.owner)
    except LookupError as error:
        pytest.fail(moved(entry, f"its owner is gone ({error})"))
    if entry.attribute is None:
        return
    if not entry.on_instances:
        if not hasattr(owner, entry.attribute):
            pytest.fail(moved(entry, f"{entry.owner} has no {entry.attribute}"))
        return
    assert entry.owner in INSTANCES, (
        f"no instance of {entry.owner} to check {entry.attribute} on: add a "
        "function making one to INSTANCES"
    )
    instance = INSTANCES[entry.owner]()
    assert isinstance(instance, owner), (entry.owner, type(instance))
    if not hasattr(instance, entry.attribute):
        pytest.fail(
            moved(entry, f"a {type(instance).__name__} has no attribute")
        )


def test_every_entry_is_used_by_the_modules_it_names():
    stale = []
    for entry in patches.KERAS_INTERNALS:
        name = entry.attribute or entry.owner.rpartition(".")[2]
        for user in entry.users:
            path = PACKAGE_DIR.joinpath(*user.split(".")).with_suffix(".py")
            text = path.read_text() if path.exists() else ""
            # A module is named by its path where the package compares it.
            if name not in text and entry.owner not in text:
                stale.append(f"{entry.target}: not in {user}")
    assert not stale, "Inventory entries no module uses:\n" + "\n".join(stale)


def test_entries_are_unique_and_say_why():
    targets = [entry.target for entry in patches.KERAS_INTERNALS]
    assert len(targets) == len(set(targets))
    # A patched attribute belongs to the patch table, not to this one.
    patched = {patch.target for patch in patches.PATCHES}
    assert not patched & set(targets)
    for entry in patches.KERAS_INTERNALS:
        assert entry.why and entry.users, entry.target
        assert entry.backend in (None, "tensorflow", "jax", "torch")


# The ast scan of the package.

ATTRIBUTE_CALLS = ("getattr", "hasattr", "setattr", "delattr")


def is_private(name):
    return name.startswith("_") and not name.startswith("__")


def on_self(node):
    return isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")


def named_attribute(node):
    """The attribute name a `getattr(x, "_name")`-like call or a
    `vars(x).get("_name")` / `vars(x)["_name"]` reads, or None."""
    if isinstance(node, ast.Call) and node.args:
        function = node.func
        if isinstance(function, ast.Name) and function.id in ATTRIBUTE_CALLS:
            argument = node.args[1] if len(node.args) > 1 else None
        elif (
            isinstance(function, ast.Attribute)
            and function.attr == "get"
            and is_vars_call(function.value)
        ):
            argument = node.args[0]
        else:
            return None
    elif isinstance(node, ast.Subscript) and is_vars_call(node.value):
        argument = node.slice
    else:
        return None
    if isinstance(argument, ast.Constant) and isinstance(argument.value, str):
        return argument.value
    return None


def is_vars_call(node):
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "vars"
    )


def package_sources():
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        yield path, ast.parse(path.read_text(), filename=str(path))


def names_defined_by_the_package():
    """Functions, methods and classes; names assigned at the top of a
    module or of a class; attributes assigned on `self` or `cls`."""
    defined = set()
    for _, tree in package_sources():
        bodies = [tree.body]
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                defined.add(node.name)
            elif isinstance(node, ast.ClassDef):
                defined.add(node.name)
                bodies.append(node.body)
            elif isinstance(node, ast.Attribute) and on_self(node):
                if isinstance(node.ctx, ast.Store):
                    defined.add(node.attr)
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "setattr"
                and len(node.args) > 1
                and isinstance(node.args[0], ast.Name)
                and node.args[0].id in ("self", "cls")
            ):
                defined.add(named_attribute(node))
        for body in bodies:
            for statement in body:
                for target in assigned_names(statement):
                    defined.add(target)
    return defined


def assigned_names(statement):
    if isinstance(statement, ast.Assign):
        targets = statement.targets
    elif isinstance(statement, (ast.AnnAssign, ast.AugAssign)):
        targets = [statement.target]
    else:
        return
    for target in targets:
        for node in ast.walk(target):
            if isinstance(node, ast.Name):
                yield node.id


def private_names_used():
    """Yields `(name, "file:line")` for each private attribute the package
    reads or writes on an object other than `self` or `cls`, or reads on
    them, by attribute or by a constant string."""
    for path, tree in package_sources():
        where = path.relative_to(PACKAGE_DIR.parent)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                if isinstance(node.ctx, ast.Store) and on_self(node):
                    continue
                name = node.attr
            else:
                name = named_attribute(node)
            if name is not None and is_private(name):
                yield name, f"{where}:{node.lineno}"


def listed_names():
    listed = {entry.attribute for entry in patches.KERAS_INTERNALS}
    listed |= {patch.attribute for patch in patches.PATCHES}
    for patch in patches.INSTANCE_PATCHES:
        listed |= set(patch.attributes)
    return listed


def keras_source_names():
    """Every private identifier the installed Keras' source mentions."""
    keras_dir = pathlib.Path(keras.__file__).parent / "src"
    names = set()
    for path in keras_dir.rglob("*.py"):
        names.update(re.findall(r"\b_[A-Za-z0-9_]+", path.read_text()))
    return names


def names_the_package_puts_on_objects():
    """Private names the package stores on any object (`x._name = ...`)
    or writes as a string (a table of attribute names)."""
    found = set()
    for _, tree in package_sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(
                node.ctx, ast.Store
            ):
                found.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.add(node.value)
    return {name for name in found if is_private(name)}


def test_every_private_name_the_package_uses_is_its_own_or_listed():
    # The package's own: what it defines (functions, classes, names at the
    # top of a module or class, attributes of `self` or `cls`), and the
    # names it puts on other objects that Keras never mentions.
    defined = names_defined_by_the_package()
    defined |= names_the_package_puts_on_objects() - keras_source_names()
    listed = listed_names()
    unlisted = {}
    for name, where in private_names_used():
        if name not in defined and name not in listed:
            unlisted.setdefault(name, []).append(where)
    lines = [
        f"{name}: {', '.join(unlisted[name])}" for name in sorted(unlisted)
    ]
    assert not unlisted, (
        "private names the package uses that it does not define and that "
        "neither patches.KERAS_INTERNALS nor the patch tables list (add "
        "each to KERAS_INTERNALS with its owner and why):\n" + "\n".join(lines)
    )


def keras_src_imports():
    """Yields `(module, name or None, "file:line")` for each import from
    `keras.src` in the package."""
    for path, tree in package_sources():
        where = path.relative_to(PACKAGE_DIR.parent)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("keras.src"):
                        yield alias.name, None, f"{where}:{node.lineno}"
            elif isinstance(node, ast.ImportFrom) and node.module:
                if node.module.startswith("keras.src"):
                    for alias in node.names:
                        yield (
                            node.module,
                            alias.name,
                            f"{where}:{node.lineno}",
                        )


def test_every_keras_src_import_is_listed():
    targets = set(INTERNALS)
    unlisted = []
    for module, name, where in keras_src_imports():
        paths = {module} if name is None else {f"{module}.{name}"}
        if not paths & targets:
            unlisted.append(
                f"{'.'.join(filter(None, (module, name)))}: {where}"
            )
    assert not unlisted, (
        "keras.src imports that patches.KERAS_INTERNALS does not list:\n"
        + "\n".join(unlisted)
    )


def test_the_scan_finds_a_new_reliance(tmp_path, monkeypatch):
    # The scan reads the package's files: one more module using a Keras
    # private name it neither defines nor lists must be found, with its
    # file and line.
    fake = tmp_path / "keras_dtype_policy"
    fake.mkdir()
    (fake / "uses.py").write_text(
        "def f(optimizer):\n"
        "    return optimizer._momentums, optimizer._made_up_internal\n"
    )
    monkeypatch.setattr(
        f"{__name__}.PACKAGE_DIR", pathlib.Path(fake), raising=True
    )
    used = dict(private_names_used())
    assert used == {
        "_momentums": "keras_dtype_policy/uses.py:2",
        "_made_up_internal": "keras_dtype_policy/uses.py:2",
    }
    with pytest.raises(AssertionError) as raised:
        test_every_private_name_the_package_uses_is_its_own_or_listed()
    message = str(raised.value)
    assert "_made_up_internal: keras_dtype_policy/uses.py:2" in message
    assert "_momentums" not in message.split("\n", 1)[1]
