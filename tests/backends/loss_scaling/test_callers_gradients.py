"""`LossScaleOptimizer` never changes the gradient tensors it is given.

A caller who logs, clips or accumulates its gradients after
`apply_gradients` reads what it passed in, as with Keras' own wrapper: the
unscaled gradients are new tensors, on every backend (PyTorch once divided
them in place).
"""

import keras
import numpy as np
import pytest
from testing import BACKEND
from testing import to_numpy

import keras_dtype_policy as kdp

SCALE = 32768.0


def scaled_gradients():
    # 327680 is 10 at a scale of 32768: the value the caller must keep.
    return [
        keras.ops.convert_to_tensor(np.array([327680.0, 1.0, 2.0], "float32")),
        keras.ops.convert_to_tensor(np.full((2, 2), 65536.0, "float32")),
    ]


def variables():
    return [
        keras.Variable(np.ones((3,), "float32")),
        keras.Variable(np.ones((2, 2), "float32")),
    ]


@pytest.mark.parametrize("dynamic", [True, False])
@pytest.mark.parametrize("scaling", ["scale_loss", "get_scaled_loss"])
def test_apply_gradients_leaves_the_callers_gradients(dynamic, scaling):
    weights = variables()
    settings = {} if dynamic else {"initial_scale": SCALE}
    optimizer = kdp.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), dynamic=dynamic, **settings
    )
    optimizer.build(weights)
    getattr(optimizer, scaling)(keras.ops.convert_to_tensor(1.0))
    grads = scaled_gradients()
    before = [np.array(to_numpy(g)) for g in grads]
    optimizer.apply_gradients(zip(grads, weights, strict=True))
    for grad, value in zip(grads, before, strict=True):
        np.testing.assert_array_equal(to_numpy(grad), value)
    # The step itself used the unscaled values: 1 - 0.1 * 10.
    np.testing.assert_allclose(to_numpy(weights[0])[0], 0.0, atol=1e-6)


def test_a_skipped_step_leaves_the_callers_gradients():
    weights = variables()
    optimizer = kdp.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    optimizer.build(weights)
    optimizer.scale_loss(keras.ops.convert_to_tensor(1.0))
    grads = scaled_gradients()
    grads[1] = keras.ops.convert_to_tensor(
        np.array([[np.nan, 1.0], [2.0, 3.0]], "float32")
    )
    before = [np.array(to_numpy(g)) for g in grads]
    optimizer.apply_gradients(zip(grads, weights, strict=True))
    assert optimizer.skipped_steps == 1
    for grad, value in zip(grads, before, strict=True):
        np.testing.assert_array_equal(to_numpy(grad), value)


class _Watching(kdp.LossScaleOptimizer):
    """Compares the gradients `fit` passes in before and after the step."""

    changed = None

    def _watch(self, grads, step):
        before = [None if g is None else np.array(to_numpy(g)) for g in grads]
        result = step()
        for grad, value in zip(grads, before, strict=True):
            if grad is not None and not np.array_equal(to_numpy(grad), value):
                type(self).changed = True
        if type(self).changed is None:
            type(self).changed = False
        return result

    def apply(self, grads, trainable_variables=None):
        parent = super()
        return self._watch(
            grads, lambda: parent.apply(grads, trainable_variables)
        )

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        parent = super()
        return self._watch(
            grads,
            lambda: parent.stateless_apply(
                optimizer_variables, grads, trainable_variables
            ),
        )


def test_fit_leaves_the_gradients_it_passes():
    _Watching.changed = None
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)]
    )
    model.compile(
        _Watching(keras.optimizers.SGD(0.01)), "mse", run_eagerly=True
    )
    x = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
    model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0)
    assert _Watching.changed is False, BACKEND
