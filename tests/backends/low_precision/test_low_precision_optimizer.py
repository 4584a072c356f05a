"""LowPrecisionOptimizer: updates that survive bfloat16 and float16 weights.

Each test runs on the backend KERAS_BACKEND names; every expectation holds
on tensorflow, jax and torch alike unless a test says otherwise.
"""

import keras
import numpy as np
import pytest
from testing import BACKEND
from testing import assert_serialization_round_trip
from testing import inner_optimizers
from testing import to_numpy

import keras_dtype_policy
from keras_dtype_policy import LossScaleOptimizer
from keras_dtype_policy import LowPrecisionOptimizer
from keras_dtype_policy.low_precision import compensated_updates

BFLOAT16_ULP_BELOW_ONE = 2.0**-8

# Cases left out of the default run, each for the reason at its use.
SLOW = pytest.mark.slow


def as_float32(x):
    # Cast first: TensorFlow cannot turn a bfloat16 scalar into NumPy.
    return np.asarray(to_numpy(keras.ops.cast(x, "float32")))


# The unit proof: 1000 updates of -1e-4 to a bfloat16 weight of 1.0.


def thousand_updates(optimizer, shape=()):
    weight = keras.Variable(np.ones(shape, "float32"), dtype="bfloat16")
    gradient = keras.ops.ones(shape, "bfloat16")
    for _ in range(1000):
        optimizer.apply([gradient], [weight])
    return weight


def test_kahan_adds_up_updates_below_half_an_ulp():
    optimizer = LowPrecisionOptimizer(keras.optimizers.SGD(1e-4))
    weight = thousand_updates(optimizer)
    value = as_float32(
        compensated_updates.kahan_read(
            weight, optimizer.compensation_of(weight)
        )
    )
    # The value the weight and its compensation stand for is 0.9; the
    # bfloat16 weight itself is the nearest bfloat16 number to it (0.9
    # lies between 0.8984375 and 0.90234375).
    assert abs(value - 0.9) <= 0.002
    assert abs(as_float32(weight) - 0.9) <= BFLOAT16_ULP_BELOW_ONE
    assert as_float32(weight) == as_float32(
        keras.ops.cast(keras.ops.cast(value, "float32"), "bfloat16")
    )


def test_stochastic_rounding_adds_up_updates_on_average():
    # One weight random-walks (about 26 steps of 2**-8 down, give or take
    # 5): the mean of 1024 weights is within the brief's 0.002.
    optimizer = LowPrecisionOptimizer(
        keras.optimizers.SGD(1e-4), update="stochastic_rounding", seed=3
    )
    weight = thousand_updates(optimizer, shape=(1024,))
    assert abs(as_float32(weight).mean() - 0.9) <= 0.002
    assert optimizer.compensation_of(weight) is None


@pytest.mark.parametrize("wrapped", [False, True], ids=["keras", "nearest"])
def test_without_compensation_the_weight_stays_at_one(wrapped):
    optimizer = keras.optimizers.SGD(1e-4)
    if wrapped:
        optimizer = LowPrecisionOptimizer(optimizer, update="nearest")
    weight = thousand_updates(optimizer)
    assert as_float32(weight) == 1.0


class SumLayer(keras.layers.Layer):
    """Outputs the sum of its weights: the loss below has gradient 1."""

    def __init__(self, size, **kwargs):
        super().__init__(**kwargs)
        self.size = size

    def build(self, input_shape):
        self.w = self.add_weight(
            shape=(self.size,), initializer="ones", name="w"
        )

    def call(self, inputs):
        return keras.ops.sum(self.w) * keras.ops.ones_like(inputs)


def mean_prediction(y_true, y_pred):
    return keras.ops.mean(y_pred)


@pytest.mark.parametrize("update", ["kahan", "stochastic_rounding", None])
def test_thousand_updates_in_compiled_fit(update):
    # fit compiles the step: XLA on jax (Keras' default) and on TensorFlow
    # (jit_compile=True); torch runs eagerly (Keras has no jit there).
    model = keras.Sequential(
        [keras.Input((1,)), SumLayer(1024, dtype="bfloat16")]
    )
    optimizer = keras.optimizers.SGD(1e-4)
    if update is not None:
        optimizer = LowPrecisionOptimizer(optimizer, update=update, seed=1)
    jit = "auto" if BACKEND == "torch" else True
    model.compile(optimizer, mean_prediction, jit_compile=jit)
    x = np.zeros((1000, 1), "float32")
    model.fit(x, x, batch_size=1, epochs=1, verbose=0, shuffle=False)
    weight = as_float32(model.layers[0].w)
    if update is None:
        assert np.all(weight == 1.0)
    elif update == "kahan":
        assert np.all(np.abs(weight - 0.9) <= BFLOAT16_ULP_BELOW_ONE)
        value = weight + as_float32(
            optimizer.compensation_of(model.layers[0].w)
        )
        assert np.all(np.abs(value - 0.9) <= 0.002)
    else:
        assert abs(weight.mean() - 0.9) <= 0.002


