"""The `LowPrecisionOptimizer`'s step on PyTorch: outside autograd.

Reached through `backend_dispatch.module_for("low_precision_apply")`, only
on torch (this module imports torch at its top).
"""

import torch


@torch.compiler.disable
def apply(wrapper, grads, trainable_variables):
    """Runs the wrapper's step with autograd off, outside `torch.compile`.

    As Keras' torch optimizers run theirs (`torch_utils.no_grad` around
    `TorchParallelOptimizer._backend_update_step`), so a custom training
    loop's step records no graph through the weights it reads. Under
    `jit_compile=True` Keras compiles the torch train step; the wrapper's
    step (its own compiled kernels, random bits drawn on the host, the
    in-place writes of stand-in variables) runs eagerly between the
    compiled parts.

    Args:
        wrapper: The `LowPrecisionOptimizer`.
        grads: The gradients, one per variable (None for none).
        trainable_variables: The variables.
    """
    with torch.no_grad():
        return wrapper._apply(grads, trainable_variables)
