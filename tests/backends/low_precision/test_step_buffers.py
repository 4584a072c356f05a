"""The working set of the compiled JAX step, from XLA's buffer assignment.

`fit` on JAX runs `jax.jit(train_step)` with the state donated. XLA says,
before anything runs, how many bytes the step's arguments, its outputs'
reuse of them and its temporaries take. Growing the model by a number of
parameters must grow the temporaries by no more than the gradients
(bfloat16 weights: 2 bytes a parameter), and every byte of weights and
state must be reused in place (no second copy of the state). Benchmark 15
(tests/benchmarks/step_buffers.py) reports the same figures for every
configuration; the other backends do not compile the step to one XLA
computation (TensorFlow's `fit` is a graph unless jit_compile=True,
PyTorch runs eagerly), so they are measured by benchmark 12 instead.
"""

import keras
import numpy as np
import pytest

import keras_dtype_policy as kdp

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax",
    reason="XLA's buffer assignment of Keras' compiled step: the JAX "
    "backend's (benchmark 12 measures the others' peaks)",
)

WIDTH = 512
GRADIENT_BYTES = 2  # bfloat16 weights, bfloat16 gradients
# Block scales, codes' tables and rounding: a sliver a parameter.
SLACK = 0.25
QUANTIZED = {
    "stochastic_8bit": (
        "stochastic_bfloat16",
        {"update": "stochastic_rounding", "state_dtype": "8bit", "seed": 0},
    ),
    "stochastic_4bit": (
        "stochastic_bfloat16",
        {"update": "stochastic_rounding", "state_dtype": "4bit", "seed": 0},
    ),
    "kahan_8bit": (
        "kahan_bfloat16",
        {"update": "kahan", "state_dtype": "8bit"},
    ),
    "mixed_8bit": (
        "mixed_bfloat16",
        {"update": "stochastic_rounding", "state_dtype": "8bit", "seed": 0},
    ),
}


def step_bytes(policy, arguments, depth, adam=None):
    """(parameters, XLA's memory analysis) of the step `fit` compiles."""
    with kdp.policy_scope(policy):
        model = keras.Sequential(
            [keras.Input((WIDTH,))]
            + [keras.layers.Dense(WIDTH) for _ in range(depth)]
        )
    optimizer = keras.optimizers.Adam(1e-4, **(adam or {}))
    if arguments is not None:
        optimizer = kdp.LowPrecisionOptimizer(optimizer, **arguments)
    model.compile(optimizer=optimizer, loss="mean_squared_error")
    batch = np.ones((8, WIDTH), "float32")
    return model.count_params(), compiled_memory(model, batch, batch)


def compiled_memory(model, x, y):
    """XLA's memory analysis of the step `fit` compiles for `model`
    (compiled, trained one step on `(x, y)` to build its optimizer)."""
    import jax

    model.train_on_batch(x, y)
    state = model._get_jax_state(
        trainable_variables=True,
        non_trainable_variables=True,
        optimizer_variables=True,
        metrics_variables=True,
    )
    step = jax.jit(model.train_step, donate_argnums=0)
    return step.lower(state, (x, y)).compile().memory_analysis()


def bytes_a_parameter(policy, arguments, adam=None, depths=(2, 4)):
    """XLA's argument, aliased and temporary bytes a parameter added
    between two depths."""
    small_count, small = step_bytes(policy, arguments, depths[0], adam)
    large_count, large = step_bytes(policy, arguments, depths[1], adam)
    added = large_count - small_count
    return {
        "arguments": (
            large.argument_size_in_bytes - small.argument_size_in_bytes
        )
        / added,
        "aliased": (large.alias_size_in_bytes - small.alias_size_in_bytes)
        / added,
        "temporaries": (large.temp_size_in_bytes - small.temp_size_in_bytes)
        / added,
    }


# Two compiles each (about 7 s): the stochastic 8- and 4-bit rows in the
# default runs, the others in `tox -e full-jax`.
@pytest.mark.parametrize(
    "name",
    [
        "stochastic_8bit",
        "stochastic_4bit",
        pytest.param("kahan_8bit", marks=pytest.mark.slow),
        pytest.param("mixed_8bit", marks=pytest.mark.slow),
    ],
)
def test_quantized_state_step_holds_only_the_gradients(name):
    policy, arguments = QUANTIZED[name]
    measured = bytes_a_parameter(policy, arguments)
    # Every byte of weights and state is updated in place.
    assert measured["aliased"] == pytest.approx(measured["arguments"])
    assert measured["temporaries"] <= GRADIENT_BYTES + SLACK, measured


