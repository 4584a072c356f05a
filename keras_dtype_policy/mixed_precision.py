"""`keras_dtype_policy.mixed_precision`: tf.keras 2.4+'s namespace.

A stand-in for `tensorflow.keras.mixed_precision`: code written for it runs
with `from keras_dtype_policy import mixed_precision` on every backend.

- `Policy`: tf.keras 2.4+'s policy (no loss scale, `"_infer"` accepted);
- `set_global_policy`, `global_policy`: a name set becomes a `Policy`, and
  Keras' plain global policy is shown as the `Policy` of its name;
- `LossScaleOptimizer(inner_optimizer, dynamic=True, initial_scale=None,
  dynamic_growth_steps=None)`, with `get_scaled_loss`,
  `get_unscaled_gradients` and `apply_gradients` for custom loops (the top
  level's `LossScaleOptimizer`, the same object);
- `experimental`: TensorFlow 2.3's namespace (`Policy` with a loss scale,
  `set_policy`, `LossScaleOptimizer(optimizer, loss_scale)`).

The top level's `set_global_policy` and `global_policy` are Keras 3's
(`set_dtype_policy` and `dtype_policy`), not these.
"""

from keras_dtype_policy import experimental
from keras_dtype_policy.loss_scaling.optimizer import LossScaleOptimizer
from keras_dtype_policy.tf_keras_compat.tf_keras_global_policy import (
    global_policy,
)
from keras_dtype_policy.tf_keras_compat.tf_keras_global_policy import (
    set_global_policy,
)
from keras_dtype_policy.tf_keras_compat.tf_keras_policy import Policy

__all__ = [
    "LossScaleOptimizer",
    "Policy",
    "experimental",
    "global_policy",
    "set_global_policy",
]
