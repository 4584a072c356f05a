"""The wrapper is transparent to its inner optimizer's hyperparameters.

Read or set through `kdp.LossScaleOptimizer`, a hyperparameter of the inner
optimizer is the inner optimizer's own: the next step uses it, on every
backend, in `fit` and in a custom loop. Other names raise AttributeError, as
tf.keras 2 did (tf-keras' `test_hyper_parameters_exposed`,
`test_arbitrary_attributes_not_exposed`, `testDir`).
"""

import keras
import numpy as np
import pytest
from testing import to_numpy

import keras_dtype_policy as kdp


def number(x):
    return float(to_numpy(x))


@pytest.mark.parametrize(
    "make, name, value",
    [
        (lambda: keras.optimizers.Adam(beta_1=0.8), "beta_1", 0.7),
        (lambda: keras.optimizers.Adam(), "epsilon", 1e-4),
        (lambda: keras.optimizers.SGD(momentum=0.1), "momentum", 0.9),
        (lambda: keras.optimizers.RMSprop(), "rho", 0.5),
        (lambda: keras.optimizers.AdamW(), "weight_decay", 0.25),
        (lambda: keras.optimizers.SGD(), "clipnorm", 3.0),
        (lambda: keras.optimizers.Adam(), "use_ema", True),
        (lambda: keras.optimizers.Adam(), "ema_momentum", 0.88),
    ],
)
def test_a_hyperparameter_set_through_the_wrapper_is_the_inner_ones(
    make, name, value
):
    inner = make()
    optimizer = kdp.LossScaleOptimizer(inner)
    setattr(optimizer, name, value)
    assert getattr(inner, name) == value
    assert getattr(optimizer, name) == value
    assert name not in vars(optimizer)  # no shadow copy on the wrapper
    # And the other way: set on the inner optimizer, read on the wrapper.
    setattr(inner, name, getattr(make(), name))
    assert getattr(optimizer, name) == getattr(inner, name)


def test_tf_keras_hyper_parameters_exposed():
    inner = keras.optimizers.Adam(learning_rate=1.0, beta_1=0.5, beta_2=0.9)
    optimizer = kdp.LossScaleOptimizer(inner)
    assert optimizer.beta_1 == 0.5
    assert number(optimizer.learning_rate) == 1.0
    optimizer.learning_rate = 0.005
    assert optimizer.learning_rate is inner.learning_rate
    assert number(inner.learning_rate) == pytest.approx(0.005)
    optimizer.beta_1 = 0.25
    assert inner.beta_1 == 0.25
    inner.beta_1 = 0.75
    assert optimizer.beta_1 == 0.75


def test_a_name_both_the_wrappers_and_a_hyperparameter_stays_the_wrappers():
    # tf-keras: an inner hyperparameter named `loss_scale` is not reached
    # through the wrapper, whose `loss_scale` is read-only.
    class ScaledSGD(keras.optimizers.SGD):
        def __init__(self, loss_scale=123.0, **kwargs):
            super().__init__(**kwargs)
            self.loss_scale = loss_scale

    inner = ScaledSGD()
    optimizer = kdp.LossScaleOptimizer(inner, initial_scale=8)
    assert optimizer.loss_scale == 8.0
    with pytest.raises(AttributeError):
        optimizer.loss_scale = 2.0
    assert inner.loss_scale == 123.0


def test_tf_keras_arbitrary_attributes_not_exposed():
    inner = keras.optimizers.SGD()
    optimizer = kdp.LossScaleOptimizer(inner)
    assert inner.nesterov is False
    # A flag (a bool setting) is no hyperparameter, as in tf.keras.
    with pytest.raises(
        AttributeError,
        match="'LossScaleOptimizer' object has no attribute 'nesterov'",
    ):
        optimizer.nesterov  # noqa: B018
    optimizer.nesterov = True
    assert optimizer.nesterov is True
    assert inner.nesterov is False
    with pytest.raises(AttributeError, match="no attribute 'not_a_setting'"):
        optimizer.not_a_setting  # noqa: B018
    assert not hasattr(optimizer, "_momentums")


def test_dir_lists_what_can_be_read():
    optimizer = kdp.LossScaleOptimizer(keras.optimizers.SGD(momentum=0.5))
    names = dir(optimizer)
    for name in ("learning_rate", "momentum", "minimize", "loss_scale"):
        assert name in names
        getattr(optimizer, name)
    assert "nesterov" not in names
    assert "nesterov" in dir(optimizer.inner_optimizer)
    adam = dir(kdp.LossScaleOptimizer(keras.optimizers.Adam()))
    assert {"beta_1", "beta_2", "epsilon"} <= set(adam)
    assert "amsgrad" not in adam


GRADS = [np.float32(v) for v in (1.0, -2.0, 0.5, 3.0)]


