"""The `LowPrecisionOptimizer`'s step on PyTorch: outside autograd.

Reached through `backend_dispatch.module_for("low_precision_apply")`, only
on torch (this module imports torch at its top).
"""

import torch


def apply(wrapper, grads, trainable_variables):
    """Runs the wrapper's step with autograd off.

    As Keras' torch optimizers run theirs (`torch_utils.no_grad` around
    `TorchParallelOptimizer._backend_update_step`), so a custom training
    loop's step records no graph through the weights it reads.

    Args:
        wrapper: The `LowPrecisionOptimizer`.
        grads: The gradients, one per variable (None for none).
        trainable_variables: The variables.
    """
    with torch.no_grad():
        return wrapper._apply(grads, trainable_variables)
