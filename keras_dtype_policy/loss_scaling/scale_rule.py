"""The dynamic loss-scale rule: one pure function of the last state.

A finite step restarts the streak of non-finite steps and counts one more
finite step; the `growth_steps`-th one multiplies the scale by
`growth_factor` (but not above `max_scale`) and restarts the count. A
non-finite step restarts the count and adds one to the streak; once the
streak reaches `hysteresis`, it multiplies the scale by `backoff_factor`
(but not below `min_scale`). A rule that is not dynamic never changes the
scale. This is tf.keras 2's dynamic loss scale with the `hysteresis` of
DeepSpeed's `DynamicLossScaler` (`consecutive_hysteresis=True`), written
as jmp writes its own: the state in, the state out
(https://github.com/google-deepmind/jmp/blob/main/jmp/_src/loss_scale.py).

Written with `keras.ops`, so that it runs eagerly and under `jit` or
`tf.function` alike. `LossScaleOptimizer` (both its stateless and its
stateful step) and `DynamicLossScale` all take their steps with it.
"""

import dataclasses
from typing import NamedTuple

from keras import ops


class ScaleState(NamedTuple):
    """The state of a dynamic loss scale.

    Attributes:
        scale: The current scale, a float scalar.
        counter: Finite steps since the scale last changed (or a step was
            skipped), an int scalar.
        streak: Non-finite steps in a row up to the last one, an int scalar.
    """

    scale: object
    counter: object
    streak: object


@dataclasses.dataclass(frozen=True)
class ScaleRule:
    """The settings of the rule (see the module docstring).

    Attributes:
        dynamic: Whether the scale changes, a Python bool.
        growth_steps: Finite steps in a row that make the scale grow.
        hysteresis: Non-finite steps in a row that make the scale shrink.
        growth_factor: The factor the scale grows by.
        backoff_factor: The factor the scale shrinks by.
        min_scale: The floor of the scale.
        max_scale: The ceiling of the scale.
    """

    dynamic: bool = True
    growth_steps: int = 2000
    hysteresis: int = 1
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    min_scale: float = 1.0
    max_scale: float = 2.0**24

    def next_state(self, state, finite):
        """Returns the `ScaleState` after one step.

        Args:
            state: The `ScaleState` before the step.
            finite: Whether this step's gradients were all finite, a bool.

        Returns:
            The new `ScaleState`, as tensors: the scale in float32, the
            counts in their own dtypes.
        """
        scale = ops.cast(ops.convert_to_tensor(state.scale), "float32")
        counter = ops.convert_to_tensor(state.counter)
        streak = ops.convert_to_tensor(state.streak)
        finite = ops.convert_to_tensor(finite, dtype="bool")
        zero_count = ops.zeros_like(counter)
        next_counter = ops.add(counter, ops.ones_like(counter))
        next_streak = ops.where(
            finite,
            ops.zeros_like(streak),
            ops.add(streak, ops.ones_like(streak)),
        )
        if self.dynamic:
            grow = ops.logical_and(
                finite, ops.greater_equal(next_counter, self.growth_steps)
            )
            back_off = ops.logical_and(
                ops.logical_not(finite),
                ops.greater_equal(next_streak, self.hysteresis),
            )
            grown = ops.multiply(scale, self.growth_factor)
            grown = ops.minimum(grown, self.max_scale)
            shrunk = ops.multiply(scale, self.backoff_factor)
            shrunk = ops.maximum(shrunk, self.min_scale)
            scale = ops.where(grow, grown, ops.where(back_off, shrunk, scale))
            next_counter = ops.where(grow, zero_count, next_counter)
        next_counter = ops.where(finite, next_counter, zero_count)
        return ScaleState(
            scale=ops.cast(scale, "float32"),
            counter=ops.cast(next_counter, counter.dtype),
            streak=ops.cast(next_streak, streak.dtype),
        )


def next_scale_state(scale, counter, streak, finite, **settings):
    """Returns the `ScaleState` after one step of `ScaleRule(**settings)`.

    Args:
        scale: The current scale, a float scalar.
        counter: Finite steps since the scale last changed, an int scalar.
        streak: Non-finite steps in a row up to this one, an int scalar.
        finite: Whether this step's gradients were all finite, a bool.
        **settings: The fields of `ScaleRule`, by name.

    Example:

    >>> state = next_scale_state(8.0, 0, 0, False)
    >>> float(state.scale), int(state.counter), int(state.streak)
    (4.0, 0, 1)
    """
    state = ScaleState(scale=scale, counter=counter, streak=streak)
    return ScaleRule(**settings).next_state(state, finite)
