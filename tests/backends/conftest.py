"""Shared pytest setup: one backend per run, chosen by KERAS_BACKEND."""

import gc
import inspect

import keras
import pytest

import keras_dtype_policy

BACKEND = keras.backend.backend()

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
