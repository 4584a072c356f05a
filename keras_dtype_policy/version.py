"""The package's version, readable without importing Keras."""

__version__ = "0.1.0"
