"""Gradient release on PyTorch: a hook a variable (`gradient_release`).

Reached through `backend_dispatch.module_for("gradient_release")`, only on
torch (this module imports torch at its top).
"""

import torch


def hook(variable, on_gradient):
    """Calls `on_gradient(variable, grad)` once autograd has finished the
    gradient of `variable` (all its uses summed), and frees the gradient
    where it returns True.

    Args:
        variable: A trainable `keras.Variable`.
        on_gradient: The callback; True where it used the gradient.

    Returns:
        The hook's handle (`handle.remove()` takes it off), or None where
        the variable holds no tensor that records a gradient.
    """
    parameter = variable.value
    if not isinstance(parameter, torch.Tensor) or not parameter.requires_grad:
        return None

    def released(tensor):
        with torch.no_grad():
            if on_gradient(variable, tensor.grad):
                tensor.grad = None

    return parameter.register_post_accumulate_grad_hook(released)
