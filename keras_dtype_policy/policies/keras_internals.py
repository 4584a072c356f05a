"""The Keras releases this package is tested with, and what moved in them.

This module is the one place that knows how Keras releases differ: the
tested range (`TESTED_KERAS`, the bound of `pyproject.toml`) and the
internals that moved between releases.
Each lookup says what it looks for, finds it wherever the installed Keras
keeps it, and raises `KerasInternalsError`, naming what it looked for and
where, when no known place has it:

- the trainer class that defines `Model.compile` (`Trainer` up to Keras
  3.15, `BaseTrainer` from 3.16);
- the quantization modes (the `QUANTIZATION_MODES` tuple up to Keras 3.15,
  a registry of quantization strategies from 3.16);
- where a layer class gets its float8 path (`float8_path_owner`: a
  `_float8_call` method up to Keras 3.15, a quantization geometry that the
  float8 strategy handles from 3.16);
- how a layer lists the layers it tracks (`tracked_sublayers`: the
  `Layer._flatten_layers` method, Keras 3.0 to 3.16).
"""

import importlib
import importlib.metadata
import re

import keras

# The Keras releases the test suite runs against: the package's dependency
# bound in pyproject.toml says the same (a test checks). Development builds
# of the last minor release inside it (keras-nightly) count as tested.
TESTED_KERAS = ">=3.12,<3.17"
_LOWEST_TESTED = (3, 12)
_FIRST_UNTESTED = (3, 17)
# The distributions that install the `keras` module.
_KERAS_DISTRIBUTIONS = ("keras", "keras-nightly")

# The method a layer with a float8 path defines (Keras 3.12 to 3.15), and
# the method that gives a layer its quantization geometry (Keras 3.16).
FLOAT8_CALL = "_float8_call"
QUANTIZATION_GEOMETRY = "_quantization_geometry"

# The method by which a Keras layer lists the layers it tracks.
FLATTEN_LAYERS = "_flatten_layers"

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
    try:
        module = vars(importlib.import_module(TRAINER_MODULE))
    except ImportError:
        module = {}
    defined_there = [
        value for value in module.values() if isinstance(value, type)
    ]
    for cls in keras.Model.__mro__:
        if any(cls is value for value in defined_there) and all(
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


def defining_class(cls, attribute):
    """Returns the class in `cls`'s method resolution order that defines
    `attribute` itself, or None."""
    for klass in cls.__mro__:
        if attribute in vars(klass):
            return klass
    return None


def float8_path_owner(layer):
    """Returns the class that gives `layer` its float8 path, or None.

    Keras 3.12 to 3.15: the class that defines `_float8_call` (`Dense`,
    `EinsumDense`). Keras 3.16: the class that defines
    `_quantization_geometry`, where the float8 strategy handles the
    geometry's family (projections: `Dense`, `EinsumDense`). `keras.Layer`'s
    own definition only refuses: it is never the owner.

    Raises:
        KerasInternalsError: if the installed Keras has neither.
    """
    cls = type(layer)
    base = keras.layers.Layer
    if FLOAT8_CALL in vars(base):
        owner = defining_class(cls, FLOAT8_CALL)
        return None if owner in base.__mro__ else owner
    if QUANTIZATION_GEOMETRY in vars(base):
        owner = defining_class(cls, QUANTIZATION_GEOMETRY)
        if owner in base.__mro__:
            return None
        registry = importlib.import_module(
            "keras.src.quantizers.strategy_registry"
        )
        strategy = registry.get_strategy("float8")
        geometry = getattr(layer, QUANTIZATION_GEOMETRY)()
        families = getattr(strategy, "geometry_families", ())
        if geometry is None or geometry.family not in families:
            return None
        return owner
    raise KerasInternalsError(
        "keras_dtype_policy cannot find how Keras gives a layer its float8 "
        f"path: keras.layers.Layer defines neither {FLOAT8_CALL} (Keras "
        f"3.12 to 3.15) nor {QUANTIZATION_GEOMETRY} (Keras 3.16) "
        f"(keras {keras.__version__}). Please report this."
    )


def tracked_sublayers(layer):
    """Returns the layers `layer` tracks directly, in Keras' order.

    Keras tracks the layers a layer assigns to its attributes (inside
    lists, dicts and tuples too) and a model's layers; its
    `_flatten_layers(include_self=False, recursive=False)` lists them.

    Raises:
        KerasInternalsError: if `keras.layers.Layer` has no
            `_flatten_layers`.
    """
    flatten = getattr(type(layer), FLATTEN_LAYERS, None)
    if flatten is None:
        raise KerasInternalsError(
            "keras_dtype_policy cannot list the layers a layer holds: "
            f"keras.layers.Layer defines no {FLATTEN_LAYERS} "
            f"(keras {keras.__version__}). Please report this."
        )
    return list(flatten(layer, include_self=False, recursive=False))


def is_quantized_policy_name(name):
    """Returns True if the policy name `name` names a quantized policy."""
    return name.startswith(quantization_modes())


def keras_distribution():
    """Returns the installed distribution of `keras`: its name, or None.

    `keras-nightly` installs the same `keras` module as `keras`; pip
    counts them as different projects.
    """
    installed = []
    for name in _KERAS_DISTRIBUTIONS:
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        installed.append((name, version))
    # The one whose version the imported module reports wrote its files.
    for name, version in installed:
        if version == keras.__version__:
            return name
    return installed[0][0] if installed else None


def keras_version_status(version=None):
    """Says whether a Keras version lies inside the tested range.

    Args:
        version: A Keras version string; the installed one if None.

    Returns:
        A `(inside, verdict)` pair: `inside` is True, False, or None for a
        version that cannot be read; `verdict` says so in words.
    """
    version = keras.__version__ if version is None else version
    match = re.match(r"(\d+)\.(\d+)", str(version))
    if match is None:
        return None, (
            f"keras {version}: cannot read the version; the tested range "
            f"is {TESTED_KERAS}"
        )
    release = (int(match.group(1)), int(match.group(2)))
    development = "dev" in str(version)
    if release < _LOWEST_TESTED:
        where = "older than"
    elif release >= _FIRST_UNTESTED:
        where = "newer than"
    else:
        kind = "a development build inside" if development else "inside"
        return True, f"keras {version}: {kind} the tested range {TESTED_KERAS}"
    return False, (
        f"keras {version}: {where} the tested range {TESTED_KERAS}; the "
        "package patches Keras internals, which may have moved (report "
        "what fails)"
    )
