"""Gradients released as they are made: the update in the backward pass.

With `LowPrecisionOptimizer(..., release_gradients=True)` on PyTorch, each
trainable variable is updated as soon as autograd has finished its
gradient, and the gradient is freed there, so the gradients of the whole
model never exist at once (torchtune's "optimizer in backward"). A step
is armed by `scale_loss`, which Keras' torch trainer calls right before
`loss.backward()`; the backward pass then runs the updates (one hook a
variable, `torch_release`), and the trainer's `apply`, which finds no
gradient left, ends the step (the step count advances once). The
finished gradients are taken off their variables at once and updated in
buckets of `BUCKET_ELEMENTS` elements (a larger variable alone), so a
bounded amount of gradients waits at any time, whatever the model. A backward
pass that no `scale_loss` armed (a gradient computed for another purpose,
a custom loop that does not call it) updates nothing: its gradients stay,
and `apply` runs the usual step on them.

Each variable's update is the usual step's arithmetic on that variable
alone. Where no random bits are drawn (`update="nearest"`, float32 state,
float32 weights with Kahan's write) the weights are bit for bit those of
the usual step; with stochastic rounding the bits are drawn a variable at
a time instead of a group at a time, so each rounding lands on the same
two neighbours with the same probabilities but not on the same one.

On JAX the step `fit` compiles (`jax.jit` of the train step, the state
donated) is one XLA computation, and XLA's schedule already runs each
variable's update as soon as its gradient exists and frees the gradient
there, unless something needs every gradient first (`global_clipnorm`,
a loss scale's finiteness check): the argument is accepted and the step
is the usual one (XLA's buffer assignment shows it; see
`tests/backends/low_precision/test_step_buffers.py`). A JAX loop that
computes the gradients outside `jax.jit` holds them all, as it would
without the package.

On TensorFlow, Keras' train step takes every gradient from one
`tape.gradient` call, and the package's update runs after it (group by
group, bounding the update's own temporaries); updating inside the
backward pass would take a gradient function on every read of every
variable, and a variable read twice (tied embeddings) would be updated
from part of its gradient. There the argument warns and the step is the
usual one.
"""

import typing
import warnings

from keras_dtype_policy import backend_dispatch
from keras_dtype_policy.low_precision import block_codes

# The elements of gradients that wait for their update together (8 MiB
# of bfloat16 gradients, whatever the model): fewer, larger update calls.
# Measured on benchmark 9's model at batch 8 (PyTorch, one core), 8-bit
# state: 1.21x the usual step with buckets of 2**20 (a group of the usual
# step), 1.11x with 2**21, 1.03x with 2**22.
BUCKET_ELEMENTS = 2**22


class ReleasedStep(typing.NamedTuple):
    """What the updates of one released step share.

    Attributes:
        learning_rate: The inner optimizer's learning rate of the step.
        noise: The step's random bits on torch (`torch_noise.TorchNoise`),
            or None where the step draws none.
    """

    learning_rate: object
    noise: object


