"""tf.keras 2's loss-scale API, as tf-keras' and TensorFlow's tests pin it.

The loss-scale objects (TensorFlow's loss_scale tests) and the
`LossScaleOptimizer` (tf-keras' loss_scale_optimizer tests), on every
backend. Sparse gradients exist on TensorFlow only (`IndexedSlices`); JAX
and PyTorch autodiff give Keras dense gradients.
"""

import warnings

import keras
import numpy as np
import pytest
from testing import BACKEND
from testing import to_numpy

import keras_dtype_policy as kdp
from keras_dtype_policy import experimental

NOT_SCALED = (
    "You forgot to call LossScaleOptimizer.get_scaled_loss() and "
    "LossScaleOptimizer.get_unscaled_gradients() before calling "
    "LossScaleOptimizer.apply_gradients()"
)


def one_variable(value=1.0):
    return keras.Variable(np.float32(value), name="w")


def number(x):
    return float(to_numpy(x))


# TensorFlow's loss-scale objects.


def test_fixed_loss_scale_object():
    scale = kdp.FixedLossScale(123)
    assert number(scale()) == 123.0
    assert scale.initial_loss_scale == 123.0
    # TensorFlow's FixedLossScale answered Python True, gradients unread.
    _, apply = scale.update([np.float32(np.nan)])
    assert apply is True
    assert number(scale()) == 123.0
    _, apply = scale.update([np.float32(1.0), None])
    assert apply is True
    with pytest.raises(ValueError, match="must be a Python int or float"):
        kdp.FixedLossScale("123")


def test_dynamic_loss_scale_object_follows_tensorflows_rule():
    scale = kdp.DynamicLossScale(
        initial_loss_scale=4, increment_period=2, multiplier=2
    )
    assert scale.initial_loss_scale == 4.0
    values = []
    for grad in [1.0, 1.0, np.nan, 1.0, np.inf, np.nan, np.nan, 1.0, 1.0]:
        _, apply = scale.update([np.float32(grad)])
        assert bool(to_numpy(apply)) == bool(np.isfinite(grad))
        values.append(number(scale()))
    # Grows after two finite steps, halves on a bad one, never below 1.
    assert values == [4.0, 8.0, 4.0, 4.0, 2.0, 1.0, 1.0, 1.0, 2.0]
    assert kdp.DynamicLossScale().get_config() == {
        "initial_loss_scale": 32768.0,
        "increment_period": 2000,
        "multiplier": 2.0,
    }


# The optimizer.


def test_get_scaled_loss_tensor_and_callable():
    optimizer = kdp.LossScaleOptimizer(
        keras.optimizers.SGD(), dynamic=False, initial_scale=10
    )
    assert number(optimizer.get_scaled_loss(np.float32(5.0))) == 50.0
    scaled = optimizer.get_scaled_loss(lambda: keras.ops.convert_to_tensor(5.0))
    assert callable(scaled)
    assert number(scaled()) == 50.0
    half = optimizer.get_scaled_loss(keras.ops.ones((), dtype="float16"))
    assert keras.backend.standardize_dtype(half.dtype) == "float16"


def test_get_unscaled_gradients_keeps_none():
    optimizer = kdp.LossScaleOptimizer(
        keras.optimizers.SGD(), dynamic=False, initial_scale=10
    )
    grads = optimizer.get_unscaled_gradients(
        [np.float32(10.0), None, np.float32(20.0)]
    )
    assert grads[1] is None
    assert [number(grads[0]), number(grads[2])] == [1.0, 2.0]


@pytest.mark.skipif(
    BACKEND != "tensorflow",
    reason="IndexedSlices, TensorFlow's sparse gradients, are TF only",
)
def test_get_unscaled_gradients_keeps_indexed_slices_sparse():
    import tensorflow as tf

    optimizer = kdp.LossScaleOptimizer(
        keras.optimizers.SGD(), dynamic=False, initial_scale=4
    )
    sparse = tf.IndexedSlices(
        tf.fill((2, 3), 8.0), tf.constant([0, 2]), tf.constant([4, 3])
    )
    (unscaled,) = optimizer.get_unscaled_gradients([sparse])
    assert isinstance(unscaled, tf.IndexedSlices)
    np.testing.assert_array_equal(unscaled.values.numpy(), np.full((2, 3), 2))
    np.testing.assert_array_equal(unscaled.indices.numpy(), [0, 2])


