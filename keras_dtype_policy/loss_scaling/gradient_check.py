"""The finite check and the unscale of loss-scaled gradients, fused.

One question per step: are all gradients finite? And one answer to it in
the cheapest correct form each backend offers:

- PyTorch: `torch._amp_foreach_non_finite_check_and_unscale_`, the kernel
  of `torch.amp.GradScaler`: one pass over the gradients checks and
  unscales them in place, in copies the package makes (the caller's
  gradients are never changed). Where it is missing or refuses the
  tensors, the portable path below.
- TensorFlow: one `L2Loss` a float32 gradient (a reduction that reads the
  tensor once and allocates nothing), summed: a finite sum proves every
  gradient finite. Only when the sum is not finite (a NaN or Inf, or
  squares too large for float32) does an exact check per tensor decide,
  so a large but finite gradient is never taken for an overflow. The same
  inside `tf.function` and on each `tf.distribute` replica.
- JAX: XLA runs each reduction as a kernel of its own, whose fixed cost
  (a few microseconds on a CPU) dwarfs the read of a small gradient. So the
  small gradients of one dtype are joined into buckets of at most
  `BUCKET_ELEMENTS` values, one `all(isfinite)` a bucket, and each larger
  gradient gets its own. The extra memory is one bucket at most; no large
  gradient is ever copied.
- The portable path (and PyTorch's fallback): one `all(isfinite)` a
  gradient.

The unscale is a multiply by the reciprocal of the scale, as in tf.keras
2 and PyTorch's kernel: XLA fuses a multiply into the optimizer's update,
where a divide (a costly op to XLA) stays a kernel of its own per gradient.
For a scale that is a power of two (the dynamic scale with its default
factors) the product equals the quotient exactly; for any other scale it
differs by at most one rounding.

Which gradients were not finite (`nonfinite_flags`, one reduction a
gradient) is asked only of a step already found non-finite: the optimizer
asks it inside the branch that skips the step, never on a finite one.

A gradient that is None is left out. A gradient of a variable that is
overwritten with its gradient (`overwrite_with_gradient`) is checked but
never unscaled, as in Keras. `tf.IndexedSlices` are checked and unscaled by
their values.

The backend is asked of `backend_dispatch`; backends are imported inside
the functions, once Keras runs on them.
"""

import math
from typing import NamedTuple

import keras
from keras import ops

from keras_dtype_policy import backend_dispatch
from keras_dtype_policy.loss_scaling.backend_utils import is_indexed_slices
from keras_dtype_policy.loss_scaling.backend_utils import with_values

# The most values the JAX check joins into one bucket (256 KiB of float32):
# large enough that reading a bucket outweighs its kernel's fixed cost,
# small enough that XLA finds room for it among the step's buffers (the
# compiled step's temporary memory stays that of Keras' own wrapper).
BUCKET_ELEMENTS = 1 << 16


class CheckedGradients(NamedTuple):
    """What `check_and_unscale` gives back.

    Attributes:
        finite: A boolean scalar tensor: True if every gradient is finite.
        grads: The gradients divided by the scale, in new tensors.
    """

    finite: object
    grads: list


def all_finite(grads):
    """Returns a scalar boolean tensor: True if no gradient holds NaN or Inf.

    Args:
        grads: A list of gradient tensors; None entries are ignored.

    Returns:
        A boolean scalar tensor (True for an empty list).
    """
    tensors = [_values(g) for g in grads if g is not None]
    if not tensors:
        return ops.convert_to_tensor(True)
    if backend_dispatch.is_tensorflow():
        return _tf_all_finite(tensors)
    if backend_dispatch.is_torch():
        return _torch_all_finite(tensors)
    if backend_dispatch.is_jax():
        return _bucketed_all_finite(tensors)
    return _portable_all_finite(tensors)


def nonfinite_flags(grads):
    """Returns, per gradient, whether it holds a NaN or Inf.

    One reduction a gradient: meant for a step already known to be
    non-finite (the branch that skips it), never for every step.

    Args:
        grads: A list of gradient tensors.

    Returns:
        A list as long as `grads`: a boolean scalar tensor per gradient,
        None where the gradient is None.
    """
    return [
        None
        if g is None
        else ops.logical_not(ops.all(ops.isfinite(_values(g))))
        for g in grads
    ]


def unscale(grads, scale, keep=None):
    """Returns the gradients divided by `scale`.

    Args:
        grads: A list of gradient tensors (None entries stay None).
        scale: The loss scale, a scalar tensor or variable.
        keep: Optional list of booleans, one per gradient: True leaves that
            gradient as it is.

    Returns:
        A new list of gradients.
    """
    keep = keep or [False] * len(grads)
    inverse = ops.divide(1.0, ops.cast(_value(scale), "float32"))
    return [
        g if g is None or kept else _unscaled(g, inverse)
        for g, kept in zip(grads, keep, strict=True)
    ]


def check_and_unscale(grads, scale, keep=None):
    """Checks and unscales the gradients in one go where the backend can.

    Args:
        grads: A list of gradient tensors (None entries stay None).
        scale: The loss scale, a scalar tensor or variable.
        keep: Optional list of booleans, one per gradient: True leaves that
            gradient as it is (checked, not unscaled).

    Returns:
        A `CheckedGradients`: whether all are finite, and the gradients
        divided by the scale, in new tensors (`grads` are left as they
        are).
    """
    keep = keep or [False] * len(grads)
    if len(keep) != len(grads):
        raise ValueError(
            "`keep` must have one entry per gradient. Received: "
            f"{len(keep)} entries for {len(grads)} gradients"
        )
    if backend_dispatch.is_torch():
        fused = _torch_check_and_unscale(grads, scale, keep)
        if fused is not None:
            return fused
    return CheckedGradients(all_finite(grads), unscale(grads, scale, keep))


