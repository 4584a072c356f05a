"""`keras_dtype_policy.experimental`: tf.keras' experimental namespace.

The same objects as at the top level, under the paths that
`tf.keras.mixed_precision.experimental` users wrote.
"""

from keras_dtype_policy.loss_scaling.loss_scale import DynamicLossScale
from keras_dtype_policy.loss_scaling.loss_scale import FixedLossScale
from keras_dtype_policy.loss_scaling.optimizer import LossScaleOptimizer
from keras_dtype_policy.tf_keras_compat.legacy_policy import Policy
from keras_dtype_policy.tf_keras_compat.legacy_policy import global_policy
from keras_dtype_policy.tf_keras_compat.legacy_policy import set_policy

__all__ = [
    "DynamicLossScale",
    "FixedLossScale",
    "LossScaleOptimizer",
    "Policy",
    "global_policy",
    "set_policy",
]