# Stochastic rounding itself.


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("magnitude", [1.0, 1e-3, -3.0e4], ids=str)
def test_stochastic_rounding_is_unbiased(dtype, magnitude):
    low = float(as_float32(keras.ops.cast(np.float32(magnitude), dtype)))
    mantissa_bits = 7 if dtype == "bfloat16" else 10
    spacing = 2.0 ** (np.floor(np.log2(abs(low))) - mantissa_bits)
    above = low + spacing
    # A value 0.3 of the way from one neighbour in `dtype` to the next.
    value = np.float32(low + 0.3 * spacing)
    generator = keras.random.SeedGenerator(7)
    values = keras.ops.full((20000,), value, "float32")
    rounded = as_float32(
        compensated_updates.stochastic_round(values, dtype, generator)
    )
    assert set(np.unique(rounded).tolist()) <= {low, above}
    assert abs(rounded.mean() - value) < 0.02 * spacing


def test_stochastic_rounding_of_float16_subnormals_is_unbiased():
    value = np.float32(2.0**-24 * 5.25)
    generator = keras.random.SeedGenerator(1)
    rounded = as_float32(
        compensated_updates.stochastic_round(
            keras.ops.full((20000,), value, "float32"), "float16", generator
        )
    )
    assert set(np.unique(rounded).tolist()) <= {2.0**-24 * 5, 2.0**-24 * 6}
    assert abs(rounded.mean() - value) < 0.02 * 2.0**-24


def test_stochastic_rounding_is_seeded_and_moves_on():
    values = keras.ops.full((256,), 1.0 + 2.0**-10, "float32")

    def two_draws(seed):
        generator = keras.random.SeedGenerator(seed)
        return [
            as_float32(
                compensated_updates.stochastic_round(
                    values, "bfloat16", generator
                )
            )
            for _ in range(2)
        ]

    first, second = two_draws(11)
    again_first, again_second = two_draws(11)
    np.testing.assert_array_equal(first, again_first)
    np.testing.assert_array_equal(second, again_second)
    assert not np.array_equal(first, second)


def test_stochastic_rounding_to_float16_overflows_where_a_cast_does():
    # Between 65504 (float16's largest) and 65520 a cast gives 65504; from
    # 65520 on, infinity. Stochastic rounding does the same there.
    values = np.array([65505.0, 65510.0, 65519.0, -65510.0, 65520.0], "float32")
    tiled = keras.ops.convert_to_tensor(np.repeat(values, 2000))
    rounded = as_float32(
        compensated_updates.stochastic_round(
            tiled, "float16", keras.random.SeedGenerator(0)
        )
    ).reshape(len(values), -1)
    cast = as_float32(
        keras.ops.cast(keras.ops.convert_to_tensor(values), "float16")
    )
    for row, expected in zip(rounded, cast, strict=True):
        assert set(np.unique(row).tolist()) == {float(expected)}


def test_stochastic_rounding_keeps_nan_and_infinities():
    values = keras.ops.convert_to_tensor(
        np.array([np.nan, np.inf, -np.inf, 1.5], "float32")
    )
    rounded = as_float32(
        compensated_updates.stochastic_round(
            values, "bfloat16", keras.random.SeedGenerator(0)
        )
    )
    assert np.isnan(rounded[0])
    assert rounded[1] == np.inf and rounded[2] == -np.inf
    assert rounded[3] == 1.5


# Every built-in optimizer, and a user's.


class HalvingSGD(keras.optimizers.Optimizer):
    """A user's optimizer: plain SGD at half the learning rate."""

    def update_step(self, gradient, variable, learning_rate):
        step = keras.ops.cast(learning_rate, variable.dtype) * 0.5
        self.assign_sub(
            variable, keras.ops.cast(gradient, variable.dtype) * step
        )


