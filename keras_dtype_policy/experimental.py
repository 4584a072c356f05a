"""`keras_dtype_policy.experimental`: TensorFlow 2.3's namespace.

The objects under the paths that `tf.keras.mixed_precision.experimental`
users wrote; also `keras_dtype_policy.mixed_precision.experimental`:

- `Policy(name, loss_scale="auto")`: the policy with a loss scale;
- `set_policy`, `global_policy`, `get_layer_policy`;
- `LossScaleOptimizer(optimizer, loss_scale)`: TensorFlow 2.3's arguments;
- `DynamicLossScale`, `FixedLossScale`: loss-scale values.

Every name but `LossScaleOptimizer` is also at the top level, as the same
object: `keras_dtype_policy.Policy is experimental.Policy`. `global_policy`
is the top level's `dtype_policy` (tf.keras' returned the policy that was
set, as it does).
"""

from keras_dtype_policy.loss_scaling.loss_scale import DynamicLossScale
from keras_dtype_policy.loss_scaling.loss_scale import FixedLossScale
from keras_dtype_policy.policies.global_policy import (
    dtype_policy as global_policy,
)
from keras_dtype_policy.tf_keras_compat.legacy_optimizer import (
    LossScaleOptimizerV1 as LossScaleOptimizer,
)
from keras_dtype_policy.tf_keras_compat.legacy_policy import Policy
from keras_dtype_policy.tf_keras_compat.legacy_policy import get_layer_policy
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
