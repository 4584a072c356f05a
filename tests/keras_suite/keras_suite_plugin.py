"""Runs Keras' own test files with keras_dtype_policy imported first.

A pytest plugin (`-p keras_suite_plugin`, see pytest.ini here) for the test
files that ship inside the installed keras wheel. It does what Keras' own
conftest does for them (torch imported before TensorFlow, Keras' markers
registered and turned into skips), then imports keras_dtype_policy, so that
every test runs with the package's patches installed. A test that cannot
pass because the package deliberately behaves otherwise is listed, with its
reason, in `known_differences.py`; it is expected to fail (strictly: if it
passes, the list is stale and the run fails).

Set `KERAS_SUITE_WITHOUT_PACKAGE=1` to run the same tests on Keras alone,
which tells a regression of ours from a test that fails here anyway.

Tests that fail in Keras alone here too (a library or data file missing
from this environment) are skipped with that reason. With
`KERAS_SUITE_SUBSET=ci`, the variants of the quantization tests for int4,
float8, GPTQ and AWQ are deselected (int8 stays): they take two thirds of
the time and meet dtype policies the way int8 does. So are two heavy tests
whose paths other tests of the subset run (`SLOW_IN_CI`, ~140 s a backend
in one process on a 2-core Xeon): the keras-{backend} environments run them.

With `--repoint`, the test modules' own names for Keras'
`DTypePolicy`, `FloatDTypePolicy`, `dtype_policy`, `set_dtype_policy` and
`LossScaleOptimizer` are re-pointed at the package's, so that Keras' tests of
those features test the package's classes as drop-in replacements.
"""

import ast
import importlib.util
import os
import re

os.environ.setdefault("JAX_DEFAULT_DTYPE_BITS", "32")

try:
    # Keras' test suite imports torch before TensorFlow; the other order
    # has crashed in one process.
    import torch  # noqa: F401
except ImportError:
    torch = None

import keras
import pytest

WITHOUT_PACKAGE = os.environ.get("KERAS_SUITE_WITHOUT_PACKAGE") == "1"
CI_SUBSET = os.environ.get("KERAS_SUITE_SUBSET") == "ci"
_SLOW_QUANTIZATION_VARIANTS = re.compile(r"int4|float8|fp8|gptq|awq", re.I)
# Test ids left out of the CI subset, with what still covers their path.
SLOW_IN_CI = {
    # 56 s: an EfficientNet saved in 10 MB shards; its one-shard variant
    # stays, and smaller models go through many shards in saving_api_test's
    # test_load_sharded_weights and saving_lib_test's sharded store tests.
    "test_weights_sharding_efficientnet_b0_10": "sharded weights",
    # 72 s: eleven of Keras' optimizers accumulating gradients with weight
    # decay, no package code in the loop; test_gradient_accumulation stays.
    "test_gradient_accumulation_with_weigth_decay": "gradient_accumulation",
}

if not WITHOUT_PACKAGE:
    import keras_dtype_policy

from known_differences import FAILS_IN_KERAS_ALONE  # noqa: E402
from known_differences import KNOWN_DIFFERENCES  # noqa: E402
from known_differences import REPOINTED_DIFFERENCES  # noqa: E402

BACKEND = keras.backend.backend()


def _replacements():
    """Returns {name in a test module: (Keras' object, the package's)}."""
    from keras.src.dtype_policies import dtype_policy

    return {
        "DTypePolicy": (
            dtype_policy.DTypePolicy,
            keras_dtype_policy.DTypePolicy,
        ),
        "FloatDTypePolicy": (
            dtype_policy.FloatDTypePolicy,
            keras_dtype_policy.DTypePolicy,
        ),
        "dtype_policy": (
            dtype_policy.dtype_policy,
            keras_dtype_policy.dtype_policy,
        ),
        "set_dtype_policy": (
            dtype_policy.set_dtype_policy,
            keras_dtype_policy.set_dtype_policy,
        ),
        "LossScaleOptimizer": (
            keras.optimizers.LossScaleOptimizer,
            keras_dtype_policy.LossScaleOptimizer,
        ),
    }


def _repoint(module, replacements):
    """Re-points `module`'s names for Keras' objects; returns if any was."""
    found = False
    for name, (keras_object, ours) in replacements.items():
        if getattr(module, name, None) is keras_object:
            setattr(module, name, ours)
            found = True
    return found


def pytest_addoption(parser):
    parser.addoption(
        "--repoint",
        action="store_true",
        help="Run Keras' tests of DTypePolicy, the global policy functions "
        "and LossScaleOptimizer against the package's classes.",
    )


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "requires_trainable_backend: Keras' marker"
    )
    config.addinivalue_line("markers", "multi_device: Keras' marker")


def pytest_report_header(config):
    package = "Keras alone" if WITHOUT_PACKAGE else "keras_dtype_policy"
    return f"keras {keras.__version__}, backend {BACKEND}, with {package}"


def pytest_ignore_collect(collection_path, config):
    """Leaves out a test file that imports a library not installed here.

    Keras' own CI installs every backend library (and grain) in one
    environment; ours install TensorFlow and pandas beside the backend. A
    file that needs torch or grain where they are absent is not collected,
    and the terminal summary names it.
    """
    if collection_path.suffix != ".py":
        return None
    missing = _missing_imports(collection_path)
    if missing:
        _left_out.append(f"{collection_path.name} (needs {', '.join(missing)})")
        return True
    return None


def pytest_terminal_summary(terminalreporter):
    if _left_out:
        terminalreporter.write_line(
            "Left out (a library they import is not installed): "
            + "; ".join(sorted(_left_out))
        )


_left_out = []


def _missing_imports(path):
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError):
        return []
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif (
            isinstance(node, ast.ImportFrom) and node.module and not node.level
        ):
            names.add(node.module.split(".")[0])
    return sorted(n for n in names if importlib.util.find_spec(n) is None)


def pytest_collection_modifyitems(config, items):
    multi_device = pytest.mark.skip(
        reason="Keras' multi_device tests need several devices; one here."
    )
    differences = KNOWN_DIFFERENCES
    if config.getoption("repoint") and not WITHOUT_PACKAGE:
        differences = {**KNOWN_DIFFERENCES, **REPOINTED_DIFFERENCES}
        replacements = _replacements()
        repointed = {
            module
            for module in {item.module for item in items}
            if _repoint(module, replacements)
        }
        # Only the tests of the re-pointed features run in this mode.
        items[:] = [item for item in items if item.module in repointed]
    if CI_SUBSET:
        kept = [
            i
            for i in items
            if not _SLOW_QUANTIZATION_VARIANTS.search(i.name)
            and not any(slow in i.name for slow in SLOW_IN_CI)
        ]
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept
    for item in items:
        if "multi_device" in item.keywords and _device_count() < 2:
            item.add_marker(multi_device)
        reason = _known_difference(FAILS_IN_KERAS_ALONE, item.nodeid)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=f"Keras alone: {reason}"))
        if WITHOUT_PACKAGE:
            continue
        reason = _known_difference(differences, item.nodeid)
        if reason is not None:
            item.add_marker(pytest.mark.xfail(reason=reason, strict=True))


def _known_difference(differences, nodeid):
    for (backends, fragment), reason in differences.items():
        if BACKEND in backends and fragment in nodeid:
            return reason
    return None


def _device_count():
    if BACKEND == "jax":
        import jax

        return jax.device_count()
    if BACKEND == "torch" and torch.cuda.is_available():
        return torch.cuda.device_count()
    return 1
