"""The Keras internals that moved between releases, found by what they do.

This module is the one place that knows how Keras releases differ inside.
Each lookup says what it looks for, finds it wherever the installed Keras
keeps it, and raises `KerasInternalsError`, naming what it looked for and
where, when no known place has it:

- the trainer class that defines `Model.compile` (`Trainer` up to Keras
  3.15, `BaseTrainer` from 3.16);
- the quantization modes (the `QUANTIZATION_MODES` tuple up to Keras 3.15,
  a registry of quantization strategies from 3.16).
"""

import importlib

import keras

# The module that defines the trainer all Keras models share.
TRAINER_MODULE = "keras.src.trainers.trainer"
# What the shared trainer class defines for this package's patches.
TRAINER_ATTRIBUTES = ("compile", "_aggregate_additional_loss")


class KerasInternalsError(RuntimeError):
    """A Keras internal this package relies on is in no known place."""


def trainer_class():
    """Returns the trainer class whose `compile` every Keras model uses.

    This is the class in `keras.Model`'s method resolution order, defined
    in `keras.src.trainers.trainer`, that defines `compile` and
    `_aggregate_additional_loss` itself, whatever its name.

    Returns:
        The class (`Trainer` in Keras 3.12 to 3.15, `BaseTrainer` in 3.16).

    Raises:
        KerasInternalsError: if no such class exists.
    """
    for cls in keras.Model.__mro__:
        if cls.__module__ == TRAINER_MODULE and all(
            name in vars(cls) for name in TRAINER_ATTRIBUTES
        ):
            return cls
    raise KerasInternalsError(
        "keras_dtype_policy cannot find Keras' shared trainer class: no "
        f"class of {TRAINER_MODULE} (Trainer, or BaseTrainer from Keras "
        "3.16) among keras.Model's bases defines "
        f"{' and '.join(TRAINER_ATTRIBUTES)} (keras {keras.__version__}). "
        "Please report this."
    )


def quantization_modes():
    """Returns the quantization modes the installed Keras knows.

    A policy name that starts with one of them (`"int8_from_float32"`,
    `"int4/128_from_bfloat16"`) names a quantized policy.

    Returns:
        A tuple of mode names, such as `("int8", "float8", "int4", ...)`.

    Raises:
        KerasInternalsError: if neither the tuple (Keras 3.12 to 3.15) nor
            the registry (Keras 3.16) is there.
    """
    dtype_policy = importlib.import_module(
        "keras.src.dtype_policies.dtype_policy"
    )
    modes = getattr(dtype_policy, "QUANTIZATION_MODES", None)
    if modes is not None:
        return tuple(modes)
    try:
        registry = importlib.import_module(
            "keras.src.quantizers.strategy_registry"
        )
    except ImportError:
        registry = None
    if registry is not None and hasattr(registry, "registered_modes"):
        return tuple(registry.registered_modes())
    raise KerasInternalsError(
        "keras_dtype_policy cannot find Keras' quantization modes: neither "
        "keras.src.dtype_policies.dtype_policy.QUANTIZATION_MODES nor "
        "keras.src.quantizers.strategy_registry.registered_modes exists "
        f"(keras {keras.__version__}). Please report this."
    )


def is_quantized_policy_name(name):
    """Returns True if the policy name `name` names a quantized policy."""
    return name.startswith(quantization_modes())
