"""Benchmarks of keras_dtype_policy against Keras' own policies and loss
scaling, on every backend. Run `python tests/benchmarks/run.py --help`."""
