"""The package's optimizers run as written inside a user's `tf.function`.

TensorFlow's AutoGraph rewrites the Python a `tf.function` calls, except
in modules it leaves alone (Keras among them) and in functions marked as
`tf.autograph.experimental.do_not_convert` marks them. Every method the
package's optimizers define carries that mark, so a user's own
`tf.function` calling `optimizer.apply` runs the package's code as Keras'
`fit` does, unconverted. TensorFlow only: AutoGraph is TensorFlow's.
"""

import keras
import numpy as np
import pytest
from testing import BACKEND

import keras_dtype_policy as kdp

pytestmark = pytest.mark.skipif(
    BACKEND != "tensorflow",
    reason="AutoGraph (the rewriting of a tf.function's Python) is "
    "TensorFlow's; JAX and PyTorch trace without rewriting",
)

# (tf.keras 2's `LossScaleOptimizerV1` defines only `__init__`.)
CLASSES = (kdp.LowPrecisionOptimizer, kdp.LossScaleOptimizer)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda cls: cls.__name__)
def test_autograph_calls_every_method_unconverted(cls):
    from tensorflow.python.autograph.impl import api

    methods = [
        name
        for name, value in vars(cls).items()
        if callable(value) and not isinstance(value, type)
    ]
    assert "build" in methods
    for name in methods:
        assert api.is_autograph_artifact(getattr(cls, name)), name
    # What the class inherits from Keras is Keras' own (left alone by
    # module), not marked by the package.
    assert not api.is_autograph_artifact(keras.optimizers.Adam.update_step)


@pytest.mark.parametrize(
    "make",
    [
        lambda: kdp.LowPrecisionOptimizer(
            keras.optimizers.Adam(0.1), "stochastic_rounding", "8bit", seed=0
        ),
        lambda: kdp.LossScaleOptimizer(keras.optimizers.Adam(0.1)),
    ],
    ids=["low_precision_8bit", "loss_scale"],
)
def test_a_user_tf_function_applies_the_step(make):
    import tensorflow as tf

    weight = keras.Variable(np.ones((256,), "float32"))
    optimizer = make()
    # Built inside the function on its first call, as a custom loop does.
    step = tf.function(lambda grad: optimizer.apply([grad], [weight]))
    for _ in range(3):
        step(tf.fill((256,), 0.5))
    values = keras.ops.convert_to_numpy(weight)
    assert np.all(values < 1.0) and np.all(np.isfinite(values))
    assert int(keras.ops.convert_to_numpy(optimizer.iterations)) == 3
