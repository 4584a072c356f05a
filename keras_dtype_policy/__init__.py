"""Dtype policies and loss scaling for every Keras 3 backend.

Importing the package registers its classes with Keras serialization and
installs its compile hook (see `install` and `uninstall`).
"""

from keras_dtype_policy import experimental
from keras_dtype_policy.loss_scaling.callbacks import LossScaleMonitor
from keras_dtype_policy.loss_scaling.loss_scale import DynamicLossScale
from keras_dtype_policy.loss_scaling.loss_scale import FixedLossScale
from keras_dtype_policy.loss_scaling.loss_scale import LossScale
from keras_dtype_policy.loss_scaling.loss_scale import get_loss_scale
from keras_dtype_policy.loss_scaling.optimizer import LossScaleOptimizer
from keras_dtype_policy.patches import install
from keras_dtype_policy.patches import is_installed
from keras_dtype_policy.patches import uninstall
from keras_dtype_policy.policies.global_policy import dtype_policy
from keras_dtype_policy.policies.global_policy import policy_scope
from keras_dtype_policy.policies.global_policy import set_dtype_policy
from keras_dtype_policy.policies.hardware import SlowFloat16Warning
from keras_dtype_policy.policies.policy import DTypePolicy
from keras_dtype_policy.tf_keras_compat import legacy_policy_configs  # noqa: F401
from keras_dtype_policy.tf_keras_compat.bridge import model_from_json
from keras_dtype_policy.tf_keras_compat.legacy_policy import Policy
from keras_dtype_policy.tf_keras_compat.legacy_policy import global_policy
from keras_dtype_policy.tf_keras_compat.legacy_policy import set_policy

__version__ = "0.1.0"

__all__ = [
    "DTypePolicy",
    "DynamicLossScale",
    "FixedLossScale",
    "LossScale",
    "LossScaleMonitor",
    "LossScaleOptimizer",
    "Policy",
    "SlowFloat16Warning",
    "dtype_policy",
    "experimental",
    "get_loss_scale",
    "global_policy",
    "install",
    "is_installed",
    "model_from_json",
    "policy_scope",
    "set_dtype_policy",
    "set_policy",
    "uninstall",
]

install()