def test_hand_unscaled_gradients_step_like_the_inner_optimizer():
    optimizer = kdp.LossScaleOptimizer(
        keras.optimizers.SGD(2.0), dynamic=True, initial_scale=8
    )
    var = one_variable()
    for _ in range(2):
        scaled_grad = optimizer.get_scaled_loss(np.float32(0.5))
        grads = optimizer.get_unscaled_gradients([scaled_grad])
        assert number(grads[0]) == 0.5
        optimizer.apply_gradients([(grads[0], var)])
    # 1 - 2 * 0.5, twice: unscaled once, not twice.
    assert number(var) == -1.0
    assert int(to_numpy(optimizer.iterations)) == 2


@pytest.mark.filterwarnings("ignore:You forgot to call")
def test_dynamic_scale_grows_and_backs_off():
    optimizer = kdp.LossScaleOptimizer(
        keras.optimizers.SGD(1.0), initial_scale=2, dynamic_growth_steps=1
    )
    var = one_variable()
    # tf-keras' testDynamicUpdate: a loss never scaled steps by the gradient
    # as given (1 - 1 * 2) and the finite step grows the scale.
    optimizer.apply_gradients([(np.float32(2.0), var)])
    assert optimizer.loss_scale == 4.0
    assert number(var) == -1.0
    optimizer.apply_gradients([(np.float32(np.nan), var)])
    assert optimizer.loss_scale == 2.0
    assert number(var) == -1.0


def test_fixed_scale_readings():
    optimizer = kdp.LossScaleOptimizer(
        keras.optimizers.SGD(), dynamic=False, initial_scale=12
    )
    assert optimizer.dynamic is False
    assert optimizer.dynamic_counter is None
    assert optimizer.dynamic_growth_steps is None
    assert optimizer.initial_scale == 12.0
    dynamic = kdp.LossScaleOptimizer(keras.optimizers.SGD())
    assert (dynamic.dynamic_counter, dynamic.dynamic_growth_steps) == (0, 2000)
    assert dynamic.initial_scale == 2.0**15


def test_loss_scale_reads_as_a_tensor():
    optimizer = kdp.LossScaleOptimizer(keras.optimizers.SGD(), initial_scale=2)
    for _ in range(2):  # before and after build
        scale = keras.ops.convert_to_tensor(optimizer.loss_scale)
        assert keras.backend.standardize_dtype(scale.dtype) == "float32"
        assert number(scale) == 2.0
        assert optimizer.loss_scale.numpy() == np.float32(2.0)
        optimizer.build([one_variable()])


def test_hyperparameters_read_through_the_wrapper():
    inner = keras.optimizers.Adam(
        learning_rate=0.5, beta_1=0.25, beta_2=0.75, use_ema=True
    )
    optimizer = kdp.LossScaleOptimizer(inner)
    assert (optimizer.beta_1, optimizer.beta_2) == (0.25, 0.75)
    assert optimizer.use_ema is True
    assert optimizer.ema_momentum == inner.ema_momentum
    assert number(optimizer.learning_rate) == 0.5
    optimizer.learning_rate = 0.125
    assert number(inner.learning_rate) == 0.125
    with pytest.raises(AttributeError, match="'LossScaleOptimizer' object"):
        optimizer.nonexistent_attribute  # noqa: B018
    # The moving averages are the inner optimizer's, not the wrapper's too.
    plain = kdp.LossScaleOptimizer(keras.optimizers.Adam())
    optimizer.build([one_variable()])
    plain.build([one_variable()])
    assert len(optimizer._variables) == len(plain._variables)


def test_wrapping_errors_in_tf_keras_words():
    with pytest.raises(TypeError, match="cannot wrap another"):
        kdp.LossScaleOptimizer(kdp.LossScaleOptimizer(keras.optimizers.SGD()))
    with pytest.raises(TypeError, match="must be a keras.optimizers"):
        kdp.LossScaleOptimizer(1)
    inner = keras.optimizers.SGD()
    kdp.LossScaleOptimizer(inner)
    with pytest.raises(
        ValueError,
        match='"inner_optimizer" is already wrapped by a LossScaleOptimizer',
    ):
        kdp.LossScaleOptimizer(inner)


