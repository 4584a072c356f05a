"""Shared pytest setup: one backend per run, chosen by KERAS_BACKEND."""

import gc
import inspect
import os
import zlib

import keras
import pytest

import keras_dtype_policy

BACKEND = keras.backend.backend()
# Tests marked `rotated` check what the backend does not change (a docs
# block's arithmetic, a tf.keras 2 layer config's translation): with
# KDP_ROTATE=1 (tox's default runs, for CI time) each runs on one backend
# of the three, chosen from its id, so that every one still runs once per
# CI run; the full runs (`tox -e full-<backend>`) run each on every backend.
ROTATION = ("tensorflow", "jax", "torch")


def rotation_backend(nodeid):
    """The backend a `rotated` test runs on when the runs rotate."""
    return ROTATION[zlib.crc32(nodeid.encode("utf-8")) % len(ROTATION)]


def pytest_collection_modifyitems(config, items):
    if os.environ.get("KDP_ROTATE") != "1":
        return
    for item in items:
        if item.get_closest_marker("rotated") is None:
            continue
        owner = rotation_backend(item.nodeid)
        if owner != BACKEND:
            item.add_marker(
                pytest.mark.skip(
                    reason=f"rotated across the backends in the default "
                    f"runs: this one runs in the {owner} run "
                    f"(`tox -e full-{BACKEND}` runs it here too)"
                )
            )


# A full garbage collection takes 0.3 to 0.5 s in a TensorFlow process
# (measured on the 2-core machine): done twice per test by
# `clear_session()`, it was a third of the TensorFlow run. The session is
# reset around every test without it, and memory is collected every
# `_COLLECT_EVERY` tests instead.
_CLEARS_WITHOUT_GC = (
    "free_memory" in inspect.signature(keras.utils.clear_session).parameters
)
_COLLECT_EVERY = 50
_tests_run = 0


def _clear_session():
    if _CLEARS_WITHOUT_GC:
        keras.utils.clear_session(free_memory=False)
    else:
        keras.utils.clear_session()


@pytest.fixture(autouse=True)
def fresh_keras_state():
    """Resets the global policy and Keras' session around every test."""
    global _tests_run
    _clear_session()
    keras.config.set_dtype_policy("float32")
    keras_dtype_policy.install()
    yield
    keras_dtype_policy.install()
    keras.config.set_dtype_policy("float32")
    _clear_session()
    _tests_run += 1
    if _tests_run % _COLLECT_EVERY == 0:
        gc.collect()


def pytest_report_header(config):
    return f"keras {keras.__version__}, backend {BACKEND}"