def sgd_steps(optimizer, scaled):
    """Four SGD steps on one variable; the loss is scaled if `scaled`."""
    var = keras.Variable(np.float32(1.0))
    for grad in GRADS:
        if scaled:
            optimizer.scale_loss(1.0)
            grad = grad * float(optimizer.loss_scale)
        optimizer.apply([keras.ops.convert_to_tensor(grad)], [var])
    return number(var)


def test_the_next_step_uses_a_hyperparameter_set_through_the_wrapper():
    wrapped = kdp.LossScaleOptimizer(
        keras.optimizers.SGD(1.0, momentum=0.0), initial_scale=8
    )
    wrapped.learning_rate = 0.25
    wrapped.momentum = 0.5
    reference = keras.optimizers.SGD(0.25, momentum=0.5)
    assert sgd_steps(wrapped, scaled=True) == pytest.approx(
        sgd_steps(reference, scaled=False), rel=1e-6
    )


def test_clipping_set_through_the_wrapper_clips_the_next_step():
    # tf-keras' testClipping: a gradient of 4 clipped to 2, then to 3.
    var = keras.Variable(np.float32([5.0]))
    optimizer = kdp.LossScaleOptimizer(
        keras.optimizers.SGD(2.0), initial_scale=2, dynamic_growth_steps=1
    )
    optimizer.clipnorm = 2.0
    optimizer.minimize(lambda: var * 4.0, [var])
    np.testing.assert_allclose(to_numpy(var), [1.0])
    assert optimizer.loss_scale == 4.0
    optimizer.clipnorm = 3.0
    optimizer.minimize(lambda: var * 4.0, [var])
    np.testing.assert_allclose(to_numpy(var), [-5.0])
    assert optimizer.loss_scale == 8.0
    # A non-finite gradient is skipped, not clipped.
    optimizer.minimize(lambda: var * float("inf"), [var])
    np.testing.assert_allclose(to_numpy(var), [-5.0])
    assert optimizer.loss_scale == 4.0


def data():
    rng = np.random.default_rng(0)
    return (
        rng.normal(size=(32, 3)).astype("float32"),
        rng.normal(size=(32, 1)).astype("float32"),
    )


def fitted_kernel(optimizer, callbacks=(), epochs=2):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer, "mse")
    x, y = data()
    model.fit(
        x, y, batch_size=8, epochs=epochs, verbose=0, callbacks=list(callbacks)
    )
    return to_numpy(model.layers[0].kernel)


def test_fit_uses_hyperparameters_set_through_the_wrapper():
    wrapped = kdp.LossScaleOptimizer(keras.optimizers.SGD(0.5, momentum=0.0))
    wrapped.learning_rate = 0.05
    wrapped.momentum = 0.9
    reference = kdp.LossScaleOptimizer(keras.optimizers.SGD(0.05, 0.9))
    np.testing.assert_allclose(
        fitted_kernel(wrapped), fitted_kernel(reference), rtol=1e-6
    )


def test_learning_rate_callbacks_reach_the_inner_optimizer():
    def schedule(epoch, learning_rate):
        return 0.1 * 0.5**epoch

    wrapped = kdp.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    scheduled = fitted_kernel(
        wrapped,
        [keras.callbacks.LearningRateScheduler(schedule)],
        epochs=3,
    )
    assert number(wrapped.inner_optimizer.learning_rate) == pytest.approx(0.025)
    reference = kdp.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    unscheduled = fitted_kernel(reference, epochs=3)
    assert not np.allclose(scheduled, unscheduled)

    plateau = kdp.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    fitted_kernel(
        plateau,
        [
            keras.callbacks.ReduceLROnPlateau(
                monitor="loss", factor=0.5, patience=0, min_delta=1e9
            )
        ],
        epochs=2,
    )
    # The first epoch sets the best loss, the second (no better by 1e9)
    # halves the learning rate.
    assert number(plateau.inner_optimizer.learning_rate) == pytest.approx(0.05)


def test_a_callback_setting_a_hyperparameter_by_name_reaches_the_inner():
    class SetMomentum(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            self.model.optimizer.momentum = 0.25

    wrapped = kdp.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    fitted_kernel(wrapped, [SetMomentum()], epochs=1)
    assert wrapped.inner_optimizer.momentum == 0.25
    assert "momentum" not in vars(wrapped)


def test_the_wrappers_own_settings_stay_its_own():
    # An inner optimizer with settings named like the wrapper's keeps them.
    class Odd(keras.optimizers.SGD):
        def __init__(self, initial_scale=3.0, min_scale=0.5, **kwargs):
            super().__init__(**kwargs)
            self.initial_scale = initial_scale
            self.min_scale = min_scale

    inner = Odd()
    optimizer = kdp.LossScaleOptimizer(inner, initial_scale=8, min_scale=2)
    assert (optimizer.initial_scale, optimizer.min_scale) == (8.0, 2.0)
    assert (inner.initial_scale, inner.min_scale) == (3.0, 0.5)
    optimizer.min_scale = 4.0
    assert inner.min_scale == 0.5