def test_argument_errors_in_tf_keras_words():
    with pytest.raises(TypeError, match='"dynamic" argument to Loss'):
        kdp.LossScaleOptimizer(keras.optimizers.SGD(), dynamic="dynamic")
    with pytest.raises(ValueError, match='"initial_scale" must be specified'):
        kdp.LossScaleOptimizer(keras.optimizers.SGD(), dynamic=False)
    with pytest.raises(
        ValueError,
        match='"dynamic_growth_steps" must be None if "dynamic" is False, '
        "but got: 2",
    ):
        kdp.LossScaleOptimizer(
            keras.optimizers.SGD(),
            dynamic=False,
            initial_scale=1,
            dynamic_growth_steps=2,
        )


def test_apply_gradients_warns_when_the_loss_was_not_scaled():
    var = one_variable()
    optimizer = kdp.LossScaleOptimizer(keras.optimizers.SGD())
    with pytest.warns(UserWarning, match="get_scaled_loss\\(\\) and"):
        optimizer.apply_gradients([(np.float32(1.0), var)])
    optimizer = kdp.LossScaleOptimizer(keras.optimizers.SGD())
    optimizer.get_unscaled_gradients([np.float32(1.0)])
    with pytest.warns(UserWarning, match="you did call get_unscaled_grad"):
        optimizer.apply_gradients([(np.float32(1.0), var)])
    optimizer = kdp.LossScaleOptimizer(keras.optimizers.SGD())
    optimizer.get_scaled_loss(np.float32(1.0))
    grads = optimizer.get_unscaled_gradients([np.float32(1.0)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer.apply_gradients([(grads[0], var)])


def test_fit_never_warns_about_scaling():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(kdp.LossScaleOptimizer(keras.optimizers.SGD()), "mse")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0)
    assert not [w for w in caught if "You forgot" in str(w.message)]


def test_config_round_trips_through_keras_serialization():
    for optimizer in (
        kdp.LossScaleOptimizer(keras.optimizers.SGD(), initial_scale=8),
        kdp.LossScaleOptimizer(
            keras.optimizers.SGD(), dynamic=False, initial_scale=12
        ),
    ):
        revived = keras.optimizers.deserialize(
            keras.optimizers.serialize(optimizer)
        )
        assert type(revived) is type(optimizer)
        assert (
            revived.dynamic,
            revived.initial_scale,
            revived.dynamic_growth_steps,
        ) == (
            optimizer.dynamic,
            optimizer.initial_scale,
            optimizer.dynamic_growth_steps,
        )


# TensorFlow 2.3: LossScaleOptimizer(optimizer, loss_scale).


@pytest.mark.parametrize(
    "loss_scale, expected",
    [
        ("dynamic", (True, 32768.0, 2000)),
        (5, (False, 5.0, None)),
        (kdp.FixedLossScale(3), (False, 3.0, None)),
        (kdp.DynamicLossScale(4, 2), (True, 4.0, 2)),
    ],
)
def test_tf_2_3_signature(loss_scale, expected):
    optimizer = experimental.LossScaleOptimizer(
        keras.optimizers.SGD(), loss_scale
    )
    assert isinstance(optimizer, kdp.LossScaleOptimizer)
    assert (
        optimizer.dynamic,
        optimizer.initial_scale,
        optimizer.dynamic_growth_steps,
    ) == expected
    revived = keras.optimizers.deserialize(
        keras.optimizers.serialize(optimizer)
    )
    assert revived.get_config() == optimizer.get_config()


def test_tf_2_3_signature_needs_a_loss_scale():
    with pytest.raises(ValueError, match="loss_scale=None"):
        experimental.LossScaleOptimizer(keras.optimizers.SGD(), None)


TF_2_3_CONFIG = {
    "optimizer": {
        "class_name": "SGD",
        "config": {"name": "SGD", "learning_rate": 0.5, "momentum": 0.0},
    },
    "loss_scale": {
        "class_name": "DynamicLossScale",
        "config": {
            "initial_loss_scale": 64.0,
            "increment_period": 10,
            "multiplier": 2.0,
        },
    },
}


@pytest.mark.parametrize(
    "read",
    [
        lambda config: kdp.LossScaleOptimizer.from_config(config),
        lambda config: keras.optimizers.deserialize(
            {"class_name": "LossScaleOptimizerV1", "config": config}
        ),
        # TensorFlow 2.3 wrote "LossScaleOptimizer", the name of Keras' own
        # class, which cannot hold a fixed scale.
        lambda config: keras.optimizers.deserialize(
            {"class_name": "LossScaleOptimizer", "config": config}
        ),
        lambda config: keras.optimizers.get(
            {"class_name": "LossScaleOptimizer", "config": config}
        ),
    ],
    ids=["from_config", "keras_deserialize_v1", "keras_deserialize", "get"],
)
def test_reads_tf_2_3_configs(read):
    optimizer = read(TF_2_3_CONFIG)
    assert isinstance(optimizer, kdp.LossScaleOptimizer)
    assert (optimizer.dynamic, optimizer.initial_scale) == (True, 64.0)
    assert optimizer.dynamic_growth_steps == 10
    assert number(optimizer.learning_rate) == 0.5
    fixed = read(
        {
            **TF_2_3_CONFIG,
            "loss_scale": {
                "class_name": "FixedLossScale",
                "config": {"loss_scale_value": 2.0},
            },
        }
    )
    assert (fixed.dynamic, fixed.loss_scale) == (False, 2.0)


def test_keras_deserialize_reads_tf_keras_2_4_configs():
    # tf.keras 2.4 to 2.21 wrote `dynamic`, which Keras' own class lacks.
    config = {
        "inner_optimizer": {"class_name": "SGD", "config": {"name": "SGD"}},
        "dynamic": False,
        "initial_scale": 128.0,
        "dynamic_growth_steps": None,
    }
    optimizer = keras.optimizers.deserialize(
        {"class_name": "LossScaleOptimizer", "config": config}
    )
    assert type(optimizer) is kdp.LossScaleOptimizer
    assert (optimizer.dynamic, optimizer.loss_scale) == (False, 128.0)
    assert optimizer.dynamic_counter is None


def test_keras_own_configs_still_build_keras_own_class():
    keras_optimizer = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(), initial_scale=16.0
    )
    revived = keras.optimizers.deserialize(
        keras.optimizers.serialize(keras_optimizer)
    )
    assert type(revived) is keras.optimizers.LossScaleOptimizer
    assert revived.initial_scale == 16.0


