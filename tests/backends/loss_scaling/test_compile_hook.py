"""The compile hook: which models get which loss-scale optimizer."""

import warnings

import keras
import numpy as np
import pytest
from testing import to_numpy

import keras_dtype_policy as kdp
from keras_dtype_policy import DTypePolicy
from keras_dtype_policy import LossScaleOptimizer


def mlp(dtype=None, head_dtype="float32"):
    extra = {} if dtype is None else {"dtype": dtype}
    return keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(4, **extra),
            keras.layers.Dense(1, dtype=head_dtype),
        ]
    )


def is_loss_scaled(model):
    return isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)


@keras.saving.register_keras_serializable("kdp_tests")
class TinySubclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(2, dtype=self.dtype_policy)

    def call(self, x):
        return self.dense(x)


@pytest.mark.parametrize(
    "global_policy", ["mixed_float16", "float16", DTypePolicy("mixed_float16")]
)
def test_any_float16_global_policy_gets_the_dynamic_optimizer(global_policy):
    kdp.set_dtype_policy(global_policy)
    model = mlp()
    model.compile("adam", "mse")
    optimizer = model.optimizer
    assert type(optimizer) is LossScaleOptimizer
    assert optimizer.dynamic
    assert optimizer.initial_scale == 2.0**15
    assert optimizer.dynamic_growth_steps == 2000
    assert isinstance(optimizer.inner_optimizer, keras.optimizers.Adam)
    assert optimizer.name == "loss_scale_optimizer"


def test_float16_layers_under_a_float32_model_get_loss_scaling():
    model = mlp(dtype="mixed_float16")
    assert model.dtype_policy.name == "float32"
    model.compile(keras.optimizers.SGD(), "mse")
    assert type(model.optimizer) is LossScaleOptimizer


def test_model_holding_a_policy_map_with_float16_entries():
    policy_map = keras.dtype_policies.DTypePolicyMap(default_policy="float32")
    policy_map["tiny/dense"] = DTypePolicy("mixed_float16")
    model = TinySubclassed(name="tiny", dtype=policy_map)
    assert model.compute_dtype == "float32"
    model.compile("adam", "mse")
    assert type(model.optimizer) is LossScaleOptimizer


def test_layers_following_a_policy_map_get_loss_scaling():
    policy_map = keras.dtype_policies.DTypePolicyMap(default_policy="float32")
    policy_map["mapped/hidden"] = DTypePolicy("mixed_float16")
    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(4, dtype=policy_map, name="hidden"),
            keras.layers.Dense(1, dtype=policy_map, name="head"),
        ],
        name="mapped",
    )
    assert model.layers[0].compute_dtype == "float16"
    assert model.layers[1].compute_dtype == "float32"
    model.compile("adam", "mse")
    assert type(model.optimizer) is LossScaleOptimizer
    float32_map = keras.dtype_policies.DTypePolicyMap(default_policy="float32")
    plain = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(1, dtype=float32_map)]
    )
    plain.compile("adam", "mse")
    assert not is_loss_scaled(plain)


@pytest.mark.parametrize(
    "policy_name", ["mixed_bfloat16", "float32", "bfloat16"]
)
def test_no_float16_no_wrapper(policy_name):
    kdp.set_dtype_policy(policy_name)
    model = mlp(head_dtype=None)
    model.compile("adam", "mse")
    assert not is_loss_scaled(model)


def test_auto_scale_loss_false_wraps_nothing():
    kdp.set_dtype_policy("mixed_float16")
    model = mlp()
    model.compile("adam", "mse", auto_scale_loss=False)
    assert not is_loss_scaled(model)


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()),
        lambda: LossScaleOptimizer(
            keras.optimizers.SGD(), dynamic=False, initial_scale=8.0
        ),
    ],
    ids=["keras", "plugin"],
)
def test_a_loss_scale_optimizer_is_left_as_it_is(make_optimizer):
    kdp.set_dtype_policy("mixed_float16")
    model = mlp()
    optimizer = make_optimizer()
    model.compile(optimizer, "mse")
    assert model.optimizer is optimizer


