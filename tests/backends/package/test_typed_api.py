"""The public API is annotated, so the `py.typed` the package ships holds.

Every name of `keras_dtype_policy.__all__` that is a function has an
annotation on each parameter and on its return; a class, on its
`__init__` and on its own public methods and properties. Tensors are
`keras_dtype_policy.types.Tensor` (`Any`), so no annotation imports a
backend. `tox -e lint` runs mypy over the package.
"""

import inspect

import pytest

import keras_dtype_policy as kdp
from keras_dtype_policy import types


def own_public_callables(cls):
    """Yields `(qualified name, function)` for `cls.__init__` and the
    public methods and property getters `cls` defines itself."""
    for name, value in vars(cls).items():
        if name.startswith("_") and name != "__init__":
            continue
        if isinstance(value, property):
            yield f"{cls.__name__}.{name}", value.fget
        elif isinstance(value, (staticmethod, classmethod)):
            yield f"{cls.__name__}.{name}", value.__func__
        elif inspect.isfunction(value):
            yield f"{cls.__name__}.{name}", value


def public_callables():
    """Yields `(name, function)` for every callable `kdp.__all__` lists."""
    for name in kdp.__all__:
        value = getattr(kdp, name)
        if inspect.ismodule(value):
            continue
        if inspect.isclass(value):
            yield from own_public_callables(value)
        else:
            yield name, value


def missing_annotations(function):
    """The parameters of `function` (and `return`) left unannotated."""
    signature = inspect.signature(function)
    missing = [
        name
        for name, parameter in signature.parameters.items()
        if name not in ("self", "cls")
        and parameter.annotation is inspect.Parameter.empty
    ]
    if signature.return_annotation is inspect.Signature.empty:
        missing.append("return")
    return missing


PUBLIC = sorted(public_callables(), key=lambda item: item[0])


def test_the_public_api_has_callables_to_check():
    names = {name for name, _ in PUBLIC}
    assert {"audit", "LowPrecisionOptimizer.__init__"} <= names
    assert "DTypePolicy.convert_input" in names


@pytest.mark.parametrize(
    "name, function", PUBLIC, ids=[name for name, _ in PUBLIC]
)
def test_every_public_callable_is_fully_annotated(name, function):
    assert missing_annotations(function) == [], name


def test_the_check_sees_a_missing_annotation():
    def partly(a: int, b) -> int:
        return a

    def fully(self, a: int) -> None:
        pass

    assert missing_annotations(partly) == ["b"]
    assert missing_annotations(fully) == []


def test_the_tensor_alias_imports_no_backend():
    assert types.Tensor is not None
    source = inspect.getsource(types)
    for backend in ("torch", "tensorflow", "jax"):
        assert f"import {backend}" not in source