# tf-keras' testGetConfigFixed / testGetConfigDynamic: the config of each
# tf.keras generation, read back and used for one step of `minimize`.

SGD_2_3 = {
    "class_name": "SGD",
    "config": {
        "learning_rate": 2.0,
        "momentum": 0.5,
        "decay": 0.0,
        "nesterov": False,
        "name": "SGD",
    },
}
# tf.keras 2.11 to 2.21 (the optimizer tf.keras 2.9 called experimental).
SGD_2_11 = {
    "module": "keras.optimizers",
    "class_name": "SGD",
    "config": {
        "name": "SGD",
        "weight_decay": None,
        "clipnorm": None,
        "global_clipnorm": None,
        "clipvalue": None,
        "use_ema": False,
        "ema_momentum": 0.99,
        "ema_overwrite_frequency": None,
        "jit_compile": True,
        "is_legacy_optimizer": False,
        "learning_rate": 2.0,
        "momentum": 0.5,
        "nesterov": False,
    },
    "registered_name": None,
}


def tf_keras_config(layout, dynamic):
    if layout == "tf2_3":
        if dynamic:
            loss_scale = {
                "class_name": "DynamicLossScale",
                "config": {
                    "initial_loss_scale": 2.0,
                    "increment_period": 3,
                    "multiplier": 2.0,
                },
            }
        else:
            loss_scale = {
                "class_name": "FixedLossScale",
                "config": {"loss_scale_value": 2.0},
            }
        return {"optimizer": SGD_2_3, "loss_scale": loss_scale}
    inner = SGD_2_3 if layout == "tf2_4_to_2_8" else SGD_2_11
    return {
        "inner_optimizer": inner,
        "dynamic": dynamic,
        "initial_scale": 2.0,
        "dynamic_growth_steps": 3 if dynamic else None,
    }


