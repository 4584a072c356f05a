"""The fused finite check and unscale of loss-scaled gradients.

Each backend's path (`gradient_check`): PyTorch's fused AMP kernel (in
place), TensorFlow's summed `L2Loss` with its exact fallback (eager, in
`tf.function`, with `tf.IndexedSlices`), JAX's bucketed reductions (eager
and under `jit`; the bucketing itself is checked on every backend).
"""

import keras
import numpy as np
import pytest
from testing import BACKEND
from testing import to_numpy

from keras_dtype_policy import LossScaleOptimizer
from keras_dtype_policy.loss_scaling import gradient_check

SCALE = 1024.0
DTYPES = ("float32", "float16", "bfloat16")


def gradients(bad=None, at=1, dtypes=DTYPES):
    """One gradient per dtype, scaled; `bad` (nan/inf) put into one."""
    grads = []
    for i, dtype in enumerate(dtypes):
        values = np.full((2, 3), 0.5 * SCALE * (i + 1), "float32")
        if bad is not None and i == at:
            values[1, 2] = bad
        grads.append(keras.ops.convert_to_tensor(values, dtype=dtype))
    return grads


def compiled(function):
    """`function` as the backend traces it: jit, tf.function, or eager.

    PyTorch runs Keras' training step eagerly: its paths run as they are.
    """
    if BACKEND == "jax":
        import jax

        return jax.jit(function)
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.function(function)
    return function


