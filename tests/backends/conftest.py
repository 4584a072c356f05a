"""Shared pytest setup: one backend per run, chosen by KERAS_BACKEND."""

import keras
import pytest

import keras_dtype_policy

BACKEND = keras.backend.backend()


@pytest.fixture(autouse=True)
def fresh_keras_state():
    """Resets the global policy and Keras' session around every test."""
    keras.utils.clear_session()
    keras.config.set_dtype_policy("float32")
    keras_dtype_policy.install()
    yield
    keras_dtype_policy.install()
    keras.config.set_dtype_policy("float32")
    keras.utils.clear_session()


def pytest_report_header(config):
    return f"keras {keras.__version__}, backend {BACKEND}"
