"""A large variable's update with 8-bit state, a chunk at a time.

On JAX inside `jit` (`fit`), `chunked_updates` runs the update of a
variable above `CHUNKED_ABOVE` elements in loops over chunks; the
results must be those of the whole update (bit for bit where XLA
compiles the arithmetic the same way, float32 rounding for Adadelta), and
the step's temporaries must stop growing with the variable's state.
Elsewhere (TensorFlow, PyTorch, eager JAX) the update runs
whole: the tests say so per backend. The thresholds are made small here
(chunks of 1024 elements) so that a 4,899-element kernel takes four
chunks and a tail of 803 elements that ends in a padded block.
"""

import keras
import numpy as np
import pytest

import keras_dtype_policy as kdp
from keras_dtype_policy.low_precision import chunked_updates

JAX = keras.backend.backend() == "jax"
# Exact: the loop body's arithmetic compiles as the whole update's.
EXACT = {
    "adam": lambda: keras.optimizers.Adam(1e-2),
    "adamw": lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.1),
    "lion": lambda: keras.optimizers.Lion(1e-3),
    "sgd_momentum": lambda: keras.optimizers.SGD(1e-2, momentum=0.9),
    "nadam": lambda: keras.optimizers.Nadam(1e-2),
    "adamax": lambda: keras.optimizers.Adamax(1e-2),
    "rmsprop": lambda: keras.optimizers.RMSprop(1e-3),
    "adagrad": lambda: keras.optimizers.Adagrad(1e-2),
}
# The other optimizers run in `tox -e full-jax` (marked slow).
DEFAULT_RUNS = ("adam", "adamw")
SETTINGS = {
    "stochastic": ("bfloat16", "stochastic_rounding", "8bit"),
    "kahan": ("bfloat16", "kahan", "8bit"),
    "float32_weights": ("float32", "nearest", "8bit"),
    "stochastic_4bit": ("bfloat16", "stochastic_rounding", "4bit"),
    "kahan_4bit": ("bfloat16", "kahan", "4bit"),
}


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 1024 elements above 2048, and a count of chunked
    updates traced."""
    monkeypatch.setattr(chunked_updates, "CHUNK_ELEMENTS", 1024)
    monkeypatch.setattr(chunked_updates, "CHUNKED_ABOVE", 2048)
    traced = []
    whole_update = chunked_updates.update

    def counted(*args, **kwargs):
        traced.append(args[1][0].weight.path)
        return whole_update(*args, **kwargs)

    monkeypatch.setattr(chunked_updates, "update", counted)
    return traced


def train(make_optimizer, policy, update, state_dtype="8bit", epochs=1):
    """Trains a 71-69-1 Dense model 4 steps; returns the model and the
    wrapper."""
    keras.utils.clear_session()
    keras.utils.set_random_seed(1)
    with kdp.policy_scope(policy):
        model = keras.Sequential(
            [
                keras.Input((71,)),
                keras.layers.Dense(69),
                keras.layers.Dense(1),
            ]
        )
    optimizer = kdp.LowPrecisionOptimizer(
        make_optimizer(), update=update, state_dtype=state_dtype, seed=3
    )
    model.compile(optimizer=optimizer, loss="mean_squared_error")
    rng = np.random.RandomState(0)
    x = rng.randn(64, 71).astype("float32")
    y = rng.randn(64, 1).astype("float32")
    model.fit(x, y, batch_size=16, epochs=epochs, verbose=0, shuffle=False)
    return model, optimizer


def values(model, optimizer):
    """Every weight and optimizer variable (codes, scales, the seed)."""
    return [
        np.asarray(v.numpy(), "float64")
        for v in model.weights + optimizer.variables
    ]


def whole_and_chunked(
    monkeypatch, traced, make_optimizer, policy, update, state_dtype="8bit"
):
    """The values after the whole updates and after chunked ones."""
    monkeypatch.setattr(chunked_updates, "CHUNKED_ABOVE", 2**40)
    whole = values(*train(make_optimizer, policy, update, state_dtype))
    assert not traced
    monkeypatch.setattr(chunked_updates, "CHUNKED_ABOVE", 2048)
    chunked = values(*train(make_optimizer, policy, update, state_dtype))
    assert traced == ["sequential/dense/kernel"]
    return whole, chunked


def optimizer_cases():
    for name in EXACT:
        for setting in SETTINGS:
            marks = () if name in DEFAULT_RUNS else (pytest.mark.slow,)
            yield pytest.param(
                name, setting, id=f"{name}-{setting}", marks=marks
            )


@pytest.mark.skipif(not JAX, reason="chunked updates run on JAX only")
@pytest.mark.parametrize("name, setting", optimizer_cases())
def test_chunked_update_equals_the_whole_one(
    monkeypatch, small_chunks, name, setting
):
    policy, update, state_dtype = SETTINGS[setting]
    whole, chunked = whole_and_chunked(
        monkeypatch, small_chunks, EXACT[name], policy, update, state_dtype
    )
    assert len(whole) == len(chunked)
    for before, after in zip(whole, chunked, strict=True):
        np.testing.assert_array_equal(after, before)


@pytest.mark.skipif(not JAX, reason="chunked updates run on JAX only")
def test_adadelta_chunked_differs_by_float32_rounding(
    monkeypatch, small_chunks
):
    whole, chunked = whole_and_chunked(
        monkeypatch,
        small_chunks,
        lambda: keras.optimizers.Adadelta(1.0),
        "float32",
        "nearest",
    )
    kernel_whole, kernel_chunked = whole[0], chunked[0]
    scale = np.max(np.abs(kernel_whole))
    np.testing.assert_allclose(
        kernel_chunked, kernel_whole, rtol=0, atol=1e-6 * scale
    )


@pytest.mark.skipif(not JAX, reason="chunked updates run on JAX only")
def test_chunked_training_resumes_exactly(small_chunks, tmp_path):
    straight, optimizer = train(
        EXACT["adam"], "bfloat16", "stochastic_rounding", epochs=2
    )
    expected = values(straight, optimizer)
    first, _ = train(EXACT["adam"], "bfloat16", "stochastic_rounding")
    path = tmp_path / "chunked.keras"
    first.save(path)
    resumed = keras.saving.load_model(path)
    rng = np.random.RandomState(0)
    x = rng.randn(64, 71).astype("float32")
    y = rng.randn(64, 1).astype("float32")
    resumed.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    assert small_chunks
    got = values(resumed, resumed.optimizer)
    for before, after in zip(expected, got, strict=True):
        np.testing.assert_array_equal(after, before)


@pytest.mark.parametrize(
    "optimizer, state_dtype",
    [("adam", "8bit"), ("adam", "4bit"), ("ftrl", "8bit")],
)
def test_where_updates_run_whole(small_chunks, optimizer, state_dtype):
    """Chunks on JAX only: TensorFlow's loop ran slower than its whole
    update (chunked_updates' docstring) and PyTorch has its own step;
    Ftrl's slots read the weight. The update runs whole there."""
    make = EXACT["adam"]
    if optimizer == "ftrl":
        make = lambda: keras.optimizers.Ftrl(1e-2)  # noqa: E731
    train(make, "bfloat16", "stochastic_rounding", state_dtype=state_dtype)
    assert bool(small_chunks) == (JAX and optimizer == "adam")


@pytest.mark.skipif(not JAX, reason="chunked updates run on JAX only")
def test_eager_apply_runs_whole(small_chunks):
    optimizer = kdp.LowPrecisionOptimizer(
        keras.optimizers.Adam(1e-2), "stochastic_rounding", "8bit", seed=0
    )
    weight = keras.Variable(np.ones((71, 69)), dtype="bfloat16")
    optimizer.apply([keras.ops.ones((71, 69), "bfloat16")], [weight])
    assert not small_chunks
    assert np.all(np.isfinite(np.asarray(weight.numpy(), "float32")))


@pytest.mark.skipif(not JAX, reason="chunked updates run on JAX only")
def test_only_a_dominant_variable_is_chunked(small_chunks):
    """Two kernels of 4,899 and 4,761 elements: neither has twice the
    other's, and each chunked update's loop keeps a copy of its variable
    to the end of the step, so both run whole."""
    keras.utils.clear_session()
    with kdp.policy_scope("bfloat16"):
        model = keras.Sequential(
            [
                keras.Input((71,)),
                keras.layers.Dense(69),
                keras.layers.Dense(69),
            ]
        )
    model.compile(
        optimizer=kdp.LowPrecisionOptimizer(
            keras.optimizers.Adam(1e-3), "stochastic_rounding", "8bit"
        ),
        loss="mean_squared_error",
    )
    x = np.ones((16, 71), "float32")
    model.fit(x, np.ones((16, 69), "float32"), verbose=0)
    assert not small_chunks


@pytest.mark.skipif(not JAX, reason="chunked updates run on JAX only")
@pytest.mark.parametrize(
    "policy", ["kahan_float16_8bit", "stochastic_float16_4bit"]
)
def test_loss_scaled_chunked_update_equals_the_whole_one(
    monkeypatch, small_chunks, policy
):
    """float16 weights under the compile hook's `LossScaleOptimizer`,
    one batch of non-finite gradients skipped: the same weights, state
    and loss scale bit for bit, all finite."""

    def trained():
        keras.utils.clear_session()
        keras.utils.set_random_seed(1)
        with kdp.policy_scope(policy):
            model = keras.Sequential(
                [
                    keras.Input((71,)),
                    keras.layers.Dense(69),
                    keras.layers.Dense(1),
                ]
            )
        model.compile(
            optimizer=keras.optimizers.Adam(1e-2), loss="mean_squared_error"
        )
        rng = np.random.RandomState(0)
        x = rng.randn(64, 71).astype("float32")
        x[20] = np.inf
        y = rng.randn(64, 1).astype("float32")
        model.fit(x, y, batch_size=16, verbose=0, shuffle=False)
        return values(model, model.optimizer)

    monkeypatch.setattr(chunked_updates, "CHUNKED_ABOVE", 2**40)
    whole = trained()
    assert not small_chunks
    monkeypatch.setattr(chunked_updates, "CHUNKED_ABOVE", 2048)
    chunked = trained()
    assert small_chunks
    for before, after in zip(whole, chunked, strict=True):
        np.testing.assert_array_equal(after, before)
    assert all(np.all(np.isfinite(value)) for value in chunked[:4])
