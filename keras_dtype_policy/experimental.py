"""`keras_dtype_policy.experimental`: tf.keras' experimental namespace.

The objects under the paths that `tf.keras.mixed_precision.experimental`
users wrote: the top level's, except `LossScaleOptimizer`, which takes
TensorFlow 2.3's `(optimizer, loss_scale)` arguments.
"""

from keras_dtype_policy.loss_scaling.loss_scale import DynamicLossScale
from keras_dtype_policy.loss_scaling.loss_scale import FixedLossScale
from keras_dtype_policy.tf_keras_compat.legacy_optimizer import (
    LossScaleOptimizerV1 as LossScaleOptimizer,
)
from keras_dtype_policy.tf_keras_compat.legacy_policy import Policy
from keras_dtype_policy.tf_keras_compat.legacy_policy import get_layer_policy
from keras_dtype_policy.tf_keras_compat.legacy_policy import global_policy
from keras_dtype_policy.tf_keras_compat.legacy_policy import set_policy

__all__ = [
    "DynamicLossScale",
    "FixedLossScale",
    "LossScaleOptimizer",
    "Policy",
    "get_layer_policy",
    "global_policy",
    "set_policy",
]