def _values(gradient):
    # The tensor holding a gradient's numbers (IndexedSlices: its values).
    if is_indexed_slices(gradient):
        return gradient.values
    return ops.convert_to_tensor(gradient)


def _value(scale):
    # A Keras variable's tensor, or the tensor itself (a `tf.Variable`'s
    # `value` is a method, not a tensor).
    return scale.value if isinstance(scale, keras.Variable) else scale


def _unscaled(gradient, inverse):
    # Times the float32 reciprocal of the scale: as Keras' divide by the
    # float32 scale, a float16 or bfloat16 gradient comes back as float32.
    if is_indexed_slices(gradient):
        return with_values(gradient, _unscaled(gradient.values, inverse))
    return ops.multiply(gradient, inverse)


def _portable_all_finite(tensors):
    # One reduction a tensor, which XLA fuses with its `isfinite`.
    verdicts = [ops.all(ops.isfinite(t)) for t in tensors]
    if len(verdicts) == 1:
        return verdicts[0]
    return ops.all(ops.stack(verdicts))


def _bucketed_all_finite(tensors):
    # Few reductions under XLA: small tensors of one dtype share a bucket.
    verdicts = []
    buckets = {}
    for tensor in tensors:
        size = math.prod(tensor.shape)
        if size >= BUCKET_ELEMENTS:
            verdicts.append(ops.all(ops.isfinite(tensor)))
            continue
        dtype = keras.backend.standardize_dtype(tensor.dtype)
        bucket, filled = buckets.get(dtype, ([], 0))
        if filled + size > BUCKET_ELEMENTS:
            verdicts.append(_flat_all_finite(bucket))
            bucket, filled = [], 0
        buckets[dtype] = (bucket + [tensor], filled + size)
    verdicts.extend(_flat_all_finite(b) for b, _ in buckets.values())
    if len(verdicts) == 1:
        return verdicts[0]
    return ops.all(ops.stack(verdicts))


def _flat_all_finite(tensors):
    # One `all(isfinite)` over the tensors joined end to end.
    if len(tensors) == 1:
        return ops.all(ops.isfinite(tensors[0]))
    flat = ops.concatenate([ops.reshape(t, (-1,)) for t in tensors])
    return ops.all(ops.isfinite(flat))


def _tf_all_finite(tensors):
    import tensorflow as tf

    wide = [t for t in tensors if t.dtype in (tf.float32, tf.float64)]
    narrow = [t for t in tensors if t.dtype not in (tf.float32, tf.float64)]
    verdicts = [_portable_all_finite(narrow)] if narrow else []
    if wide:
        squares = tf.add_n(
            [tf.cast(tf.nn.l2_loss(t), tf.float32) for t in wide]
        )
        verdicts.append(
            tf.cond(
                tf.math.is_finite(squares),
                lambda: tf.constant(True),
                lambda: _portable_all_finite(wide),
            )
        )
    return verdicts[0] if len(verdicts) == 1 else tf.reduce_all(verdicts)


def _torch_all_finite(tensors):
    import torch

    found = [
        torch.logical_not(torch.isfinite(t).all())
        for t in tensors
        if t.is_floating_point() or t.is_complex()
    ]
    if not found:
        return torch.tensor(True)
    return torch.logical_not(torch.stack(found).any())


def _torch_check_and_unscale(grads, scale, keep):
    """The fused PyTorch path; None where it does not apply.

    Only float32 and float64 gradients take it: a float16 or bfloat16
    gradient divided by the float32 scale becomes float32 in Keras, and
    would lose its small values if unscaled in its own dtype. Those, and
    the kept gradients, take the portable path beside it. The kernel
    unscales copies of the gradients in place, never the gradients given.
    """
    import torch

    kernel = getattr(torch, "_amp_foreach_non_finite_check_and_unscale_", None)
    scale = torch.as_tensor(_value(scale))
    if kernel is None or scale.device.type not in _TORCH_DEVICES:
        return None
    fused_at = []
    others = []
    for index, (gradient, kept) in enumerate(zip(grads, keep, strict=True)):
        if gradient is None:
            continue
        if not isinstance(gradient, torch.Tensor) or gradient.is_sparse:
            return None
        if (
            kept
            or gradient.dtype not in (torch.float32, torch.float64)
            or gradient.device != scale.device
        ):
            others.append(index)
        else:
            fused_at.append(index)
    unscaled = list(grads)
    with torch.no_grad():
        found = torch.zeros(1, dtype=torch.float32, device=scale.device)
        if fused_at:
            # A copy costs less than the portable check and divide: the
            # kernel then reads and writes the package's own tensors.
            copies = [grads[i].clone() for i in fused_at]
            inverse = torch.reciprocal(scale.to(torch.float32)).reshape(1)
            kernel(copies, found, inverse)
            for index, copy in zip(fused_at, copies, strict=True):
                unscaled[index] = copy
        finite = torch.eq(found[0], 0)
    if others:
        rest = [grads[i] for i in others]
        finite = torch.logical_and(finite, _torch_all_finite(rest))
        rest = unscale(rest, scale, [keep[i] for i in others])
        for index, gradient in zip(others, rest, strict=True):
            unscaled[index] = gradient
    return CheckedGradients(finite, unscaled)


# Devices whose fused kernel PyTorch builds by default.
_TORCH_DEVICES = ("cpu", "cuda")