@pytest.mark.parametrize("dynamic", [False, True], ids=["fixed", "dynamic"])
@pytest.mark.parametrize(
    "layout", ["tf2_3", "tf2_4_to_2_8", "tf2_9_plus", "own"]
)
def test_tf_keras_get_config_layouts(layout, dynamic):
    if layout == "own":
        optimizer = kdp.LossScaleOptimizer(
            keras.optimizers.SGD(2.0, momentum=0.5),
            dynamic=dynamic,
            initial_scale=2,
            dynamic_growth_steps=3 if dynamic else None,
        )
        config = optimizer.get_config()
    else:
        config = tf_keras_config(layout, dynamic)
    optimizer = kdp.LossScaleOptimizer.from_config(config)
    assert number(optimizer.learning_rate) == 2.0
    assert optimizer.inner_optimizer.momentum == 0.5
    assert optimizer.loss_scale == 2.0
    assert optimizer.initial_scale == 2.0
    assert optimizer.dynamic is dynamic
    assert optimizer.dynamic_growth_steps == (3 if dynamic else None)
    # Its own config round-trips.
    revived = kdp.LossScaleOptimizer.from_config(optimizer.get_config())
    assert revived.get_config() == optimizer.get_config()
    # The optimizer can be used: d(var)/d(var) = 1, SGD(2): 5 - 2 = 3.
    var = keras.Variable(np.float32([5.0]))
    optimizer.minimize(lambda: var, var_list=[var])
    np.testing.assert_array_equal(to_numpy(var), [3.0])
    assert optimizer.dynamic_counter == (1 if dynamic else None)


def test_tf_keras_serialization_with_built_in_optimizer():
    optimizer = kdp.LossScaleOptimizer(
        keras.optimizers.SGD(2.0, momentum=0.5),
        initial_scale=2.0,
        dynamic_growth_steps=3,
    )
    for class_name in ("LossScaleOptimizer", "LossScaleOptimizerV1"):
        config = keras.optimizers.serialize(optimizer)
        config["class_name"] = class_name
        revived = keras.optimizers.deserialize(config)
        assert isinstance(revived, kdp.LossScaleOptimizer)
        assert number(revived.learning_rate) == 2.0
        assert revived.inner_optimizer.momentum == 0.5
        assert (revived.loss_scale, revived.dynamic_growth_steps) == (2.0, 3)
        assert revived.dynamic is True
        var = keras.Variable(np.float32([5.0]))
        revived.minimize(lambda var=var: var, var_list=[var])
        np.testing.assert_array_equal(to_numpy(var), [3.0])
        assert revived.dynamic_counter == 1


def test_tf_keras_fixed_loss_scale_applied_to_loss_with_minimize():
    # tf-keras checks the gradient reaching the loss is the scale. Here the
    # scale is what keeps a float16 gradient alive: d/dvar of
    # float16(var) * 2**-13 * 2**-13 is 2**-26, below float16's smallest
    # subnormal (2**-24); scaled by 2**15 on its way back, it is 2**-11.
    tiny = keras.ops.convert_to_tensor(2.0**-13, dtype="float16")

    def step(initial_scale):
        var = keras.Variable(np.float32([1.0]))
        optimizer = kdp.LossScaleOptimizer(
            keras.optimizers.SGD(2.0**26),
            dynamic=False,
            initial_scale=initial_scale,
        )
        optimizer.minimize(
            lambda: keras.ops.cast(var, "float16") * tiny * tiny, [var]
        )
        return to_numpy(var)

    np.testing.assert_array_equal(step(2.0**15), [0.0])  # 1 - 2**26 * 2**-26
    np.testing.assert_array_equal(step(1.0), [1.0])  # the gradient was 0
    # tf-keras' own numbers: SGD(2), fixed scale 10, var 5 -> 3.
    var = keras.Variable(np.float32([5.0]))
    optimizer = kdp.LossScaleOptimizer(
        keras.optimizers.SGD(2.0), dynamic=False, initial_scale=10.0
    )
    assert optimizer.loss_scale == 10.0
    optimizer.minimize(lambda: var, var_list=[var])
    np.testing.assert_array_equal(to_numpy(var), [3.0])


def test_minimize_arguments():
    var = keras.Variable(np.float32([5.0]))
    optimizer = kdp.LossScaleOptimizer(keras.optimizers.SGD(1.0))
    with pytest.raises(ValueError, match="at least one variable"):
        optimizer.minimize(lambda: var, var_list=[])
    # tf.keras also took a callable returning the variables.
    optimizer.minimize(lambda: var * 2.0, var_list=lambda: [var])
    np.testing.assert_array_equal(to_numpy(var), [3.0])
    if BACKEND == "tensorflow":
        with pytest.raises(ValueError, match="`tape` is required"):
            optimizer.minimize(keras.ops.convert_to_tensor(1.0), [var])
    else:
        # JAX and PyTorch differentiate a callable, not a computed tensor.
        with pytest.raises(TypeError, match="must be a callable"):
            optimizer.minimize(keras.ops.convert_to_tensor(1.0), [var])
        with pytest.raises(ValueError, match="TensorFlow backend only"):
            optimizer.minimize(lambda: var, [var], tape=object())


