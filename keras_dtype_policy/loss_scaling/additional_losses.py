"""Summing a mixed-precision model's regularization and `add_loss` losses.

In a float16 (or bfloat16) model an activity regularizer yields a loss in
the compute dtype while a weight regularizer yields one in float32; Keras
sums them with the compiled loss, which TensorFlow refuses for mixed dtypes.
tf.keras cast them to one dtype first; so does this.
"""

from keras import backend
from keras import ops

_LOW_PRECISION = ("float16", "bfloat16")


def make_aggregate_additional_loss(original):
    """Returns `Trainer._aggregate_additional_loss` summing in float32.

    Args:
        original: Keras' own `Trainer._aggregate_additional_loss`.

    Returns:
        The same function, its result cast to float32 when it was float16
        or bfloat16.
    """

    def aggregate_additional_loss(self, loss):
        total = original(self, loss)
        if backend.standardize_dtype(total.dtype) in _LOW_PRECISION:
            total = ops.cast(total, "float32")
        return total

    aggregate_additional_loss.__doc__ = original.__doc__
    aggregate_additional_loss.__wrapped__ = original
    return aggregate_additional_loss