# Every row of the shared table (tests/backends/testing.py), and a user's.
BUILT_IN = {
    **inner_optimizers(),
    "user": lambda: HalvingSGD(learning_rate=0.2),
}


def regression_data(samples=128, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(samples, 8).astype("float32")
    y = (x @ rng.randn(8, 1) * 0.5).astype("float32")
    return x, y


def small_model(dtype):
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="tanh", dtype=dtype),
            keras.layers.Dense(1, dtype=dtype),
        ]
    )


def least_squares_loss_and_gradients(x, y, kernel, bias):
    """Mean squared error of `x @ kernel + bias`, and its gradients."""
    kernel32 = keras.ops.cast(kernel, "float32")
    bias32 = keras.ops.cast(bias, "float32")
    error = keras.ops.matmul(x, kernel32) + bias32 - y
    loss = float(to_numpy(keras.ops.mean(error**2)))
    scale = 2.0 / x.shape[0]
    grad_kernel = keras.ops.matmul(keras.ops.transpose(x), error) * scale
    grad_bias = keras.ops.sum(error, axis=0) * scale
    grads = [keras.ops.cast(g, "bfloat16") for g in (grad_kernel, grad_bias)]
    return loss, grads


@pytest.mark.parametrize("name", sorted(BUILT_IN))
def test_every_optimizer_trains_bfloat16_weights(name):
    # Eager steps on a least-squares problem: no model to compile, so the
    # cases stay fast on every backend.
    x, y = regression_data(samples=64)
    x, y = keras.ops.convert_to_tensor(x), keras.ops.convert_to_tensor(y)
    kernel = keras.Variable(np.zeros((8, 1), "float32"), dtype="bfloat16")
    bias = keras.Variable(np.zeros((1,), "float32"), dtype="bfloat16")
    optimizer = LowPrecisionOptimizer(BUILT_IN[name](), seed=0)
    losses = []
    for _ in range(8):
        loss, grads = least_squares_loss_and_gradients(x, y, kernel, bias)
        losses.append(loss)
        optimizer.apply(grads, [kernel, bias])
    losses.append(least_squares_loss_and_gradients(x, y, kernel, bias)[0])
    assert np.all(np.isfinite(losses))
    assert losses[-1] < losses[0]
    for weight in (kernel, bias):
        assert keras.backend.standardize_dtype(weight.dtype) == "bfloat16"


def test_adam_moves_small_bfloat16_weights_where_keras_alone_does_not():
    # keras-hub #2629: Adam gives no update to bfloat16 LoRA weights. With
    # Keras alone, beta_2=0.999 is 1.0 in bfloat16, so Adam's step size
    # sqrt(1 - beta_2**t) is 0.
    def lora_like(optimizer):
        weight = keras.Variable(
            np.random.RandomState(0).randn(8, 4).astype("float32") * 0.01,
            dtype="bfloat16",
        )
        before = as_float32(weight)
        gradient = keras.ops.convert_to_tensor(
            np.random.RandomState(1).randn(8, 4).astype("float32") * 1e-3,
            dtype="bfloat16",
        )
        for _ in range(5):
            optimizer.apply([gradient], [weight])
        return before, as_float32(weight)

    before, after = lora_like(keras.optimizers.Adam(1e-4, beta_2=0.999))
    np.testing.assert_array_equal(before, after)
    before, after = lora_like(
        LowPrecisionOptimizer(keras.optimizers.Adam(1e-4, beta_2=0.999))
    )
    change = np.abs(after - before)
    assert np.all(change > 0)
    # Adam's first steps move each weight by about lr a step.
    assert np.all(change < 5 * 1e-4 * 1.5)


def test_weight_decay_and_constraints_go_through_float32():
    weight = keras.Variable(np.ones((4,), "float32"), dtype="bfloat16")
    optimizer = LowPrecisionOptimizer(
        keras.optimizers.AdamW(5e-2, weight_decay=0.01)
    )
    zeros = keras.ops.zeros((4,), "bfloat16")
    for _ in range(200):
        optimizer.apply([zeros], [weight])
    value = as_float32(weight) + as_float32(optimizer.compensation_of(weight))
    # Decay of 5e-4 a step, each below half an ulp of 1.0 (2**-9).
    np.testing.assert_allclose(value, (1 - 5e-4) ** 200, atol=0.002)
    assert np.all(as_float32(weight) < 0.91)

    clipped = keras.Variable(np.zeros((2,), "float32"), dtype="bfloat16")
    optimizer = LowPrecisionOptimizer(
        keras.optimizers.SGD(1.0, clipnorm=1.0), update="nearest"
    )
    optimizer.apply(
        [keras.ops.convert_to_tensor(np.array([30.0, 40.0]), "bfloat16")],
        [clipped],
    )
    np.testing.assert_allclose(as_float32(clipped), [-0.6, -0.8], atol=4e-3)

    non_negative = keras.Variable(np.zeros((2,), "float32"), dtype="bfloat16")
    # keras.Variable takes no constraint argument; layers set it so.
    non_negative.constraint = keras.constraints.NonNeg()
    optimizer = LowPrecisionOptimizer(keras.optimizers.SGD(1.0))
    optimizer.apply([keras.ops.ones((2,), "bfloat16")], [non_negative])
    np.testing.assert_array_equal(as_float32(non_negative), [0.0, 0.0])


