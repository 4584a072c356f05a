"""The low-precision step as batched `torch._foreach` updates.

On torch, Keras' own optimizers update every variable at once through
their `_parallel_update_step` (one `torch._foreach_*` call an operation,
over all tensors). The wrapper runs that same step: for a group of
weights it reads each low-precision weight once into a float32 working
tensor (its Kahan compensation added), widens the optimizer slots stored
in bfloat16 or float16 the same way, lets the inner optimizer's
`_parallel_update_step` update them all in place, then writes every
result back rounded, with batched operations. Groups hold at most
`GROUP_ELEMENTS` elements, so the float32 working copies never exceed a
bounded size whatever the model, and each lives only for its group.

Adam and AdamW go through torch's fused Adam kernel (one pass over
weights, gradients and moments, where Keras' own torch Adam makes ten),
the others through their own `_parallel_update_step`. Used for Keras'
torch Adam, AdamW, Adamax, Adagrad, Adadelta, Lion,
RMSprop and SGD, exactly those classes (a subclass may change the
update). Nadam (its step also updates a shared product, which groups
would repeat), optimizers with gradient accumulation or an average of
the weights (EMA), and every other optimizer take the general path of
the wrapper, one variable at a time.

torch is imported inside functions, only once Keras runs on it.
"""

import sys

import keras

from keras_dtype_policy.low_precision import compensated_updates
from keras_dtype_policy.low_precision import random_bits
from keras_dtype_policy.low_precision.float32_views import Float32View

# The most elements one group's float32 working tensors cover.
GROUP_ELEMENTS = 2**22
_BATCHED_CLASSES = (
    "Adam",
    "AdamW",
    "Adamax",
    "Adagrad",
    "Adadelta",
    "Lion",
    "RMSprop",
    "SGD",
)
_TORCH_OPTIMIZERS = "keras.src.backend.torch.optimizers."


def can_batch(wrapper):
    """True where `wrapper`'s step runs as batched updates."""
    inner = wrapper.inner_optimizer
    cls = type(inner)
    if keras.backend.backend() != "torch":
        return False
    if not cls.__module__.startswith(_TORCH_OPTIMIZERS):
        return False
    if cls.__name__ not in _BATCHED_CLASSES:
        return False
    if inner.gradient_accumulation_steps or inner.use_ema:
        return False
    return _slots_by_variable(wrapper) is not None


def batched_apply(wrapper, grads, variables, learning_rate):
    """Updates `variables` from `grads`, group by group.

    `grads` are already summed, unscaled and clipped; the caller advances
    the iteration count afterwards.

    Args:
        wrapper: The `LowPrecisionOptimizer`.
        grads: The gradients, one per variable.
        variables: The model's variables.
        learning_rate: The inner optimizer's learning rate.
    """
    inner = wrapper.inner_optimizer
    targets = wrapper._targets
    slots = _slots_by_variable(wrapper)
    group, size = [], 0
    for grad, variable in zip(grads, variables, strict=True):
        group.append((grad, variable))
        size += _elements(variable)
        if size >= GROUP_ELEMENTS:
            _update_group(wrapper, inner, targets, slots, group, learning_rate)
            group, size = [], 0
    if group:
        _update_group(wrapper, inner, targets, slots, group, learning_rate)


def _update_group(wrapper, inner, targets, slots, group, learning_rate):
    grads, order, views, widened = [], [], [], []
    try:
        for grad, variable in group:
            target = targets.views.get(id(variable), variable)
            if isinstance(target, Float32View):
                target.working = _read_float32(target)
                views.append(target)
            for slot in slots.get(id(variable), ()):
                widened.append((slot, slot._value))
                slot._value = slot._value.float()
            grads.append(grad)
            order.append(target)
        inner._apply_weight_decay(order)
        if _has_fused_adam(inner):
            _fused_adam(inner, grads, order, learning_rate)
        else:
            inner._parallel_update_step(grads, order, learning_rate)
        _write_weights(wrapper, views)
        for slot, stored in widened:
            if wrapper.update == "nearest":
                stored.copy_(slot._value)
            else:
                store_rounded(stored, slot._value, wrapper.seed_generator)
    finally:
        for view in views:
            view.working = None
        for slot, stored in widened:
            slot._value = stored


def _has_fused_adam(inner):
    import torch

    return type(inner).__name__ in ("Adam", "AdamW") and hasattr(
        torch, "_fused_adam_"
    )