@pytest.mark.skipif(
    BACKEND != "tensorflow",
    reason="a loss tensor recorded on a tf.GradientTape is TensorFlow's",
)
def test_minimize_with_a_tape_on_tensorflow():
    import tensorflow as tf

    var = keras.Variable(np.float32([5.0]))
    optimizer = kdp.LossScaleOptimizer(keras.optimizers.SGD(1.0))
    with tf.GradientTape() as tape:
        loss = var.value * 2.0
    optimizer.minimize(loss, [var], tape=tape)
    np.testing.assert_array_equal(to_numpy(var), [3.0])


def test_dynamic_loss_scale_object_stops_growing_at_the_float32_max():
    # TensorFlow's test_keep_increasing_until_capped.
    initial = float(np.finfo(np.float32).max) / 4
    largest = float(np.finfo(np.float32).max)
    scale = kdp.DynamicLossScale(
        initial_loss_scale=initial, increment_period=2, multiplier=2
    )
    values = []
    for _ in range(6):
        scale.update([np.float32(1.0)])
        values.append(number(scale()))
    assert values == [
        initial,
        initial * 2,
        initial * 2,
        largest,
        largest,
        largest,
    ]
    assert np.isfinite(values[-1])


# tf-keras' from_config and constructor rules for the loss scale of a
# TensorFlow 2.3 config or argument.


def _tf_2_3_dynamic(**settings):
    scale = {"initial_loss_scale": 2.0, "increment_period": 3}
    scale["multiplier"] = 2.0
    scale.update(settings)
    return {
        **TF_2_3_CONFIG,
        "loss_scale": {"class_name": "DynamicLossScale", "config": scale},
    }


BAD_TF_2_3_CONFIGS = {
    "multiplier_1": (_tf_2_3_dynamic(multiplier=1.0), "multiplier=1.0"),
    "multiplier_0.5": (_tf_2_3_dynamic(multiplier=0.5), "multiplier=0.5"),
    "increment_period_0": (
        _tf_2_3_dynamic(increment_period=0),
        "increment_period=0",
    ),
    "increment_period_2.5": (
        _tf_2_3_dynamic(increment_period=2.5),
        "increment_period=2.5",
    ),
    # tf.keras: "Serialized LossScaleOptimizers with a LossScale that is
    # neither a FixedLossScale nor a DynamicLossScale can no longer be
    # deserialized".
    "other_class": (
        {
            **TF_2_3_CONFIG,
            "loss_scale": {"class_name": "MyLossScale", "config": {}},
        },
        "MyLossScale",
    ),
    "no_loss_scale": ({**TF_2_3_CONFIG, "loss_scale": None}, "loss_scale"),
}


@pytest.mark.parametrize("key", sorted(BAD_TF_2_3_CONFIGS))
@pytest.mark.parametrize(
    "optimizer_class",
    [kdp.mixed_precision.LossScaleOptimizer, experimental.LossScaleOptimizer],
    ids=["LossScaleOptimizer", "LossScaleOptimizerV1"],
)
def test_from_config_refuses_a_loss_scale_the_wrapper_cannot_take(
    optimizer_class, key
):
    config, named = BAD_TF_2_3_CONFIGS[key]
    with pytest.raises(ValueError, match=named):
        optimizer_class.from_config(config)


@pytest.mark.parametrize(
    "settings, error, named",
    [
        ({"dynamic_growth_steps": 0}, ValueError, "dynamic_growth_steps=0"),
        ({"dynamic_growth_steps": -3}, ValueError, "dynamic_growth_steps=-3"),
        ({"dynamic_growth_steps": 2.5}, TypeError, "dynamic_growth_steps=2.5"),
        (
            {"dynamic": False, "initial_scale": 0.0},
            ValueError,
            "initial_scale=0.0",
        ),
    ],
)
def test_from_config_refuses_bad_tf_keras_2_4_settings(settings, error, named):
    config = {
        "inner_optimizer": keras.optimizers.serialize(keras.optimizers.SGD()),
        "dynamic": True,
        "initial_scale": 2.0,
        "dynamic_growth_steps": 3,
        **settings,
    }
    with pytest.raises(error, match=named):
        kdp.mixed_precision.LossScaleOptimizer.from_config(config)