def test_float32_weights_are_updated_as_by_the_inner_optimizer():
    def run(wrap):
        keras.utils.set_random_seed(0)
        model = small_model("float32")
        optimizer = keras.optimizers.Adam(0.01)
        if wrap:
            optimizer = LowPrecisionOptimizer(optimizer)
        model.compile(optimizer, "mse")
        x, y = regression_data()
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
        return [as_float32(w) for w in model.weights]

    for alone, wrapped in zip(run(False), run(True), strict=True):
        np.testing.assert_array_equal(alone, wrapped)


# State in a chosen dtype.


def slot_dtypes(optimizer):
    inner = optimizer.inner_optimizer
    skip = {id(inner.iterations), id(inner._learning_rate)}
    return [
        keras.backend.standardize_dtype(v.dtype)
        for v in inner.variables
        if id(v) not in skip
    ]


@pytest.mark.parametrize(
    "weight_dtype, state_dtype, slot_dtype, bytes_per_parameter",
    [
        # Adam: two moments; Kahan adds a compensation per bfloat16 weight.
        ("float32", "bfloat16", "bfloat16", 4),
        ("bfloat16", None, "bfloat16", 6),
        # A third fit, slow for the default run.
        pytest.param("bfloat16", "float32", "float32", 10, marks=SLOW),
    ],
)
def test_state_dtype(
    weight_dtype, state_dtype, slot_dtype, bytes_per_parameter
):
    model = small_model(weight_dtype)
    optimizer = LowPrecisionOptimizer(
        keras.optimizers.Adam(0.01), state_dtype=state_dtype, seed=0
    )
    model.compile(optimizer, "mse")
    x, y = regression_data()
    losses = model.fit(x, y, batch_size=16, epochs=4, verbose=0).history["loss"]
    assert losses[-1] < losses[0]
    assert set(slot_dtypes(optimizer)) == {slot_dtype}
    for weight in model.weights:
        assert keras.backend.standardize_dtype(weight.dtype) == weight_dtype
    parameters = sum(int(np.prod(w.shape)) for w in model.weights)
    seed_state = getattr(optimizer.seed_generator, "state", None)
    state = [
        v
        for v in optimizer.variables
        if tuple(v.shape) != () and v is not seed_state
    ]
    counted = sum(
        int(np.prod(v.shape)) * BYTES[keras.backend.standardize_dtype(v.dtype)]
        for v in state
    )
    assert counted == bytes_per_parameter * parameters


BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# Saving and resuming.


def trained_model(optimizer_factory, policy="bfloat16", epochs=1):
    keras.utils.set_random_seed(0)
    with keras_dtype_policy.policy_scope(policy):
        model = small_model(None)
    model.compile(optimizer_factory(), "mse")
    x, y = regression_data()
    model.fit(x, y, batch_size=16, epochs=epochs, verbose=0, shuffle=False)
    return model


def more_training(model):
    x, y = regression_data(seed=1)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    return [as_float32(v) for v in model.weights + model.optimizer.variables]


SAVED_SETUPS = {
    "kahan": (
        "bfloat16",
        lambda: LowPrecisionOptimizer(keras.optimizers.Adam(0.01)),
    ),
    "stochastic": (
        "bfloat16",
        lambda: LowPrecisionOptimizer(
            keras.optimizers.Adam(0.01),
            update="stochastic_rounding",
            seed=5,
        ),
    ),
    "policy": ("stochastic_bfloat16", lambda: keras.optimizers.Adam(0.01)),
}


