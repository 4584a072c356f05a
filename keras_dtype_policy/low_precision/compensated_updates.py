"""Writing float32 results into bfloat16 and float16 storage.

Two ways to store a value computed in float32 into a low-precision
variable without losing the updates that the cast Keras itself does
(rounding to nearest) loses, those smaller than half a unit in the last
place (ulp) of the value. Both go through `keras.ops`, so they run eagerly
and under `jit` (JAX), `tf.function` (XLA too) and torch alike:

- `kahan_write`: the rounded value goes to the weight and what rounding
  took off goes to a compensation buffer of the weight's dtype, which the
  next read adds back (Kahan summation, as optimi does): updates add up
  instead of being rounded away.
- `stochastic_round`: rounds up or down at random, with the probability
  that makes the result equal to the value on average (unbiased), so small
  updates survive in expectation with no extra buffer. The random bits
  (`random_bits`) hash each element's index with a key drawn from a
  `keras.random.SeedGenerator`, whose state is a variable: seeded, the
  sequence is reproducible and is saved with the optimizer.

Sources: stochastic rounding for low-precision training (Gupta et al.
2015, "Deep Learning with Limited Numerical Precision", arXiv:1502.02551,
section 3); Kahan summation and stochastic rounding of bfloat16 weight
updates (Zamirai et al. 2020, "Revisiting BFloat16 Training",
arXiv:2010.06192); the compensation buffer in the weight's own
dtype as optimi keeps it
(https://optimi.benjaminwarner.dev/kahan_summation/).
"""

import keras
from keras import ops

from keras_dtype_policy.low_precision import random_bits

LOW_PRECISION_DTYPES = ("bfloat16", "float16")

# float32 keeps 23 bits of mantissa; bfloat16 keeps 7 and float16 10.
_DROPPED_BITS = {"bfloat16": 16, "float16": 13}
# float16's smallest normal number, 2**-14; below it the spacing of float16
# values is fixed at 2**-24.
_FLOAT16_MIN_NORMAL = 2.0**-14
_FLOAT16_SUBNORMAL_STEP = 2.0**-24
# float16's largest number.
_FLOAT16_MAX = 65504.0


def is_low_precision(dtype):
    """True for bfloat16 and float16."""
    return keras.backend.standardize_dtype(dtype) in LOW_PRECISION_DTYPES


def stochastic_round(value, dtype, seed):
    """Returns float32 `value` rounded to `dtype` up or down at random.

    A value lying a fraction `p` of the way from the representable number
    below it to the one above is rounded up with probability `p`: the mean
    of many roundings is the value itself. For bfloat16, which keeps
    float32's exponent range, this holds for every finite value (subnormal
    ones included). For float16 it holds from the smallest subnormal float16
    up to float16's largest value; beyond that the result is what a cast
    gives (the largest value below 65520, infinite from there). NaN and
    infinities are returned as a cast returns them.

    The rounding adds random bits below the kept mantissa bits of the
    float32 value's bit pattern (`keras.ops.view`) and clears them.

    Args:
        value: A float32 tensor (other floating tensors are cast first).
        dtype: `"bfloat16"` or `"float16"`.
        seed: A `keras.random.SeedGenerator` (advanced by one), or an
            int.

    Returns:
        A tensor of `dtype`.
    """
    dtype = keras.backend.standardize_dtype(dtype)
    if dtype not in _DROPPED_BITS:
        raise ValueError(
            "Stochastic rounding goes to bfloat16 or float16. "
            f"Received: dtype={dtype!r}"
        )
    value = ops.cast(value, "float32")
    dropped = _DROPPED_BITS[dtype]
    noise = random_bits.rounding_noise(ops.shape(value), dropped, seed)
    bits = ops.view(value, "int32")
    kept = ops.bitwise_and(ops.add(bits, noise), -(2**dropped))
    rounded = ops.view(kept, "float32")
    if dtype == "float16":
        rounded = _float16_ends(value, rounded, noise, dropped)
    rounded = ops.where(ops.isfinite(value), rounded, value)
    return ops.cast(rounded, dtype)


def _float16_ends(value, rounded, noise, dropped):
    """`rounded` with float16's subnormal and overflowing values redone.

    Below float16's normal range its steps are 2**-24 apart, whatever the
    exponent: those values round on that grid, with the same noise. Beyond
    float16's largest number they are left for the cast, which gives the
    largest number below 65520 and infinity from there.
    """
    uniform = ops.multiply(ops.cast(noise, "float32"), 1.0 / float(2**dropped))
    grid = ops.multiply(
        ops.floor(
            ops.add(ops.multiply(value, 1.0 / _FLOAT16_SUBNORMAL_STEP), uniform)
        ),
        _FLOAT16_SUBNORMAL_STEP,
    )
    rounded = ops.where(
        ops.less(ops.abs(value), _FLOAT16_MIN_NORMAL), grid, rounded
    )
    return ops.where(ops.greater(ops.abs(value), _FLOAT16_MAX), value, rounded)


def kahan_read(weight, compensation):
    """Returns the float32 value a compensated weight stands for."""
    return ops.add(
        ops.cast(weight, "float32"), ops.cast(compensation, "float32")
    )


def kahan_write(weight, compensation, value):
    """Stores float32 `value` as a rounded weight plus its compensation.

    The weight gets `value` rounded to nearest in its dtype; the
    compensation gets what the rounding took off (`value - weight`, exact
    in float32), itself rounded to the compensation's dtype. `kahan_read`
    adds it back, so a run of updates each below half an ulp of the weight
    moves the weight once their sum reaches it.

    Args:
        weight: The low-precision variable.
        compensation: Its compensation buffer, a variable of the same shape.
        value: The float32 value to store.
    """
    rounded, residual = kahan_split(value, weight.dtype, compensation.dtype)
    weight.assign(rounded)
    compensation.assign(residual)


def kahan_split(value, weight_dtype, compensation_dtype):
    """Returns `(rounded, residual)`: what `kahan_write` stores of float32
    `value` in a weight of `weight_dtype` and its compensation."""
    value = ops.cast(value, "float32")
    rounded = ops.cast(value, weight_dtype)
    residual = ops.subtract(value, ops.cast(rounded, "float32"))
    return rounded, ops.cast(residual, compensation_dtype)


def kahan_fold(weight, compensation):
    """Returns the weight's dtype value nearest to weight + compensation.

    Where the sum lies halfway between the weight and its neighbour (the
    compensation rounded up to half an ulp), the weight is kept: it is
    what the last `kahan_write` rounded the sum to. After `kahan_write`
    the result is the weight itself; it differs only where the weight was
    set without its compensation.

    Args:
        weight: A bfloat16 or float16 tensor.
        compensation: Its compensation, of the same shape.

    Returns:
        A tensor of the weight's dtype.
    """
    total = kahan_read(weight, compensation)
    rounded = ops.cast(total, weight.dtype)
    kept = ops.cast(weight, "float32")
    tie = ops.equal(
        ops.abs(ops.subtract(total, kept)),
        ops.abs(ops.subtract(total, ops.cast(rounded, "float32"))),
    )
    return ops.where(tie, weight, rounded)
