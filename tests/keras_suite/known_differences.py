"""Keras' own tests that fail with the package on purpose, and why.

Keys are `(backends, nodeid fragment)`; values the reason. Keep it short:
each entry is a deliberate difference from Keras, also listed in the
README's table of differences.
"""

ALL = ("tensorflow", "jax", "torch")

# With the package imported, on Keras' own classes.
KNOWN_DIFFERENCES = {}

# With Keras' test modules re-pointed at the package's classes
# (KERAS_SUITE_REPOINT=1).
REPOINTED_DIFFERENCES = {
    (ALL, "LossScaleOptimizerTest::test_init_dynamic_arg"): (
        "The package's LossScaleOptimizer accepts dynamic=False, a fixed "
        "loss scale with a finiteness check (tf.keras' behaviour); Keras "
        "refuses it and points to loss_scale_factor, which has no check."
    ),
}
