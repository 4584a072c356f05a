"""The dynamic loss-scale rule: one pure function of the last state.

Written with `keras.ops`, so that it runs eagerly and under `jit` or
`tf.function` alike. `LossScaleOptimizer` (both its stateless and its
stateful step) and `DynamicLossScale` all take their steps with it.
"""

from keras import ops


def next_scale_state(
    scale,
    counter,
    streak,
    finite,
    *,
    dynamic=True,
    growth_steps=2000,
    hysteresis=1,
    growth_factor=2.0,
    backoff_factor=0.5,
    min_scale=1.0,
    max_scale=2.0**24,
):
    """Returns the `(scale, counter, streak)` after one step.

    A finite step restarts `streak` and counts one more finite step; the
    `growth_steps`-th one multiplies the scale by `growth_factor` (but not
    above `max_scale`) and restarts the count. A non-finite step restarts
    the count and adds one to `streak`; once `streak` reaches `hysteresis`,
    it multiplies the scale by `backoff_factor` (but not below
    `min_scale`). With `dynamic=False` the scale never changes.

    Args:
        scale: The current scale, a float scalar.
        counter: Finite steps since the scale last changed, an int scalar.
        streak: Non-finite steps in a row up to this one, an int scalar.
        finite: Whether this step's gradients were all finite, a bool.
        dynamic: Whether the scale changes, a Python bool.
        growth_steps: Finite steps in a row that make the scale grow.
        hysteresis: Non-finite steps in a row that make the scale shrink.
        growth_factor: The factor the scale grows by.
        backoff_factor: The factor the scale shrinks by.
        min_scale: The floor of the scale.
        max_scale: The ceiling of the scale.

    Returns:
        The new `(scale, counter, streak)` as tensors: the scale in
        float32, the counts in their own dtypes.

    Example:

    >>> scale, counter, streak = next_scale_state(8.0, 0, 0, False)
    >>> float(scale), int(counter), int(streak)
    (4.0, 0, 1)
    """
    scale = ops.cast(ops.convert_to_tensor(scale), "float32")
    counter = ops.convert_to_tensor(counter)
    streak = ops.convert_to_tensor(streak)
    finite = ops.convert_to_tensor(finite, dtype="bool")
    zero_count = ops.zeros_like(counter)
    next_counter = ops.add(counter, ops.ones_like(counter))
    next_streak = ops.where(
        finite, ops.zeros_like(streak), ops.add(streak, ops.ones_like(streak))
    )
    if dynamic:
        grow = ops.logical_and(
            finite, ops.greater_equal(next_counter, growth_steps)
        )
        back_off = ops.logical_and(
            ops.logical_not(finite),
            ops.greater_equal(next_streak, hysteresis),
        )
        grown = ops.minimum(ops.multiply(scale, growth_factor), max_scale)
        shrunk = ops.maximum(ops.multiply(scale, backoff_factor), min_scale)
        scale = ops.where(grow, grown, ops.where(back_off, shrunk, scale))
        next_counter = ops.where(grow, zero_count, next_counter)
    next_counter = ops.where(finite, next_counter, zero_count)
    return (
        ops.cast(scale, "float32"),
        ops.cast(next_counter, counter.dtype),
        ops.cast(next_streak, streak.dtype),
    )