def _fused_adam(inner, grads, order, learning_rate):
    """Keras' Adam update in one pass: torch's fused Adam kernel.

    torch adds epsilon to the bias-corrected square root, Keras to the
    uncorrected one; an epsilon divided by `sqrt(1 - beta_2**t)` makes
    torch's update Keras' own. Weight decay is applied before, as Keras
    does, so the kernel gets none.
    """
    import torch

    def slots(name):
        held = getattr(inner, name)
        return [held[inner._get_variable_index(t)].value for t in order]

    step = float(inner.iterations.numpy()) + 1.0
    correction = (1.0 - float(inner.beta_2) ** step) ** 0.5
    device = grads[0].device
    steps = [torch.tensor(step, dtype=torch.float32, device=device)] * len(
        order
    )
    torch._fused_adam_(
        [t.value for t in order],
        list(grads),
        slots("_momentums"),
        slots("_velocities"),
        slots("_velocity_hats") if inner.amsgrad else [],
        steps,
        amsgrad=bool(inner.amsgrad),
        lr=float(learning_rate),
        beta1=float(inner.beta_1),
        beta2=float(inner.beta_2),
        weight_decay=0.0,
        eps=float(inner.epsilon) / correction,
        maximize=False,
    )


def _read_float32(view):
    weight = view.weight._value
    if weight.dtype.is_floating_point and weight.element_size() == 4:
        return weight
    working = weight.float()
    if view.compensation is not None:
        working.add_(view.compensation._value)
    return working


def _write_weights(wrapper, views):
    for view in views:
        stored = view.weight._value
        if stored is view.working:
            continue
        if view.compensation is not None:
            # Rounded to nearest; the compensation keeps what it took off.
            stored.copy_(view.working)
            view.working.sub_(stored)
            view.compensation._value.copy_(view.working)
        elif wrapper.update == "stochastic_rounding":
            store_rounded(stored, view.working, wrapper.seed_generator)
        else:
            stored.copy_(view.working)


def store_rounded(stored, working, seed):
    """Stores float32 `working` into `stored`, rounded stochastically.

    For bfloat16 storage the random 16 bits are added to the float32 bit
    pattern and the high half of the sum is the bfloat16 result, written
    straight into the storage: one addition and one copy besides the
    draw. Infinities and NaNs produced by arithmetic stay what they are
    (only a NaN whose payload sets all of bfloat16's mantissa bits could
    carry over into the sign, and arithmetic never makes one). float16
    goes through `compensated_updates.stochastic_round`.

    Args:
        stored: The bfloat16 or float16 torch tensor to write.
        working: The float32 values, a torch tensor of the same shape.
        seed: A `keras.random.SeedGenerator`.
    """
    import torch

    if stored.dtype != torch.bfloat16 or sys.byteorder != "little":
        stored.copy_(
            compensated_updates.stochastic_round(working, stored.dtype, seed)
        )
        return
    key, device = random_bits.torch_key(seed, working.device)
    if device.type == "cpu":
        noise = random_bits.numpy_noise((working.numel(),), 16, key)
        summed = torch.from_numpy(
            working.reshape(-1).view(torch.int32).numpy() + noise
        )
    else:
        generator = torch.Generator(device=device)
        generator.manual_seed(key)
        summed = torch.randint(
            0,
            2**16,
            (working.numel(),),
            dtype=torch.int32,
            generator=generator,
            device=device,
        )
        summed.add_(working.reshape(-1).view(torch.int32))
    stored.view(torch.int16).view(-1).copy_(summed.view(torch.int16)[1::2])


def _elements(variable):
    count = 1
    for dimension in variable.shape:
        count *= int(dimension)
    return count


def _slots_by_variable(wrapper):
    """Returns `{id(model variable): [rounded slots]}`, or None where the
    inner optimizer keeps its slots in a way this module cannot see."""
    targets = wrapper._targets
    cached = getattr(targets, "slots_by_variable", False)
    if cached is not False:
        return cached
    inner = wrapper.inner_optimizer
    order = targets.order
    lists = [
        value
        for name, value in vars(inner).items()
        if name != "_trainable_variables"
        and isinstance(value, list)
        and len(value) == len(order)
        and any(id(slot) in targets.rounded_slots for slot in value)
    ]
    by_variable, found = {}, set()
    for index, target in enumerate(order):
        variable = getattr(target, "weight", target)
        rounded = [
            slots[index]
            for slots in lists
            if slots[index] is not None
            and id(slots[index]) in targets.rounded_slots
        ]
        found.update(id(slot) for slot in rounded)
        by_variable[id(variable)] = rounded
    result = by_variable if found == set(targets.rounded_slots) else None
    targets.slots_by_variable = result
    return result