def test_positional_arguments_still_work():
    kdp.set_dtype_policy("mixed_float16")
    model = mlp()
    model.compile("sgd", "mse", None, ["mae"])
    assert type(model.optimizer) is LossScaleOptimizer
    assert isinstance(model.optimizer.inner_optimizer, keras.optimizers.SGD)


def compiled_models():
    with kdp.policy_scope("mixed_float16"):
        sequential = mlp()
        inputs = keras.Input((3,))
        hidden = keras.layers.Dense(4)(inputs)
        outputs = keras.layers.Dense(1, dtype="float32")(hidden)
        functional = keras.Model(inputs, outputs)
    return {"sequential": sequential, "functional": functional}


@pytest.mark.parametrize("kind", ["sequential", "functional"])
@pytest.mark.parametrize(
    "load_policy", ["float32", "mixed_float16", "mixed_bfloat16"]
)
def test_load_model_restores_the_wrapper_and_its_state(
    kind, load_policy, tmp_path
):
    model = compiled_models()[kind]
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    x = np.ones((4, 3), "float32")
    y = np.zeros((4, 1), "float32")
    for batch in [x, x * 1e6, x, x]:
        model.train_on_batch(batch, y)
    saved_state = [to_numpy(v).copy() for v in model.optimizer.variables]
    scale = model.optimizer.loss_scale
    counters = (model.optimizer.dynamic_counter, model.optimizer.skipped_steps)
    assert scale < 2.0**15
    assert model.optimizer.skipped_steps >= 1
    path = tmp_path / "model.keras"
    model.save(path)

    kdp.set_dtype_policy(load_policy)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Skipping variable loading" fails
        loaded = keras.saving.load_model(path)
    optimizer = loaded.optimizer
    assert type(optimizer) is LossScaleOptimizer
    assert optimizer.loss_scale == scale
    assert (optimizer.dynamic_counter, optimizer.skipped_steps) == counters
    assert int(to_numpy(optimizer.iterations)) == 4 - counters[1]
    for old, new in zip(saved_state, optimizer.variables, strict=True):
        np.testing.assert_array_equal(old, to_numpy(new))
    np.testing.assert_array_equal(to_numpy(loaded(x)), to_numpy(model(x)))
    loaded.train_on_batch(x * 1e-3, y)
    assert int(to_numpy(loaded.optimizer.iterations)) == 5 - counters[1]


def test_subclassed_model_reloads_with_its_optimizer(tmp_path):
    model = TinySubclassed(dtype=DTypePolicy("mixed_float16"))
    model.compile(keras.optimizers.Adam(), "mse")
    x = np.ones((2, 3), "float32")
    model.train_on_batch(x, np.zeros((2, 2), "float32"))
    assert type(model.optimizer) is LossScaleOptimizer
    path = tmp_path / "sub.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert type(loaded.optimizer) is LossScaleOptimizer
    # The first step may overflow float16 and be skipped: count both.
    assert int(to_numpy(loaded.optimizer.iterations)) == int(
        to_numpy(model.optimizer.iterations)
    )
    assert loaded.optimizer.skipped_steps == model.optimizer.skipped_steps
    assert (
        int(to_numpy(loaded.optimizer.iterations))
        + loaded.optimizer.skipped_steps
        == 1
    )


def test_jit_compile_is_kept_on_one_replica():
    # Only several tf.distribute replicas turn XLA off (see
    # test_distribution_tensorflow.py); one device keeps what was asked.
    model = mlp("mixed_float16")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.compile("sgd", "mse", jit_compile=True)
    assert is_loss_scaled(model)
    assert model.jit_compile is True
    assert not [w for w in caught if "jit_compile" in str(w.message)]
