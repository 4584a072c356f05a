"""`keras_dtype_policy.experimental`: tf.keras' experimental namespace.

The same objects as at the top level, under the paths that
`tf.keras.mixed_precision.experimental` users wrote.
"""

from keras_dtype_policy.legacy_policy import Policy
from keras_dtype_policy.legacy_policy import global_policy
from keras_dtype_policy.legacy_policy import set_policy
from keras_dtype_policy.loss_scale import DynamicLossScale
from keras_dtype_policy.loss_scale import FixedLossScale
from keras_dtype_policy.optimizer import LossScaleOptimizer

__all__ = [
    "DynamicLossScale",
    "FixedLossScale",
    "LossScaleOptimizer",
    "Policy",
    "global_policy",
    "set_policy",
]