class GradientRelease:
    """The release of one `LowPrecisionOptimizer`'s gradients.

    Args:
        wrapper: The `LowPrecisionOptimizer`.
    """

    def __init__(self, wrapper):
        self._wrapper = wrapper
        self._hooked = {}
        self._armed = False
        self._step = None
        self._released = set()
        self._waiting = []
        self._waiting_elements = 0

    @property
    def open(self):
        """True from the first released update of a step to its `finish`."""
        return bool(self._released)

    def install(self, variables):
        """Hooks each trainable variable's gradient on PyTorch.

        JAX needs no hook (XLA's compiled step frees each gradient once
        its update has read it); TensorFlow warns that its step is the
        usual one.
        """
        hooks = backend_dispatch.module_for("gradient_release")
        if hooks is None:
            if not backend_dispatch.is_jax():
                # JAX: XLA's schedule of the compiled step already frees
                # each gradient once its update has read it.
                warnings.warn(
                    "release_gradients=True does not release gradients on "
                    f"{backend_dispatch.name()}: Keras' train step takes "
                    "every gradient from one `tape.gradient` call before "
                    "any update (it does on PyTorch, and XLA's compiled "
                    "step does on JAX). The step is the usual one.",
                    UserWarning,
                    stacklevel=4,
                )
            return
        for variable in variables:
            if variable.trainable and id(variable) not in self._hooked:
                handle = hooks.hook(variable, self._on_gradient)
                if handle is not None:
                    self._hooked[id(variable)] = handle

    def arm(self):
        """Arms the next backward pass to release its gradients.

        A step left unfinished (its backward pass interrupted, or no
        `apply` after it) is abandoned first, with a warning: the
        variables updated in it keep their update, the gradients still
        waiting are dropped (the next forward pass has already read the
        weights, which must not change under it), and the step count
        advances.
        """
        if self._released:
            warnings.warn(
                "release_gradients=True: the last step ended without "
                "`optimizer.apply` (an interrupted backward pass?) after "
                f"{len(self._released) - len(self._waiting)} variable(s) "
                f"were updated; {len(self._waiting)} waiting gradient(s) "
                "were dropped, and it counts as a step.",
                RuntimeWarning,
                stacklevel=3,
            )
            self._waiting = []
            self._waiting_elements = 0
            self.finish([], [])
        self._armed = bool(self._hooked)
        self._step = None

    def disarm(self):
        """Disarms a step in which no gradient was released."""
        self._armed = False
        self._step = None

    def _on_gradient(self, variable, grad):
        """Updates `variable` from its finished gradient; True if it did
        (the hook then frees the gradient)."""
        if not self._armed or grad is None:
            return False
        if id(variable) in self._released:
            raise RuntimeError(
                "release_gradients=True updates each variable once a step, "
                "from one backward pass: a second backward pass before "
                "`optimizer.apply` (gradients accumulated by hand) would "
                "update it twice. Accumulate with release_gradients=False. "
                f"Received: a second gradient for {variable.path!r}"
            )
        if self._step is None:
            self._step = self._wrapper._begin_released_step()
        self._released.add(id(variable))
        self._waiting.append((grad, variable))
        self._waiting_elements += block_codes.element_count(variable.shape)
        if self._waiting_elements >= BUCKET_ELEMENTS:
            self._update_waiting()
        return True

    def _update_waiting(self):
        """Updates the variables whose gradients wait, and drops those."""
        if self._waiting:
            grads, variables = zip(*self._waiting, strict=True)
            self._waiting = []
            self._waiting_elements = 0
            self._wrapper._release_updates(
                list(grads), list(variables), self._step
            )

    def finish(self, grads, variables):
        """Ends a released step in `apply`: updates the variables whose
        gradient was not released (the caller passes it), then advances
        the step count once."""
        self._update_waiting()
        left = [
            (grad, variable)
            for grad, variable in zip(grads, variables, strict=True)
            if grad is not None and id(variable) not in self._released
        ]
        if left:
            left_grads, left_variables = zip(*left, strict=True)
            self._wrapper._release_updates(
                list(left_grads), list(left_variables), self._step
            )
        self._wrapper.inner_optimizer._iterations.assign_add(1)
        self._released.clear()
        self._armed = False
        self._step = None


def check_release_gradients(release_gradients, inner_optimizer):
    """Returns `release_gradients` if a bool the inner optimizer allows,
    else raises."""
    if not isinstance(release_gradients, bool):
        raise TypeError(
            "`release_gradients` must be True or False. Received: "
            f"release_gradients={release_gradients!r} (of type "
            f"{type(release_gradients).__name__})"
        )
    if release_gradients and inner_optimizer.global_clipnorm is not None:
        raise ValueError(
            "release_gradients=True updates each variable before the next "
            "gradient exists, and `global_clipnorm` needs the norm of all "
            "of them first. Clip each gradient (`clipnorm`, `clipvalue`) or "
            "keep release_gradients=False. Received: global_clipnorm="
            f"{inner_optimizer.global_clipnorm!r}"
        )
    return release_gradients
