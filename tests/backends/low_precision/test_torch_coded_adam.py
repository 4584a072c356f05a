"""Keras' Adam on 8-bit state as one torch kernel a group.

`torch_coded_adam` runs the step of Adam and AdamW whose moments are
8-bit codes as one kernel a group, compiled or eager. It must train as
the general path of `torch_step` does (the same arithmetic; its own
random bits, so equal on average), apply weight decay to exactly the
weights Keras applies it to, leave every other configuration to the
general path, and write nothing of a group whose step is not finite.
"""

import keras
import numpy as np
import pytest
from testing import BACKEND

pytestmark = pytest.mark.skipif(
    BACKEND != "torch", reason="a torch kernel of the low-precision step"
)

SHAPE = (300, 260)


@pytest.fixture(params=["compiled", "eager"])
def compiled(request, monkeypatch):
    """The kernels compiled, then eager, and a record of the groups the
    Adam kernel updated (True) or left to the general path (False)."""
    from keras_dtype_policy.low_precision import torch_coded_adam
    from keras_dtype_policy.low_precision import torch_kernels

    on = request.param == "compiled"
    if on and torch_kernels.c_compiler() is None:
        pytest.skip("no C++ compiler here: torch.compile cannot run")
    monkeypatch.setenv(torch_kernels.SWITCH, "1" if on else "0")
    monkeypatch.setattr(torch_kernels, "_failed", [])
    outcomes = []
    update_group = torch_coded_adam._update_group

    def recorded(*args):
        outcome = update_group(*args)
        outcomes.append(outcome)
        return outcome

    monkeypatch.setattr(torch_coded_adam, "_update_group", recorded)
    yield outcomes
    assert torch_kernels._failed == []


def general_path(monkeypatch):
    from keras_dtype_policy.low_precision import torch_coded_adam

    monkeypatch.setattr(
        torch_coded_adam, "apply", lambda wrapper, pieces, *rest: pieces
    )


def train(start, grads, dtype="bfloat16", inner=None, **options):
    from keras_dtype_policy import LowPrecisionOptimizer

    weights = [
        keras.Variable(s, dtype=dtype, name=f"w{i}")
        for i, s in enumerate(start)
    ]
    optimizer = LowPrecisionOptimizer(
        inner or keras.optimizers.Adam(1e-2),
        update=options.pop("update", "stochastic_rounding"),
        state_dtype=options.pop("state_dtype", "8bit"),
        seed=5,
    )
    for step in grads:
        optimizer.apply([keras.ops.convert_to_tensor(g) for g in step], weights)
    values = [keras.ops.convert_to_numpy(w).astype("float32") for w in weights]
    codes = [
        keras.ops.convert_to_numpy(s.codes) for s in optimizer.quantized_slots
    ]
    return values, codes


def problem(count=1, steps=3, seed=3):
    rng = np.random.default_rng(seed)
    start = [rng.normal(size=SHAPE).astype("float32") for _ in range(count)]
    grads = [
        [rng.normal(size=SHAPE).astype("float32") for _ in range(count)]
        for _ in range(steps)
    ]
    return start, grads


def reference_adam(start, grads, learning_rate=1e-2, decay=0.0):
    """Keras' Adam (and AdamW's decay) in float64 NumPy."""
    w = start.astype("float64")
    m, v = np.zeros_like(w), np.zeros_like(w)
    for t, g in enumerate(grads, 1):
        w = w - w * decay * learning_rate
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        alpha = learning_rate * np.sqrt(1 - 0.999**t) / (1 - 0.9**t)
        w = w - alpha * m / (np.sqrt(v) + 1e-7)
    return w