@pytest.mark.parametrize("trace", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize(
    "bad, at",
    [(None, 0), (np.nan, 0), (np.inf, 1), (-np.inf, 2), (np.nan, 2)],
)
def test_all_finite_sees_any_bad_value_in_any_dtype(bad, at, trace):
    check = gradient_check.all_finite
    if trace:
        check = compiled(check)
    finite = check(gradients(bad, at))
    assert bool(to_numpy(finite)) is (bad is None)


def test_all_finite_skips_none_and_is_true_for_no_gradients():
    assert bool(to_numpy(gradient_check.all_finite([None, None])))
    grads = [None, *gradients(np.nan, at=0)[:1], None]
    assert not bool(to_numpy(gradient_check.all_finite(grads)))


@pytest.mark.parametrize("trace", [False, True], ids=["eager", "traced"])
def test_a_sum_of_squares_that_overflows_is_still_finite(trace):
    # Large finite values: their squares overflow float32, which sends the
    # TensorFlow path to its exact check; a check by norm alone would see
    # an Inf here.
    check = (
        compiled(gradient_check.all_finite)
        if trace
        else (gradient_check.all_finite)
    )
    big = keras.ops.convert_to_tensor(np.full((4,), 3e38, "float32"))
    small = keras.ops.ones((3,))
    assert bool(to_numpy(check([big, small, big])))
    bad = keras.ops.convert_to_tensor(np.array([3e38, np.nan], "float32"))
    assert not bool(to_numpy(check([big, bad])))


def test_unscale_matches_keras_divide_and_keeps_what_it_is_told():
    grads = [None, *gradients()]
    keep = [False, False, True, False]
    scale = keras.Variable(SCALE)
    expected = [None, *(keras.ops.divide(g, scale) for g in grads[1:])]
    expected[2] = grads[2]
    result = gradient_check.unscale(grads, scale, keep)
    assert result[0] is None
    assert result[2] is grads[2]
    for got, want in zip(result[1:], expected[1:], strict=True):
        # float16 and bfloat16 come back as float32, as Keras' divide by
        # the float32 scale makes them.
        assert keras.backend.standardize_dtype(got.dtype) == (
            keras.backend.standardize_dtype(want.dtype)
        )
        np.testing.assert_array_equal(
            to_numpy(got).astype("float32"), to_numpy(want).astype("float32")
        )


@pytest.mark.parametrize("bad", [None, np.nan, np.inf])
def test_check_and_unscale_agrees_with_the_separate_steps(bad):
    grads = [None, *gradients(bad, at=1)]
    originals = [None, *(to_numpy(g).astype("float32") for g in grads[1:])]
    keep = [False, False, False, True]
    finite, unscaled = gradient_check.check_and_unscale(
        grads, keras.Variable(SCALE), keep
    )
    assert bool(to_numpy(finite)) is (bad is None)
    assert unscaled[0] is None
    assert unscaled[3] is grads[3]
    if bad is None:
        for got, original in zip(unscaled[1:3], originals[1:3], strict=True):
            np.testing.assert_array_equal(
                to_numpy(got).astype("float32"), original / SCALE
            )
    # Every backend leaves the gradients it was given as they were.
    for given, original in zip(grads[1:], originals[1:], strict=True):
        np.testing.assert_array_equal(
            to_numpy(given).astype("float32"), original
        )
    assert unscaled[1] is not grads[1]


def test_a_bad_value_in_a_kept_gradient_is_still_seen():
    grads = gradients(np.nan, at=0)
    finite, _ = gradient_check.check_and_unscale(
        grads, keras.Variable(SCALE), [True, False, False]
    )
    assert not bool(to_numpy(finite))


def test_keep_must_match_the_gradients():
    with pytest.raises(ValueError, match="one entry per gradient"):
        gradient_check.check_and_unscale(gradients(), SCALE, [False])


@pytest.mark.skipif(BACKEND != "torch", reason="PyTorch's fused kernel")
def test_torch_without_the_fused_kernel_gives_the_same_result(monkeypatch):
    import torch

    fused = gradient_check.check_and_unscale(gradients(), SCALE)
    monkeypatch.delattr(torch, "_amp_foreach_non_finite_check_and_unscale_")
    portable = gradient_check.check_and_unscale(gradients(), SCALE)
    assert bool(fused[0]) and bool(portable[0])
    for a, b in zip(fused[1], portable[1], strict=True):
        np.testing.assert_array_equal(
            to_numpy(a).astype("float32"), to_numpy(b).astype("float32")
        )


@pytest.mark.skipif(BACKEND != "tensorflow", reason="a TensorFlow graph")
def test_tensorflow_reads_each_gradient_once_and_copies_none():
    import tensorflow as tf

    grads = [tf.ones((3, i + 1)) for i in range(20)]
    graph = (
        tf.function(gradient_check.all_finite).get_concrete_function(grads)
    ).graph
    kinds = [op.type for op in graph.get_operations()]
    # One allocation-free reduction a gradient, one test of their sum; the
    # exact check per tensor sits in a branch taken only when it fails.
    assert kinds.count("L2Loss") == 20
    assert kinds.count("IsFinite") == 1
    assert "ConcatV2" not in kinds
    assert any(kind in ("If", "StatelessIf") for kind in kinds)


def test_a_fixed_scale_that_is_no_power_of_two_unscales_within_a_rounding():
    # The unscale multiplies by the reciprocal (as tf.keras 2 and PyTorch
    # do); Keras divides. For a power of two the two agree exactly (above);
    # for any other scale they differ by at most one rounding.
    values = np.random.default_rng(0).normal(size=(64,)).astype("float32")
    grads = [keras.ops.convert_to_tensor(values * 1000.0)]
    (got,) = gradient_check.unscale(grads, keras.Variable(1000.0))
    want = keras.ops.divide(grads[0], 1000.0)
    np.testing.assert_allclose(
        to_numpy(got), to_numpy(want), rtol=2.0**-23, atol=0
    )


@pytest.mark.parametrize("bucket", [1, 5, 12, 1000])
@pytest.mark.parametrize("trace", [False, True], ids=["eager", "traced"])
def test_the_bucketed_check_sees_a_bad_value_wherever_it_sits(
    bucket, trace, monkeypatch
):
    # Sizes 1 to 8 in two dtypes, so that buckets fill, overflow and hold
    # several dtypes; every position of every gradient is tried.
    monkeypatch.setattr(gradient_check, "BUCKET_ELEMENTS", bucket)
    sizes = [3, 8, 1, 5, 2, 7, 4, 6]
    dtypes = ["float32", "float16"] * 4
    check = gradient_check._bucketed_all_finite
    if trace:
        check = compiled(check)

    def tensors(bad_at=None, position=0):
        out = []
        for i, (size, dtype) in enumerate(zip(sizes, dtypes, strict=True)):
            values = np.ones((size,), "float32")
            if i == bad_at:
                values[position] = np.inf if i % 2 else np.nan
            out.append(keras.ops.convert_to_tensor(values, dtype=dtype))
        return out

    assert bool(to_numpy(check(tensors())))
    for index, size in enumerate(sizes):
        for position in range(size):
            assert not bool(to_numpy(check(tensors(index, position)))), (
                index,
                position,
            )


@pytest.mark.skipif(BACKEND != "jax", reason="a JAX program")
def test_jax_joins_small_gradients_into_one_reduction_a_bucket():
    import jax

    # 194 small tensors, as the 48 blocks of benchmark 6 have (206,474
    # values): four reductions, not 194.
    grads = [
        jax.numpy.ones((64, 64) if i % 4 == 0 else (64,)) for i in range(192)
    ]
    grads += [jax.numpy.ones((64, 10)), jax.numpy.ones((10,))]
    program = jax.make_jaxpr(gradient_check.all_finite)(grads)
    kinds = [e.primitive.name for e in program.eqns]
    assert kinds.count("is_finite") == 4
    assert kinds.count("concatenate") == 4


@pytest.mark.skipif(BACKEND != "jax", reason="a JAX program")
def test_jax_copies_at_most_a_bucket_and_never_a_large_gradient():
    import jax

    limit = gradient_check.BUCKET_ELEMENTS
    large = jax.numpy.ones((limit // 256, 256))
    third = limit // 3 + 1
    grads = [
        large,
        *(jax.numpy.ones((third,)) for _ in range(7)),
        jax.numpy.ones((10,), "float16"),
        large,
    ]
    program = jax.make_jaxpr(gradient_check.all_finite)(grads)
    joined = [e for e in program.eqns if e.primitive.name == "concatenate"]
    # 7 float32 gradients of a bucket's third and more make four buckets
    # (2 + 2 + 2 + 1 tensors), the lone float16 one needs none; the large
    # gradients are read where they lie.
    assert [e.outvars[0].aval.size for e in joined] == [2 * third] * 3
    assert all(e.outvars[0].aval.size <= limit for e in joined)
    assert all(
        v.aval.size < limit
        for e in joined
        for v in e.invars
        if hasattr(v, "aval")
    )
    kinds = [e.primitive.name for e in program.eqns]
    assert kinds.count("is_finite") == 2 + 4 + 1
    bad = list(grads)
    bad[-1] = large.at[3, 4].set(jax.numpy.nan)
    assert not bool(jax.jit(gradient_check.all_finite)(bad))
    assert bool(jax.jit(gradient_check.all_finite)(grads))


@pytest.mark.skipif(BACKEND != "tensorflow", reason="tf.IndexedSlices")
@pytest.mark.parametrize("bad", [None, np.nan])
def test_indexed_slices_are_checked_and_unscaled_by_their_values(bad):
    import tensorflow as tf

    values = np.full((2, 3), SCALE, "float32")
    if bad is not None:
        values[0, 0] = bad
    sliced = tf.IndexedSlices(
        tf.constant(values), tf.constant([0, 3]), tf.constant([5, 3])
    )
    dense = tf.fill((4,), SCALE)
    finite, unscaled = tf.function(gradient_check.check_and_unscale)(
        [sliced, dense], tf.constant(SCALE)
    )
    assert bool(finite) is (bad is None)
    assert isinstance(unscaled[0], tf.IndexedSlices)
    np.testing.assert_array_equal(unscaled[0].indices.numpy(), [0, 3])
    if bad is None:
        np.testing.assert_array_equal(unscaled[0].values.numpy(), 1.0)
        np.testing.assert_array_equal(unscaled[1].numpy(), 1.0)


@pytest.mark.filterwarnings("ignore:Gradients do not exist:UserWarning")
@pytest.mark.parametrize("bad", [None, np.nan, np.inf])
def test_optimizer_steps_over_many_tensors_of_mixed_dtypes(bad):
    # A float32 and a float16 weight, a weight without gradient: a finite
    # step moves the weights by the unscaled gradients; a bad one is
    # skipped and leaves every weight as it was.
    def make():
        return [
            keras.Variable(np.ones((2, 3)), dtype="float32"),
            keras.Variable(np.ones((2, 3)), dtype="float16"),
            keras.Variable(np.ones((4,)), dtype="float32"),
        ]

    def grads():
        scaled = gradients(bad, at=1, dtypes=("float32", "float16"))
        return [scaled[0], scaled[1], None]

    weights = make()
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=SCALE
    )
    scaled = [None if g is None else to_numpy(g) for g in grads()]
    optimizer.scale_loss(1.0)  # as Keras' trainers do before each step
    optimizer.apply(grads(), weights)
    # SGD: w - 0.1 * g / scale (Keras' own wrapper cannot step eagerly on
    # JAX, so the expectation is written out).
    expected = [
        np.ones((2, 3)) - 0.1 * scaled[0].astype("float32") / SCALE,
        np.ones((2, 3)) - 0.1 * scaled[1].astype("float32") / SCALE,
        np.ones((4,)),
    ]
    for weight, want in zip(weights, expected, strict=True):
        got = to_numpy(weight).astype("float32")
        assert np.all(np.isfinite(got))
        if bad is None:
            np.testing.assert_allclose(got, want, rtol=1e-3)
        else:
            np.testing.assert_array_equal(got, 1.0)
    assert optimizer.skipped_steps == (0 if bad is None else 1)


@pytest.mark.parametrize("bad", [None, np.nan])
def test_a_fixed_scale_of_one_divides_nothing_but_still_skips(bad, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a scale of 1 needs no unscale")

    monkeypatch.setattr(gradient_check, "unscale", refuse)
    monkeypatch.setattr(gradient_check, "check_and_unscale", refuse)
    weight = keras.Variable(np.ones((3,)), dtype="float32")
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.5), dynamic=False, initial_scale=1.0
    )
    values = np.full((3,), 2.0, "float32")
    if bad is not None:
        values[0] = bad
    optimizer.scale_loss(1.0)  # a scaled loss, so the scale of 1 decides
    optimizer.apply([keras.ops.convert_to_tensor(values)], [weight])
    expected = 1.0 if bad is not None else 0.0
    np.testing.assert_array_equal(to_numpy(weight), expected)
    assert optimizer.skipped_steps == (0 if bad is None else 1)
