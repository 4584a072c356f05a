"""Dtype policies and loss scaling for every Keras 3 backend.

Importing the package registers its classes with Keras serialization and
installs its compile hook (see `install` and `uninstall`). If Keras cannot
import its backend, the import raises an `ImportError` that names the
backend and how to choose another, the backend's own error chained.
"""

from keras_dtype_policy import backend_check
from keras_dtype_policy.version import __version__  # noqa: F401

# Keras imports its backend here. Where the command line runs, the error
# waits in `_backend_error` for the command line to report it.
_backend_error = backend_check.keras_import_error()
if _backend_error is not None and not backend_check.running_the_command_line():
    raise _backend_error from _backend_error.__cause__

if _backend_error is None:
    from keras_dtype_policy import experimental
    from keras_dtype_policy import mixed_precision
    from keras_dtype_policy.loss_scaling.callbacks import LossScaleMonitor
    from keras_dtype_policy.loss_scaling.loss_scale import DynamicLossScale
    from keras_dtype_policy.loss_scaling.loss_scale import FixedLossScale
    from keras_dtype_policy.loss_scaling.loss_scale import LossScale
    from keras_dtype_policy.loss_scaling.loss_scale import get_loss_scale
    from keras_dtype_policy.loss_scaling.optimizer import LossScaleOptimizer
    from keras_dtype_policy.low_precision.optimizer import LowPrecisionOptimizer
    from keras_dtype_policy.low_precision.state_sharding import (
        shard_optimizer_state,
    )
    from keras_dtype_policy.patches import install
    from keras_dtype_policy.patches import is_installed
    from keras_dtype_policy.patches import uninstall
    from keras_dtype_policy.policies.global_policy import dtype_policy
    from keras_dtype_policy.policies.global_policy import policy_scope
    from keras_dtype_policy.policies.global_policy import set_dtype_policy
    from keras_dtype_policy.policies.global_policy import set_global_policy
    from keras_dtype_policy.policies.hardware import SlowFloat16Warning
    from keras_dtype_policy.policies.policy import DTypePolicy
    from keras_dtype_policy.policies.precision_rules import PrecisionRule
    from keras_dtype_policy.policies.precision_rules import PrecisionRules
    from keras_dtype_policy.policies.precision_rules import float16_rules
    from keras_dtype_policy.policies.rules_application import apply_rules
    from keras_dtype_policy.policies.rules_application import precision_scope
    from keras_dtype_policy.tf_keras_compat import legacy_policy_configs  # noqa: F401
    from keras_dtype_policy.tf_keras_compat.bridge import model_from_json
    from keras_dtype_policy.tf_keras_compat.keras_alone import save_for_keras
    from keras_dtype_policy.tf_keras_compat.load_override import load_model
    from keras_dtype_policy.tf_keras_compat.serving_export import (
        export_for_serving,
    )
    from keras_dtype_policy.tools.audit import audit
    from keras_dtype_policy.tools.lost_updates import lost_updates
    from keras_dtype_policy.tools.memory_plan import plan
    from keras_dtype_policy.tools.nonfinite import find_nonfinite

    # Aliases: one object, several names. Keras 3's own alias first:
    # `keras.mixed_precision.global_policy` is `keras.config.dtype_policy`.
    # (`set_global_policy` is `set_dtype_policy` that also takes None, as
    # tf.keras' did; Keras' own `set_dtype_policy` refuses None.)
    global_policy = dtype_policy
    # TensorFlow 2.3's names, kept at the top level for the code that used
    # them there: the objects of `keras_dtype_policy.experimental`.
    Policy = experimental.Policy
    get_layer_policy = experimental.get_layer_policy
    set_policy = experimental.set_policy

    install()

# Keras 3's names and the package's own. `Policy`, `set_policy` and
# `get_layer_policy` work too, as aliases of `experimental`'s (not listed).
__all__ = [
    "DTypePolicy",
    "DynamicLossScale",
    "FixedLossScale",
    "LossScale",
    "LossScaleMonitor",
    "LossScaleOptimizer",
    "LowPrecisionOptimizer",
    "PrecisionRule",
    "PrecisionRules",
    "SlowFloat16Warning",
    "apply_rules",
    "audit",
    "dtype_policy",
    "experimental",
    "export_for_serving",
    "find_nonfinite",
    "float16_rules",
    "get_loss_scale",
    "global_policy",
    "install",
    "is_installed",
    "load_model",
    "lost_updates",
    "mixed_precision",
    "model_from_json",
    "plan",
    "policy_scope",
    "precision_scope",
    "save_for_keras",
    "set_dtype_policy",
    "set_global_policy",
    "shard_optimizer_state",
    "uninstall",
]
