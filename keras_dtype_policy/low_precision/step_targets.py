"""`StepTargets`: what a `LowPrecisionOptimizer` built for its step, and
`StepCache`: the steps TensorFlow compiled for an optimizer."""

import dataclasses

# `StepTargets.slots_by_variable` before the torch step first looks.
NOT_COMPUTED = object()


@dataclasses.dataclass
class StepTargets:
    """What the wrapper built, kept out of Keras' variable tracking.

    Attributes:
        views: `{id(weight): Float32View}` of the low-precision weights.
        order: The inner optimizer's variables, in the order it built on.
        rounded_slots: `{id(slot): ...}` of the slots stored narrow.
        quantized_slots: `{id(slot): QuantizedSlot}` of the coded slots.
        in_step: True while a step runs: a quantized slot then keeps the
            float32 value written into it for the rest of the step.
        slots_by_variable: The torch step's `{id(weight): [slots]}`;
            `NOT_COMPUTED` until first asked, None where it cannot tell.
        torch_arena: The torch step's float32 working space, reused from
            step to step (None until the first torch step).
        coded_adam_space: The torch Adam kernel's staging space, by
            `(name, dtype)`.
        chunked_variable: The `id` of the one variable whose update may
            run a chunk at a time (`chunked_updates`), or None;
            `NOT_COMPUTED` until first asked.
    """

    views: dict = dataclasses.field(default_factory=dict)
    order: list = dataclasses.field(default_factory=list)
    rounded_slots: dict = dataclasses.field(default_factory=dict)
    quantized_slots: dict = dataclasses.field(default_factory=dict)
    in_step: bool = False
    slots_by_variable: object = NOT_COMPUTED
    torch_arena: object = None
    coded_adam_space: dict = dataclasses.field(default_factory=dict)
    chunked_variable: object = NOT_COMPUTED


@dataclasses.dataclass
class StepCache:
    """An optimizer's steps compiled by `tensorflow_step`, reused from
    step to step.

    A plain object: Keras and TensorFlow track no attribute holding it,
    so neither a checkpoint nor a saved model sees the functions in it.

    Attributes:
        steps: `{TraceKey: tf.function}` of the whole step (the latest
            trace only).
        groups: `{index: CompiledGroup}` of the step group by group.
        shared: `{signature: SharedGroupStep}`: the compiled steps that
            groups of the same shapes and dtypes share.
    """

    steps: dict = dataclasses.field(default_factory=dict)
    groups: dict = dataclasses.field(default_factory=dict)
    shared: dict = dataclasses.field(default_factory=dict)