# Each case trains, saves, loads and trains on (several seconds): one runs
# by default, the other five (same code paths, other pairings) only in full
# runs.
@pytest.mark.parametrize(
    "setup, file_format",
    [
        ("policy", ".keras"),
        pytest.param("stochastic", ".weights.h5", marks=SLOW),
        pytest.param("kahan", ".keras", marks=SLOW),
        pytest.param("stochastic", ".keras", marks=SLOW),
        pytest.param("kahan", ".weights.h5", marks=SLOW),
        pytest.param("policy", ".weights.h5", marks=SLOW),
    ],
)
def test_resume_is_bit_exact(setup, file_format, tmp_path):
    policy, factory = SAVED_SETUPS[setup]
    model = trained_model(factory, policy)
    path = str(tmp_path / f"model{file_format}")
    if file_format == ".keras":
        model.save(path)
        restored = keras.saving.load_model(path)
    else:
        model.save_weights(path)
        restored = trained_model(factory, policy, epochs=0)
        restored.optimizer.build(restored.trainable_variables)
        restored.load_weights(path)
    assert type(restored.optimizer) is type(model.optimizer)
    saved = [as_float32(v) for v in model.optimizer.variables]
    loaded = [as_float32(v) for v in restored.optimizer.variables]
    assert len(saved) == len(loaded)
    for a, b in zip(saved, loaded, strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(more_training(model), more_training(restored), strict=True):
        np.testing.assert_array_equal(a, b)


# Arguments and configs.


def test_config_round_trip():
    optimizer = LowPrecisionOptimizer(
        keras.optimizers.AdamW(0.003, weight_decay=0.01),
        update="stochastic_rounding",
        state_dtype="bfloat16",
        seed=4,
        name="low",
    )
    revived = assert_serialization_round_trip(optimizer)
    assert revived.update == "stochastic_rounding"
    assert revived.state_dtype == "bfloat16"
    assert revived.seed == 4
    assert isinstance(revived.inner_optimizer, keras.optimizers.AdamW)
    assert revived.inner_optimizer.weight_decay == 0.01
    assert LowPrecisionOptimizer(keras.optimizers.SGD()).update == "kahan"
    assert keras_dtype_policy.LowPrecisionOptimizer is LowPrecisionOptimizer


@pytest.mark.parametrize(
    "kwargs, error, fragment",
    [
        ({"update": "round"}, ValueError, "Received: update='round'"),
        ({"update": 1}, TypeError, "Received: update=1 (of type int)"),
        ({"state_dtype": "int8"}, ValueError, "Received: state_dtype='int8'"),
        (
            {"state_dtype": 3},
            TypeError,
            "Received: state_dtype=3 (of type int)",
        ),
        ({"seed": 1.5}, TypeError, "Received: seed=1.5 (of type float)"),
        ({"seed": True}, TypeError, "Received: seed=True"),
    ],
)
def test_bad_arguments(kwargs, error, fragment):
    with pytest.raises(
        error, match=fragment.replace("(", r"\(").replace(")", r"\)")
    ):
        LowPrecisionOptimizer(keras.optimizers.Adam(), **kwargs)


def test_bad_inner_optimizers():
    with pytest.raises(TypeError, match="Received: inner_optimizer='adam'"):
        LowPrecisionOptimizer("adam")
    with pytest.raises(TypeError, match="inside a LossScaleOptimizer"):
        LowPrecisionOptimizer(LossScaleOptimizer(keras.optimizers.Adam()))
    with pytest.raises(ValueError, match="use_ema"):
        LowPrecisionOptimizer(keras.optimizers.Adam(use_ema=True))
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2"):
        LowPrecisionOptimizer(
            keras.optimizers.Adam(gradient_accumulation_steps=2)
        )


# The compile hook and the policy names.


@pytest.mark.parametrize(
    "policy, update",
    [
        ("kahan_bfloat16", "kahan"),
        ("stochastic_bfloat16", "stochastic_rounding"),
    ],
)
def test_policy_names_wrap_the_optimizer(policy, update):
    keras_dtype_policy.set_dtype_policy(policy)
    assert keras.config.dtype_policy().compute_dtype == "bfloat16"
    assert keras.config.dtype_policy().variable_dtype == "bfloat16"
    model = small_model(None)
    adam = keras.optimizers.Adam()
    model.compile(adam, "mse")
    assert isinstance(model.optimizer, LowPrecisionOptimizer)
    assert model.optimizer.inner_optimizer is adam
    assert model.optimizer.update == update
    assert model.optimizer.state_dtype is None


@pytest.mark.filterwarnings("ignore::keras_dtype_policy.SlowFloat16Warning")
def test_layer_dtype_names_and_scope():
    layer = keras.layers.Dense(4, dtype="kahan_bfloat16")
    assert layer.dtype_policy.name == "kahan_bfloat16"
    assert layer.compute_dtype == "bfloat16"
    assert layer.variable_dtype == "bfloat16"
    with keras_dtype_policy.policy_scope("stochastic_float16"):
        assert keras.layers.Dense(4).variable_dtype == "float16"
    model = keras.Sequential([keras.Input((3,)), layer])
    model.compile("sgd", "mse")
    assert isinstance(model.optimizer, LowPrecisionOptimizer)


def test_plain_bfloat16_is_left_as_keras_trains_it():
    keras_dtype_policy.set_dtype_policy("bfloat16")
    model = small_model(None)
    adam = keras.optimizers.Adam()
    model.compile(adam, "mse")
    assert model.optimizer is adam


@pytest.mark.filterwarnings("ignore::keras_dtype_policy.SlowFloat16Warning")
@pytest.mark.parametrize(
    "policy",
    # The second fit differs only in the update: slow for the default run.
    ["kahan_float16", pytest.param("stochastic_float16", marks=SLOW)],
)
def test_float16_policies_get_loss_scaling_outside(policy):
    keras_dtype_policy.set_dtype_policy(policy)
    model = small_model(None)
    adam = keras.optimizers.Adam(0.01)
    model.compile(adam, "mse")
    assert isinstance(model.optimizer, LossScaleOptimizer)
    inner = model.optimizer.inner_optimizer
    assert isinstance(inner, LowPrecisionOptimizer)
    assert inner.inner_optimizer is adam
    assert inner.state_dtype == "float32"
    x, y = regression_data()
    losses = model.fit(x, y, batch_size=16, epochs=3, verbose=0).history["loss"]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert set(slot_dtypes(inner)) == {"float32"}


def test_explicit_wrapper_under_float16_gets_loss_scaling_outside():
    model = small_model("float16")
    model.compile(LowPrecisionOptimizer(keras.optimizers.SGD(0.01)), "mse")
    assert isinstance(model.optimizer, LossScaleOptimizer)
    assert isinstance(model.optimizer.inner_optimizer, LowPrecisionOptimizer)


KERAS_ALONE_READER = """
import json, sys, warnings
import keras
import numpy as np

folder = sys.argv[1]
model = keras.Sequential(
    [
        keras.Input((8,)),
        keras.layers.Dense(16, activation="tanh", dtype="bfloat16"),
        keras.layers.Dense(1, dtype="bfloat16"),
    ]
)
model.compile(keras.optimizers.Adam(0.01), "mse")
model.optimizer.build(model.trainable_variables)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model.load_weights(folder + "/model.weights.h5")
np.savez(
    folder + "/alone.npz",
    *[keras.ops.convert_to_numpy(keras.ops.cast(w, "float32"))
      for w in model.weights],
)
try:
    keras.saving.load_model(folder + "/model.keras")
    keras_file = "loaded"
except Exception as error:
    keras_file = type(error).__name__ + ": " + str(error)[:200]
assert "keras_dtype_policy" not in sys.modules
print(json.dumps({
    "warnings": [str(w.message) for w in caught],
    "keras_file": keras_file,
}))
"""


# A Keras process of its own, a few seconds more on each backend.
@SLOW
def test_what_keras_alone_reads(tmp_path):
    import json
    import os
    import subprocess
    import sys

    model = trained_model(SAVED_SETUPS["kahan"][1])
    model.save_weights(str(tmp_path / "model.weights.h5"))
    model.save(str(tmp_path / "model.keras"))
    result = subprocess.run(
        [sys.executable, "-c", KERAS_ALONE_READER, str(tmp_path)],
        capture_output=True,
        text=True,
        env=dict(os.environ, KERAS_BACKEND=BACKEND),
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    # The weights come back bit for bit; the optimizer state (compensation
    # buffers, the wrapper's own variables) is skipped with Keras' warning.
    loaded = np.load(tmp_path / "alone.npz")
    for i, weight in enumerate(model.weights):
        np.testing.assert_array_equal(loaded[f"arr_{i}"], as_float32(weight))
    assert any("Skipping variable loading" in w for w in report["warnings"])
    # The .keras file names this package's optimizer: Keras alone cannot
    # rebuild it.
    assert "LowPrecisionOptimizer" in report["keras_file"]
