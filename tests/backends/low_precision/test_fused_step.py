"""The fused low-precision step: the same results as the general path.

`LowPrecisionOptimizer` runs its step as one XLA computation on
TensorFlow (`tensorflow_step`) and as batched `torch._foreach` updates on
torch (`torch_step`); on JAX, `fit` compiles the whole step already. Each
fused path must give what the general path (the inner optimizer's
`update_step`, one variable at a time) gives: checked here with no
randomness (Kahan updates, float32 state), where both paths are the same
float32 arithmetic in another order (a last-place difference can flip the
rounding of a bfloat16 Kahan compensation, up to 2**-16 of the weight:
hence a relative tolerance of 1e-4).
"""

import functools

import keras
import numpy as np
import pytest
from testing import BACKEND
from testing import inner_optimizers
from testing import to_numpy

from keras_dtype_policy import LowPrecisionOptimizer
from keras_dtype_policy import backend_dispatch
from keras_dtype_policy.low_precision import compensated_updates

# Import TensorFlow or torch: only where Keras runs on it.
tensorflow_step = None
if backend_dispatch.is_tensorflow():
    tensorflow_step = backend_dispatch.module_for("low_precision_step")
torch_step = None
if backend_dispatch.is_torch():
    torch_step = backend_dispatch.module_for("low_precision_step")

SHAPES = [(17, 9), (9,), (3, 4, 5), ()]
# Rows of the shared table (at the rates these cases were written for),
# and an Adam with its gradients clipped.
OPTIMIZERS = {
    **inner_optimizers(
        "adam",
        "adam_amsgrad",
        "adamw",
        "sgd_momentum",
        "sgd_nesterov",
        "rmsprop_momentum",
        "adagrad",
        "adadelta",
        "adamax",
        "lion",
        "nadam",
        learning_rates={
            "sgd_momentum": 1e-2,
            "sgd_nesterov": 1e-2,
            "adagrad": 1e-2,
            "adamax": 1e-2,
            "lion": 1e-3,
        },
    ),
    "clipped_adam": lambda: keras.optimizers.Adam(1e-2, global_clipnorm=0.5),
}


def as_float32(x):
    return np.asarray(to_numpy(keras.ops.cast(x, "float32")))