def test_a_multiplier_other_than_2_is_kept():
    # tf.keras 2.4+ refused it ("whose multiplier is not 2"); TensorFlow
    # 2.3 trained with it, and this wrapper can: a documented difference.
    for optimizer in (
        kdp.mixed_precision.LossScaleOptimizer.from_config(
            _tf_2_3_dynamic(multiplier=4.0)
        ),
        experimental.LossScaleOptimizer(
            keras.optimizers.SGD(), kdp.DynamicLossScale(2.0, 3, 4.0)
        ),
    ):
        assert (optimizer.growth_factor, optimizer.backoff_factor) == (
            4.0,
            0.25,
        )


def test_v1_constructor_refuses_a_loss_scale_of_another_class():
    from keras_dtype_policy.loss_scaling.loss_scale import LossScale

    class MyLossScale(LossScale):
        def get_config(self):
            return {}

    # tf.keras' error type and wording.
    with pytest.raises(TypeError, match="not a FixedLossScale or a Dynamic"):
        experimental.LossScaleOptimizer(keras.optimizers.SGD(), MyLossScale())


# tf-keras' testWeightMethods: the wrapper's `set_weights` sets its inner
# optimizer's weights (tf.keras' layout: the step count first, as a float
# there), and a list of the wrong length raises a ValueError.


def test_set_weights_in_the_tf_keras_layout_and_the_wrong_count():
    optimizer = kdp.mixed_precision.LossScaleOptimizer(
        keras.optimizers.SGD(1.0), initial_scale=2.0, dynamic_growth_steps=1
    )
    var = keras.Variable(np.float32([1.0]))
    optimizer.minimize(lambda: var * 2.0, [var])
    assert int(to_numpy(optimizer.iterations)) == 1
    optimizer.inner_optimizer.set_weights([np.array(4.0)])
    assert int(to_numpy(optimizer.iterations)) == 4
    optimizer.set_weights([np.array(2.0)])
    assert int(to_numpy(optimizer.iterations)) == 2
    count = len(optimizer.variables)
    for wrong in ([np.array(2.0)] * 3, [np.array(2.5)]):
        with pytest.raises(
            ValueError,
            match=f"its {count} variables do not match the {len(wrong)} saved",
        ):
            optimizer.set_weights(wrong)
    assert int(to_numpy(optimizer.iterations)) == 2
    values = [to_numpy(v) for v in optimizer.variables]
    values[0] = np.array(7, dtype=values[0].dtype)
    optimizer.set_weights(values)
    np.testing.assert_array_equal(to_numpy(optimizer.variables[0]), 7)


# tf-keras' testIterationsIncremented: tf.keras 2 counted a skipped step in
# `iterations`; here (as in Keras 3) `iterations` counts the applied steps
# and `skipped_steps` the others, their sum being tf.keras' count (see
# docs/tf-keras-migration.md, "Differences from tf.keras 2").


def test_a_skipped_step_in_a_custom_loop():
    optimizer = kdp.mixed_precision.LossScaleOptimizer(
        keras.optimizers.SGD(1.0)
    )
    var = keras.Variable(np.float32([5.0]))
    optimizer.minimize(lambda: var * 2.0, [var])
    np.testing.assert_array_equal(to_numpy(var), [3.0])
    optimizer.minimize(lambda: var * float("nan"), [var])
    np.testing.assert_array_equal(to_numpy(var), [3.0])
    assert int(to_numpy(optimizer.iterations)) == 1
    assert optimizer.skipped_steps == 1
    # tf.keras 2's `iterations` here: 2.
    assert int(to_numpy(optimizer.iterations)) + optimizer.skipped_steps == 2


def test_a_skipped_step_under_fit():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(
        optimizer=kdp.mixed_precision.LossScaleOptimizer(
            keras.optimizers.SGD(0.01)
        ),
        loss="mse",
    )
    x = np.ones((8, 2), dtype="float32")
    x[2:4] = np.nan  # the second of four batches
    model.fit(x, np.zeros((8, 1)), batch_size=2, shuffle=False, verbose=0)
    optimizer = model.optimizer
    assert int(to_numpy(optimizer.iterations)) == 3
    assert optimizer.skipped_steps == 1
    assert np.isfinite(to_numpy(model.layers[0].kernel)).all()
