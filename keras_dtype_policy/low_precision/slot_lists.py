"""Which optimizer variables hold the state of which weight.

Keras' optimizers keep each kind of slot in a list with one entry a
variable they were built on (`_momentums`, `_velocities`, ...). The
batched torch step and TensorFlow's shared group steps both need each
weight's own state: this module finds it once an optimizer is built.
"""

import keras

from keras_dtype_policy.low_precision.step_targets import NOT_COMPUTED


def slots_by_variable(wrapper):
    """Returns `{id(model variable): [its optimizer slots]}`, or None where
    the inner optimizer keeps its slots in a way this module cannot see.

    Every slot must have its variable's shape, and every slot the wrapper
    rounds or quantizes must be found in the lists.

    Args:
        wrapper: A built `LowPrecisionOptimizer`.
    """
    targets = wrapper._targets
    if targets.slots_by_variable is not NOT_COMPUTED:
        return targets.slots_by_variable
    inner = wrapper.inner_optimizer
    order = targets.order
    lists = [
        value
        for name, value in vars(inner).items()
        if name not in ("_trainable_variables", "_variables")
        and isinstance(value, list)
        and len(value) == len(order)
        and all(isinstance(v, keras.Variable) or v is None for v in value)
        and any(isinstance(v, keras.Variable) for v in value)
    ]
    by_variable, found, shapes_match = {}, set(), True
    for index, target in enumerate(order):
        variable = getattr(target, "weight", target)
        held = [slots[index] for slots in lists if slots[index] is not None]
        shapes_match &= all(
            tuple(slot.shape) == tuple(variable.shape) for slot in held
        )
        found.update(id(slot) for slot in held)
        by_variable[id(variable)] = held
    covered = set(targets.rounded_slots) <= found and (
        set(targets.quantized_slots) <= found
    )
    result = by_variable if covered and shapes_match else None
    targets.slots_by_variable = result
    return result


def stored_state(wrapper, variable):
    """Returns the Keras variables that store `variable`'s own state: the
    weight, its Kahan compensation, and each slot (a quantized slot's
    codes and scales), in a fixed order; None where the slots cannot be
    told (`slots_by_variable`).

    Args:
        wrapper: A built `LowPrecisionOptimizer`.
        variable: One of the variables it was built on.
    """
    slots = slots_by_variable(wrapper)
    if slots is None:
        return None
    targets = wrapper._targets
    stored = [variable]
    view = targets.views.get(id(variable))
    if view is not None and view.compensation is not None:
        stored.append(view.compensation)
    for slot in slots[id(variable)]:
        quantized = targets.quantized_slots.get(id(slot))
        if quantized is None:
            stored.append(slot)
        else:
            stored.extend((quantized.codes, quantized.scales))
    return stored
