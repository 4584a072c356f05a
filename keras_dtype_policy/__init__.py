"""Dtype policies and loss scaling for every Keras 3 backend.

Importing the package registers its classes with Keras serialization and
installs its compile hook (see `install` and `uninstall`).
"""

from keras_dtype_policy.global_policy import dtype_policy
from keras_dtype_policy.global_policy import policy_scope
from keras_dtype_policy.global_policy import set_dtype_policy
from keras_dtype_policy.loss_scale import DynamicLossScale
from keras_dtype_policy.loss_scale import FixedLossScale
from keras_dtype_policy.loss_scale import LossScale
from keras_dtype_policy.loss_scale import get_loss_scale
from keras_dtype_policy.optimizer import LossScaleOptimizer
from keras_dtype_policy.patches import install
from keras_dtype_policy.patches import is_installed
from keras_dtype_policy.patches import uninstall
from keras_dtype_policy.policy import DTypePolicy

__version__ = "0.1.0"

__all__ = [
    "DTypePolicy",
    "DynamicLossScale",
    "FixedLossScale",
    "LossScale",
    "LossScaleOptimizer",
    "dtype_policy",
    "get_loss_scale",
    "install",
    "is_installed",
    "policy_scope",
    "set_dtype_policy",
    "uninstall",
]

install()