def train(make_inner, fused, monkeypatch, state_dtype="float32", steps=6):
    with monkeypatch.context() as patch:
        if tensorflow_step is not None:
            # Eight variables: one computation unless a test groups them.
            limit = max(tensorflow_step.XLA_GROUP_VARIABLES, len(SHAPES) * 2)
            patch.setattr(tensorflow_step, "XLA_GROUP_VARIABLES", limit)
        if not fused:
            if torch_step is not None:
                patch.setattr(torch_step, "can_batch", lambda wrapper: False)
            if tensorflow_step is not None:
                patch.setattr(tensorflow_step, "can_compile", lambda o: False)
        rng = np.random.default_rng(0)
        weights = [
            keras.Variable(rng.normal(size=s).astype("float32"), dtype=d)
            for s in SHAPES
            for d in ("bfloat16", "float32")
        ]
        optimizer = LowPrecisionOptimizer(
            make_inner(), update="kahan", state_dtype=state_dtype
        )
        for _ in range(steps):
            grads = [
                keras.ops.convert_to_tensor(
                    rng.normal(size=w.shape).astype("float32"), w.dtype
                )
                for w in weights
            ]
            optimizer.apply(grads, weights)
    values = []
    for weight in weights:
        compensation = optimizer.compensation_of(weight)
        if compensation is None:
            values.append(as_float32(weight))
        else:
            values.append(
                as_float32(compensated_updates.kahan_read(weight, compensation))
            )
    return values, optimizer


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fused_step_equals_the_general_path(name, monkeypatch):
    fused, _ = train(OPTIMIZERS[name], True, monkeypatch)
    general, _ = train(OPTIMIZERS[name], False, monkeypatch)
    for a, b in zip(fused, general, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_fused_step_with_bfloat16_state_stays_close(monkeypatch):
    # Stochastic rounding of the state draws other bits on each path:
    # the results agree to the state's precision, not bit for bit.
    fused, _ = train(OPTIMIZERS["adam"], True, monkeypatch, "bfloat16")
    general, _ = train(OPTIMIZERS["adam"], False, monkeypatch, "bfloat16")
    for a, b in zip(fused, general, strict=True):
        np.testing.assert_allclose(a, b, rtol=0.05, atol=0.02)


@pytest.mark.skipif(BACKEND != "torch", reason="torch's batched path")
def test_torch_batches_keras_own_optimizers_only(monkeypatch):
    _, adam = train(OPTIMIZERS["adam"], True, monkeypatch, steps=1)
    _, nadam = train(OPTIMIZERS["nadam"], True, monkeypatch, steps=1)

    class MyAdam(keras.optimizers.Adam):
        pass

    _, mine = train(lambda: MyAdam(1e-2), True, monkeypatch, steps=1)
    assert torch_step.can_batch(adam)
    # Nadam's step updates a product shared by all variables; a subclass
    # may change the update: both take the general path.
    assert not torch_step.can_batch(nadam)
    assert not torch_step.can_batch(mine)


@pytest.mark.skipif(BACKEND != "torch", reason="torch's batched path")
def test_torch_groups_bound_the_float32_working_set(monkeypatch):
    # Groups of at most a few elements give what one group gives.
    whole, _ = train(OPTIMIZERS["adam"], True, monkeypatch)
    monkeypatch.setattr(torch_step, "TORCH_GROUP_ELEMENTS", 10)
    grouped, _ = train(OPTIMIZERS["adam"], True, monkeypatch)
    for a, b in zip(whole, grouped, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's XLA step")
def test_tensorflow_compiles_the_step_once(monkeypatch):
    _, optimizer = train(OPTIMIZERS["adam"], True, monkeypatch)
    assert tensorflow_step.can_compile(optimizer)
    steps = optimizer._step_cache.steps
    assert len(steps) == 1
    (step,) = steps.values()
    assert step.experimental_get_tracing_count() == 1


# Each optimizer with one state dtype in the default runs, each state dtype
# with two optimizers; the other four pairs in `tox -e full-tensorflow`.
GROUPED_IN_DEFAULT_RUNS = {
    ("adam", "8bit"),
    ("clipped_adam", "float32"),
    ("nadam", "8bit"),
    ("adamw", "float32"),
}


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's XLA step")
@pytest.mark.parametrize(
    ("name", "state_dtype"),
    [
        pytest.param(
            name,
            state_dtype,
            marks=[]
            if (name, state_dtype) in GROUPED_IN_DEFAULT_RUNS
            else [pytest.mark.slow],
            id=f"{state_dtype}-{name}",
        )
        for name in ("adam", "clipped_adam", "nadam", "adamw")
        for state_dtype in ("float32", "8bit")
    ],
)
def test_tensorflow_updates_a_large_model_group_by_group(
    name, state_dtype, monkeypatch
):
    # Above XLA_GROUP_ELEMENTS the step compiles one computation a group of
    # variables (XLA holds a computation's temporaries to its end), after
    # what needs every gradient (the global norm's clipping, Nadam's
    # product) ran once: the same results as one computation.
    whole, one = train(OPTIMIZERS[name], True, monkeypatch, state_dtype)
    monkeypatch.setattr(tensorflow_step, "XLA_GROUP_ELEMENTS", 100)
    monkeypatch.setattr(tensorflow_step, "XLA_GROUP_VARIABLES", 10**9)
    grouped, optimizer = train(OPTIMIZERS[name], True, monkeypatch, state_dtype)
    for a, b in zip(whole, grouped, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert not one._step_cache.groups
    assert not optimizer._step_cache.steps
    groups = optimizer._step_cache.groups
    # Each (17, 9) weight alone, then 9 + 9 + 60 and 60 + 1 + 1 elements.
    assert len(groups) == 4
    for _, step in groups.values():
        if isinstance(step, tensorflow_step.BoundGroupStep):
            step = step.shared.function
        assert step.experimental_get_tracing_count() == 1
    assert int(optimizer.iterations.numpy()) == 6


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's XLA step")
def test_tensorflow_groups_take_an_embedding_gradient(monkeypatch):
    # An embedding's gradient is a tf.IndexedSlices; clipped and divided
    # by a fixed loss scale before the groups, as in one computation.
    import tensorflow as tf

    monkeypatch.setattr(tensorflow_step, "XLA_GROUP_ELEMENTS", 100)
    monkeypatch.setattr(tensorflow_step, "XLA_GROUP_VARIABLES", 10**9)
    results = []
    for grouped in (False, True):
        if grouped:
            monkeypatch.setattr(tensorflow_step, "XLA_GROUP_ELEMENTS", 100)
            monkeypatch.setattr(tensorflow_step, "XLA_GROUP_VARIABLES", 10**9)
        else:
            monkeypatch.setattr(tensorflow_step, "XLA_GROUP_ELEMENTS", 10**9)
            monkeypatch.setattr(tensorflow_step, "XLA_GROUP_VARIABLES", 10**9)
        table = keras.Variable(np.ones((40, 8), "float32"), dtype="bfloat16")
        bias = keras.Variable(np.zeros((8,), "float32"))
        optimizer = LowPrecisionOptimizer(
            keras.optimizers.Adam(1e-2, clipnorm=1.0, loss_scale_factor=4.0),
            update="nearest",
            state_dtype="8bit",
        )
        sparse = tf.IndexedSlices(
            tf.ones((3, 8), "bfloat16") * 4.0,
            tf.constant([1, 5, 7]),
            tf.constant([40, 8]),
        )
        for _ in range(2):
            optimizer.apply([sparse, tf.ones((8,)) * 4.0], [table, bias])
        assert bool(optimizer._step_cache.groups) == grouped
        results.append([as_float32(table), as_float32(bias)])
    for a, b in zip(*results, strict=True):
        np.testing.assert_array_equal(a, b)
    table = results[1][0]
    # Only the looked-up rows moved, by about the learning rate a step.
    assert np.all(table[[0, 2, 39]] == 1.0)
    np.testing.assert_allclose(table[[1, 5, 7]], 1.0 - 2e-2, atol=4e-3)


def fit_dense_stack(
    policy,
    group_elements,
    monkeypatch,
    jit_compile=False,
    optimizer=None,
    width=12,
    group_variables=10**9,
):
    """Weights (float32) and optimizer after `fit` of a small Dense stack
    `width` wide under `policy`, with `XLA_GROUP_ELEMENTS` set to
    `group_elements` and `XLA_GROUP_VARIABLES` to `group_variables` (the
    optimizer Adam(1e-2), or `optimizer()`)."""
    import keras_dtype_policy as kdp

    monkeypatch.setattr(tensorflow_step, "XLA_GROUP_ELEMENTS", group_elements)
    monkeypatch.setattr(tensorflow_step, "XLA_GROUP_VARIABLES", group_variables)
    keras.utils.set_random_seed(3)
    with kdp.policy_scope(policy):
        model = keras.Sequential(
            [keras.Input((width,))]
            + [keras.layers.Dense(width, activation="relu") for _ in range(3)]
            + [keras.layers.Dense(1)]
        )
    model.compile(
        optimizer=optimizer() if optimizer else keras.optimizers.Adam(1e-2),
        loss="mean_squared_error",
        jit_compile=jit_compile,
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, width)).astype("float32")
    y = rng.normal(size=(32, 1)).astype("float32")
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    return [as_float32(w) for w in model.trainable_weights], model.optimizer


# One policy in the default runs (each takes 15-25 s on TensorFlow, for
# CI time); `tox -e full-tensorflow` runs every one.
IN_FULL_RUNS = pytest.mark.slow


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's XLA step")
@pytest.mark.parametrize(
    "policy",
    [
        pytest.param("kahan_bfloat16", marks=IN_FULL_RUNS),
        "stochastic_bfloat16_8bit",
    ],
)
def test_tensorflow_groups_bound_the_step_inside_fit(policy, monkeypatch):
    # `fit` traces its step into a tf.function (no XLA on a CPU): the
    # groups are XLA computations of their own there too, so the step's
    # temporaries are a group's (issue #43), with the same results as one
    # computation for the whole model.
    whole, one = fit_dense_stack(policy, 10**9, monkeypatch)
    grouped, optimizer = fit_dense_stack(policy, 200, monkeypatch)
    assert one._step_cache.steps and not one._step_cache.groups
    # 144 + 12 elements a hidden layer, the last one's 12 + 1 joining
    # the third: three groups.
    assert len(optimizer._step_cache.groups) == 3
    assert not optimizer._step_cache.steps
    for a, b in zip(whole, grouped, strict=True):
        np.testing.assert_array_equal(a, b)


# Slow: two jit-compiled fits (about 45 s on a 2-core machine); `tox -e
# full-tensorflow` runs it.
@pytest.mark.slow
@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's XLA step")
def test_tensorflow_groups_inside_a_jit_compiled_fit(monkeypatch):
    # Under `jit_compile=True` the whole step is one XLA computation
    # whatever the groups: they are traced into it, same results.
    whole, _ = fit_dense_stack("kahan_bfloat16", 10**9, monkeypatch, True)
    grouped, _ = fit_dense_stack("kahan_bfloat16", 200, monkeypatch, True)
    for a, b in zip(whole, grouped, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's XLA step")
@pytest.mark.parametrize(
    "policy",
    [
        pytest.param("kahan_bfloat16", marks=IN_FULL_RUNS),
        "stochastic_bfloat16_8bit",
        pytest.param("mixed_bfloat16", marks=IN_FULL_RUNS),
    ],
)
def test_tensorflow_groups_of_equal_shapes_share_a_computation(
    policy, monkeypatch
):
    # Each compiled computation keeps ~13 MiB resident (issue #43): groups
    # whose variables and state have the same shapes and dtypes run one,
    # their variables passed in, with the results of one a group.
    import keras_dtype_policy as kdp

    optimizer_of = {
        "mixed_bfloat16": lambda: kdp.LowPrecisionOptimizer(
            keras.optimizers.Adam(1e-2), state_dtype="8bit"
        )
    }
    # 64 wide: the kernels' 4096 elements get 8-bit state.
    fit = functools.partial(
        fit_dense_stack, optimizer=optimizer_of.get(policy), width=64
    )
    shared, optimizer = fit(policy, 4200, monkeypatch)
    monkeypatch.setattr(tensorflow_step, "SHAREABLE_OPTIMIZERS", ())
    alone, unshared = fit(policy, 4200, monkeypatch)
    for a, b in zip(shared, alone, strict=True):
        np.testing.assert_array_equal(a, b)
    assert not unshared._step_cache.shared
    # The three hidden layers are a group each, of the same shapes: one
    # computation; the output layer another.
    entries = list(optimizer._step_cache.shared.values())
    assert len(entries) == 2
    assert entries[0].checked and entries[0].usable
    assert entries[0].function.experimental_get_tracing_count() == 1
    steps = [held.step for held in optimizer._step_cache.groups.values()]
    assert [s.shared for s in steps] == [entries[0]] * 3 + [entries[1]]
    assert steps[0].state[0] is not steps[1].state[0]


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's XLA step")
def test_tensorflow_groups_at_most_four_variables(monkeypatch):
    # Compiling one computation takes 15-20 MiB a variable it updates for a
    # moment (1.8 GiB more for a 64-layer stack of 266k parameters, #43):
    # a small model of more than four variables is updated group by group
    # too, with the results of one computation.
    policy = "stochastic_bfloat16_8bit"
    whole, one = fit_dense_stack(policy, 2**23, monkeypatch)
    grouped, optimizer = fit_dense_stack(
        policy, 2**23, monkeypatch, group_variables=4
    )
    for a, b in zip(whole, grouped, strict=True):
        np.testing.assert_array_equal(a, b)
    assert one._step_cache.steps and not one._step_cache.groups
    # Eight variables: two hidden layers a group, four variables each.
    held = optimizer._step_cache.groups
    assert [len(h.key.variables) for h in held.values()] == [4, 4]
    assert tensorflow_step.XLA_GROUP_VARIABLES == 4


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's XLA step")
def test_tensorflow_groups_share_nothing_unless_all_state_is_passed(
    monkeypatch,
):
    # The safety net: where the state passed in misses something the
    # update reads (here: every slot), the second group's trace captures
    # other variables than the template's, and each group gets its own
    # computation again: the same results, nothing shared.
    from keras_dtype_policy.low_precision import slot_lists

    fit = functools.partial(fit_dense_stack, width=64)
    whole, _ = fit("stochastic_bfloat16_8bit", 10**9, monkeypatch)
    monkeypatch.setattr(
        slot_lists, "stored_state", lambda wrapper, variable: [variable]
    )
    grouped, optimizer = fit("stochastic_bfloat16_8bit", 4200, monkeypatch)
    for a, b in zip(whole, grouped, strict=True):
        np.testing.assert_array_equal(a, b)
    entries = list(optimizer._step_cache.shared.values())
    assert entries[0].checked and not entries[0].usable
    steps = [held.step for held in optimizer._step_cache.groups.values()]
    # Only the template group itself still runs the traced computation.
    bound = [isinstance(s, tensorflow_step.BoundGroupStep) for s in steps]
    assert bound == [True, False, False, True]


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TensorFlow's XLA step")
def test_tensorflow_loss_scaled_large_model_runs_inner_groups(monkeypatch):
    # Above XLA_GROUP_ELEMENTS the package's LossScaleOptimizer checks the
    # gradients and updates its scale op by op around the wrapped
    # LowPrecisionOptimizer's groups (one computation for the whole step
    # would hold every group's temporaries): a skipped step skips every
    # group, a finite one updates them as one computation does.
    import keras_dtype_policy as kdp

    def train(group_elements, grads):
        monkeypatch.setattr(
            tensorflow_step, "XLA_GROUP_ELEMENTS", group_elements
        )
        monkeypatch.setattr(tensorflow_step, "XLA_GROUP_VARIABLES", 10**9)
        weights = [
            keras.Variable(np.ones((30, 30), "float32"), dtype="bfloat16"),
            keras.Variable(np.ones((20, 30), "float32"), dtype="bfloat16"),
        ]
        inner = LowPrecisionOptimizer(
            keras.optimizers.Adam(1e-2), update="kahan", state_dtype="8bit"
        )
        optimizer = kdp.LossScaleOptimizer(inner)
        for step_grads in grads:
            optimizer.apply(step_grads, weights)
        return [as_float32(w) for w in weights], optimizer

    # Scaled by the initial 2**15; the second step overflows.
    finite = [
        keras.ops.full(s, 2.0**15, "bfloat16") for s in [(30, 30), (20, 30)]
    ]
    overflow = [finite[0], keras.ops.full((20, 30), np.inf, "bfloat16")]
    steps = [finite, overflow, finite]
    whole, one = train(10**9, steps)
    grouped, optimizer = train(1000, steps)
    assert not one.inner_optimizer._step_cache.groups
    assert len(optimizer.inner_optimizer._step_cache.groups) == 2
    assert int(optimizer.inner_optimizer.iterations.numpy()) == 2
    assert float(optimizer.dynamic_scale.numpy()) == 2.0**14
    for a, b in zip(whole, grouped, strict=True):
        np.testing.assert_array_equal(a, b)
    # Adam's first steps move each weight by about the learning rate.
    np.testing.assert_allclose(grouped[0], 1.0 - 2e-2, atol=3e-3)


# Quantized state: weights of several pieces (TORCH_GROUP_ELEMENTS small)
# whose last block is padded (67 * 73 is no multiple of 256 or 128).
QUANTIZED_SHAPES = [(67, 73), (64, 128), (9,)]
QUANTIZED_OPTIMIZERS = (
    "adam",
    "adamw",
    "sgd_momentum",
    "rmsprop_momentum",
    "lion",
)


def train_quantized(name, fused, monkeypatch, state_dtype, update, steps=4):
    """Returns the weights (float32) and each quantized slot's codes and
    scales after `steps` steps of bfloat16 and float32 weights."""
    with monkeypatch.context() as patch:
        patch.setattr(torch_step, "TORCH_GROUP_ELEMENTS", 1000)
        if not fused:
            patch.setattr(torch_step, "can_batch", lambda wrapper: False)
        rng = np.random.default_rng(0)
        weights = [
            keras.Variable(rng.normal(size=s).astype("float32"), dtype=d)
            for s in QUANTIZED_SHAPES
            for d in ("bfloat16", "float32")
        ]
        optimizer = LowPrecisionOptimizer(
            OPTIMIZERS[name](), update=update, state_dtype=state_dtype, seed=1
        )
        for _ in range(steps):
            grads = [
                keras.ops.convert_to_tensor(
                    rng.normal(size=w.shape).astype("float32"), w.dtype
                )
                for w in weights
            ]
            optimizer.apply(grads, weights)
            assert torch_step.can_batch(optimizer) == fused
    slots = optimizer.quantized_slots
    codes = [(to_numpy(s.codes), to_numpy(s.scales)) for s in slots]
    return [as_float32(w) for w in weights], codes


@pytest.mark.skipif(BACKEND != "torch", reason="torch's batched path")
@pytest.mark.parametrize("state_dtype", ["8bit", "4bit"])
@pytest.mark.parametrize("name", QUANTIZED_OPTIMIZERS)
def test_torch_batches_quantized_state_as_the_general_path(
    name, state_dtype, monkeypatch
):
    # Rounded to nearest, both paths quantize with the same arithmetic
    # (`torch_kernels` is `block_codes` bit for bit: test_torch_codes.py);
    # only the update's own arithmetic differs in the last place (the
    # package's Adam, `_parallel_update_step`, against Keras' ops), which
    # moves a scale by an ulp and could move a code to its neighbour.
    fused, fused_codes = train_quantized(
        name, True, monkeypatch, state_dtype, "nearest"
    )
    general, general_codes = train_quantized(
        name, False, monkeypatch, state_dtype, "nearest"
    )
    assert len(fused_codes) == len(general_codes) > 0
    for (codes, scales), (codes_, scales_) in zip(
        fused_codes, general_codes, strict=True
    ):
        assert np.mean(codes != codes_) <= 1e-3
        np.testing.assert_allclose(scales, scales_, rtol=1e-5)
    for index, (a, b) in enumerate(zip(fused, general, strict=True)):
        if index % 2 == 1:  # float32 weights
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        elif name != "adamw":
            # One bfloat16 ulp; AdamW's general path rounds the decayed
            # weight before the update, the batched one only after it.
            np.testing.assert_allclose(a, b, rtol=2**-7)


@pytest.mark.skipif(BACKEND != "torch", reason="torch's batched path")
@pytest.mark.parametrize("state_dtype", ["8bit", "4bit"])
def test_torch_batches_stochastic_quantized_state_alike(
    state_dtype, monkeypatch
):
    # Other random bits on each path: the same distribution, so the
    # weights agree on average to the state's precision, not bit for bit
    # (a 4-bit second moment near its block's lowest level can round to
    # levels 16x apart, so single elements may differ by a full step).
    fused, fused_codes = train_quantized(
        "adam", True, monkeypatch, state_dtype, "stochastic_rounding"
    )
    general, general_codes = train_quantized(
        "adam", False, monkeypatch, state_dtype, "stochastic_rounding"
    )
    for a, b in zip(fused, general, strict=True):
        # The bfloat16 state test's bound, but for a few elements.
        assert np.mean(np.abs(a - b) > 0.05 * np.abs(b) + 0.02) < 1e-3
        assert np.mean(np.abs(a - b)) < 0.01
    for (_, scales), (_, scales_) in zip(
        fused_codes, general_codes, strict=True
    ):
        # Block by block a 4-bit momentum's scale moves by its coarse
        # levels (up to 2/7 of the scale); on average it agrees.
        np.testing.assert_allclose(np.mean(scales), np.mean(scales_), rtol=0.05)


@pytest.mark.skipif(BACKEND != "torch", reason="torch's batched path")
def test_torch_batches_a_weight_larger_than_a_group(monkeypatch):
    # 1025 * 1031 elements: two pieces of the real TORCH_GROUP_ELEMENTS, the
    # second ending in a padded block.
    results = []
    for fused in (True, False):
        rng = np.random.default_rng(0)
        with monkeypatch.context() as patch:
            if not fused:
                patch.setattr(torch_step, "can_batch", lambda wrapper: False)
            weight = keras.Variable(
                rng.normal(size=(1025, 1031)).astype("float32"), "bfloat16"
            )
            optimizer = LowPrecisionOptimizer(
                keras.optimizers.Adam(1e-2),
                update="nearest",
                state_dtype="8bit",
            )
            grad = rng.normal(size=weight.shape).astype("float32")
            for _ in range(2):
                optimizer.apply([keras.ops.cast(grad, "bfloat16")], [weight])
        slots = optimizer.quantized_slots
        results.append([to_numpy(s.codes) for s in slots])
    for codes, codes_ in zip(*results, strict=True):
        assert np.mean(codes != codes_) <= 1e-4


@pytest.mark.skipif(BACKEND != "torch", reason="torch's batched path")
@pytest.mark.parametrize("update", ["stochastic_rounding", "nearest"])
def test_torch_runs_each_end_of_a_group_as_one_operation(update, monkeypatch):
    # One group of 8 bfloat16 weights with 8-bit state: the step reads each
    # code's slots with one dequantize, writes them with one quantize, and
    # rounds every bfloat16 weight in one pass (a kernel call costs tens of
    # microseconds of torch.compile's guards, so one a tensor adds up).
    from keras_dtype_policy.low_precision import torch_coded_adam
    from keras_dtype_policy.low_precision import torch_kernels

    # The general path's ends: where the kernels compile, Adam on 8-bit
    # moments is one kernel of its own (test_torch_coded_adam.py).
    monkeypatch.setattr(
        torch_coded_adam, "apply", lambda wrapper, pieces, *rest: pieces
    )
    calls = {"dequantize": 0, "quantize": 0, "store_rounded": 0}

    def counted(name, function):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)

        return wrapper

    for module, name in (
        (torch_kernels, "dequantize"),
        (torch_kernels, "quantize"),
        (torch_step, "store_rounded"),
    ):
        monkeypatch.setattr(module, name, counted(name, getattr(module, name)))
    rng = np.random.default_rng(0)
    shapes = [(40, 33), (257,), (3, 100), (64, 64)] * 2
    weights = [
        keras.Variable(rng.normal(size=s).astype("float32"), dtype="bfloat16")
        for s in shapes
    ]
    optimizer = LowPrecisionOptimizer(
        keras.optimizers.Adam(1e-2), update=update, state_dtype="8bit", seed=3
    )
    grads = [keras.ops.cast(rng.normal(size=s), "bfloat16") for s in shapes]
    optimizer.apply(grads, weights)  # builds the slots
    calls.update(dequantize=0, quantize=0, store_rounded=0)
    before = [as_float32(w) for w in weights]
    optimizer.apply(grads, weights)
    assert torch_step.can_batch(optimizer)
    rounded = 1 if update == "stochastic_rounding" else 0
    assert calls == {"dequantize": 2, "quantize": 2, "store_rounded": rounded}
    # Every weight moved (Adam's step is about the learning rate), none
    # by more than a few steps.
    for weight, old in zip(weights, before, strict=True):
        moved = np.abs(as_float32(weight) - old)
        assert 0.2 < np.mean(moved > 0) and np.max(moved) < 0.1