@pytest.mark.parametrize(
    "dtype, update",
    [
        ("bfloat16", "stochastic_rounding"),
        ("bfloat16", "kahan"),
        ("float32", "stochastic_rounding"),
    ],
)
def test_adam_on_8bit_state_trains_as_the_general_path(
    dtype, update, compiled, monkeypatch
):
    options = {"update": update}
    start, grads = problem()
    fused, fused_codes = train(start, grads, dtype, **options)
    again, _ = train(start, grads, dtype, **options)
    assert compiled and all(compiled)
    count = len(compiled)
    general_path(monkeypatch)
    general, general_codes = train(start, grads, dtype, **options)
    assert len(compiled) == count  # the general path ran the last one
    np.testing.assert_array_equal(fused[0], again[0])
    reference = reference_adam(start[0], [g[0] for g in grads])
    moved = np.mean(np.abs(reference - start[0]))
    # Both paths round the same arithmetic with their own random bits
    # (and bfloat16 weights by up to a unit in the last place, more
    # than 3 steps move them): as close to a float64 Adam as each other,
    # and unbiased.
    fused_error = np.mean(np.abs(fused[0] - reference))
    general_error = np.mean(np.abs(general[0] - reference))
    assert fused_error < 1.1 * general_error
    # (The weights are compared as stored: a bfloat16 weight is off by up
    # to a unit in the last place; with Kahan compensation by at most
    # half a unit, the compensation holding the rest.)
    limit = 0.2

    assert general_error < limit * moved
    assert abs(np.mean(fused[0] - reference)) < 0.02 * moved
    for a, b in zip(fused_codes, general_codes, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        # The codes are stored as the general path stores them, and (the
        # grid is fine near zero, the rounding random) mostly close.
        apart = np.abs(a.astype(int) - b.astype(int))
        assert np.mean(apart <= 1) > 0.85


def test_weight_decay_goes_to_the_weights_keras_applies_it_to(
    compiled, monkeypatch
):
    start, grads = problem(count=2, steps=2)

    def adamw():
        inner = keras.optimizers.AdamW(1e-2, weight_decay=0.5)
        inner.exclude_from_weight_decay(var_names=["w1"])
        return inner

    fused, _ = train(start, grads, inner=adamw())
    assert compiled and all(compiled)
    general_path(monkeypatch)
    general, _ = train(start, grads, inner=adamw())
    for index, decay in ((0, 0.5), (1, 0.0)):
        steps = [g[index] for g in grads]
        reference = reference_adam(start[index], steps, decay=decay)
        moved = np.mean(np.abs(reference - start[index]))
        errors = [
            np.mean(np.abs(r - reference))
            for r in (fused[index], general[index])
        ]
        assert errors[0] < 1.1 * errors[1] + 0.01 * moved
    # Decay shrinks the first weight by about 1% a step, far more than
    # the rounding differences between the two paths.
    shrink = np.mean(np.abs(fused[0])) / np.mean(np.abs(general[1]))
    assert shrink < 0.995


@pytest.mark.parametrize(
    "options",
    [
        {"update": "nearest"},
        {"state_dtype": "4bit"},
        {"inner": "amsgrad"},
        {"inner": "rmsprop"},
    ],
    ids=["nearest", "4bit", "amsgrad", "rmsprop"],
)
def test_other_configurations_take_the_general_path(options, compiled):
    options = dict(options)  # The table's own is shared by the runs.
    start, grads = problem(steps=1)
    inner = options.pop("inner", None)
    if inner == "amsgrad":
        options["inner"] = keras.optimizers.Adam(1e-2, amsgrad=True)
    elif inner == "rmsprop":
        options["inner"] = keras.optimizers.RMSprop(1e-2)
    values, codes = train(start, grads, **options)
    assert compiled == []
    assert codes and np.all(np.isfinite(values[0]))


def test_a_step_that_is_not_finite_is_left_to_the_general_path(compiled):
    from keras_dtype_policy.low_precision import torch_step

    start, grads = problem(steps=2)
    grads[1][0][0, 0] = np.inf
    calls = []
    update_pieces = torch_step._update_pieces

    def counted(wrapper, group, *rest):
        calls.append(len(group))
        return update_pieces(wrapper, group, *rest)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch_step, "_update_pieces", counted)
        values, codes = train(start, grads)
    # The first step ran in the kernel; the second made an infinity, so
    # the kernel wrote nothing and the general path did the step.
    assert compiled == [True, False]
    assert calls == [1]
    # The general path stores the infinite moment as the largest level
    # of its block, the other blocks as usual.
    signed = codes[0].reshape(-1)
    assert signed[0] == 127
    assert np.all(np.isfinite(values[0].reshape(-1)[256:]))


def test_sixty_steps_follow_float32_state(compiled):
    # test_quantized_state's numerical check, through the kernel: Adam with
    # 8-bit state against float32 state, 60 steps of the same gradients.
    from keras_dtype_policy import LowPrecisionOptimizer

    def trajectory(state_dtype):
        rng = np.random.RandomState(0)
        start = (rng.randn(64, 128) * 0.1).astype("float32")
        weight = keras.Variable(start)
        optimizer = LowPrecisionOptimizer(
            keras.optimizers.Adam(1e-3), state_dtype=state_dtype, seed=1
        )
        for step in range(60):
            grad = np.random.RandomState(100 + step).randn(64, 128) * 0.01
            optimizer.apply(
                [keras.ops.convert_to_tensor(grad, "float32")], [weight]
            )
        return start, keras.ops.convert_to_numpy(weight)

    start, reference = trajectory("float32")
    _, quantized = trajectory("8bit")
    assert len(compiled) == 60 and all(compiled)
    moved = np.abs(reference - start).mean()
    error = np.abs(quantized - reference)
    assert moved > 1e-3
    assert error.mean() < 0.05 * moved
    assert np.median(error / np.abs(reference)) < 0.02


def test_kahan_bfloat16_weights_keep_every_step(compiled):
    # A constant gradient: Adam's steps are the learning rate each, far
    # below bfloat16's spacing at 1.0; the compensation keeps them.
    from keras_dtype_policy import LowPrecisionOptimizer

    weight = keras.Variable(np.ones((64, 64), "float32"), dtype="bfloat16")
    optimizer = LowPrecisionOptimizer(
        keras.optimizers.Adam(1e-3), update="kahan", state_dtype="8bit", seed=0
    )
    for _ in range(10):
        optimizer.apply([keras.ops.ones((64, 64), "bfloat16")], [weight])
    assert len(compiled) == 10 and all(compiled)
    compensation = optimizer.compensation_of(weight)
    values = keras.ops.convert_to_numpy(
        keras.ops.cast(weight, "float32")
        + keras.ops.cast(compensation, "float32")
    )
    np.testing.assert_allclose(values, 1.0 - 10 * 1e-3, atol=2e-4)