@pytest.mark.parametrize(
    "policy",
    [
        "stochastic_bfloat16",
        pytest.param("kahan_bfloat16", marks=pytest.mark.slow),
    ],
)
def test_bfloat16_state_step_holds_no_more_than_keras_own(policy):
    # Keras' own bfloat16 policy with its Adam: XLA on a CPU computes a
    # bfloat16 matrix product in float32 and keeps each weight's float32
    # copy for the backward pass (4 bytes a parameter). The package's
    # update adds nothing to that working set.
    keras_own = bytes_a_parameter("bfloat16", None)
    measured = bytes_a_parameter(policy, None)
    assert measured["aliased"] == pytest.approx(measured["arguments"])
    assert measured["temporaries"] <= keras_own["temporaries"] + SLACK, (
        measured,
        keras_own,
    )


FLOAT32_GRADIENT_BYTES = 4


def test_jax_step_frees_each_gradient_after_its_update():
    # release_gradients=True on JAX: XLA's schedule of the compiled step
    # runs each variable's update once its gradient exists and frees it,
    # so adding layers adds less than their gradients to the
    # temporaries. Float32 weights, so that no float32 copy of a
    # bfloat16 weight (above) enters the measure. From four layers on
    # the temporaries stop growing (a few layers' working set; 512 wide:
    # 9.5 MiB at 4 layers, 10.6 at 8), where holding every gradient adds
    # 12 bytes a parameter.
    arguments = {
        "update": "stochastic_rounding",
        "state_dtype": "8bit",
        "seed": 0,
        "release_gradients": True,
    }
    released = bytes_a_parameter("float32", arguments, depths=(4, 8))
    assert released["temporaries"] < FLOAT32_GRADIENT_BYTES / 2, released
    # The measure sees gradients held: `global_clipnorm` needs all of
    # them before any update (and is refused with release_gradients).
    arguments["release_gradients"] = False
    clipped = bytes_a_parameter(
        "float32", arguments, adam={"global_clipnorm": 1.0}, depths=(4, 8)
    )
    assert clipped["temporaries"] >= FLOAT32_GRADIENT_BYTES, clipped


def embedding_step_temporaries(policy, arguments, rows):
    """XLA's temporary bytes of the step over one 256-wide embedding."""
    keras.utils.clear_session()
    with kdp.policy_scope(policy):
        tokens = keras.Input((1,), dtype="int32")
        rows_out = keras.layers.Embedding(rows, 256)(tokens)
        outputs = keras.layers.Dense(1)(keras.layers.Flatten()(rows_out))
        model = keras.Model(tokens, outputs)
    optimizer = kdp.LowPrecisionOptimizer(
        keras.optimizers.Adam(1e-4), **arguments
    )
    model.compile(optimizer=optimizer, loss="mean_squared_error")
    x = (np.arange(8) * 997 % rows).reshape(8, 1).astype("int32")
    y = np.ones((8, 1), "float32")
    return compiled_memory(model, x, y).temp_size_in_bytes


# The chunked update's temporaries an element: the float32 gradient's 4
# and the copy of the weight (2) and codes that its loops keep.
CHUNKED_TEMPORARIES = {
    "stochastic_8bit": 4 + 2 + 2,
    "stochastic_4bit": 4 + 2 + 1,
}


@pytest.mark.parametrize("name", sorted(CHUNKED_TEMPORARIES))
def test_one_large_variable_is_updated_a_chunk_at_a_time(monkeypatch, name):
    """An embedding of 4.2M and 16.8M elements with coded state: the
    whole update's temporaries grow by 14 (8-bit) or 13 (4-bit) bytes an
    element, the chunked update's (`chunked_updates`) by 8 or 7."""
    from keras_dtype_policy.low_precision import chunked_updates

    policy, arguments = QUANTIZED[name]
    added = (65536 - 16384) * 256

    def growth():
        small = embedding_step_temporaries(policy, arguments, 16384)
        large = embedding_step_temporaries(policy, arguments, 65536)
        return (large - small) / added

    chunked = growth()
    monkeypatch.setattr(chunked_updates, "CHUNKED_ABOVE", 2**40)
    whole = growth()
    assert chunked <= CHUNKED_TEMPORARIES[name] + SLACK
    assert whole >= chunked + 4
