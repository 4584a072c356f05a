"""Loading a saved model under another policy, or under precision rules.

A model trained in mixed_float16 is loaded as float32 (or mixed_bfloat16,
or per a rule set) without rebuilding it by hand: the file is loaded as
saved (tf.keras 2 files included), then rebuilt with every layer's policy
replaced and the weights cast where a variable's dtype changes.
"""

import os
import warnings

import keras

from keras_dtype_policy.policies import precision_rules
from keras_dtype_policy.policies import rules_application
from keras_dtype_policy.tf_keras_compat import model_files
from keras_dtype_policy.tf_keras_compat import state_transfer


def load_model(
    path: str | os.PathLike,
    policy: str | keras.DTypePolicy | None = None,
    rules: precision_rules.PrecisionRules | None = None,
    keep_float32: bool = True,
) -> keras.Model:
    """Loads a `.keras` or `.h5` model file, optionally under a new policy.

    Args:
        path: A `.keras` or `.h5` file, written by Keras 3 or tf.keras 2,
            or a SavedModel directory that tf.keras 2 wrote (reading it
            needs TensorFlow).
        policy: The policy of every layer, such as `"float32"` or
            `"mixed_bfloat16"`; or a float8 policy such as
            `"float8_from_mixed_bfloat16"` (float8 for the layers that can
            train in it, its source policy for the rest); or None.
        rules: A `PrecisionRules` deciding each layer's policy instead
            (give `policy` or `rules`, not both); or None.
        keep_float32: Keep the layers that the file pins to float32 (those
            computing in float32 while others do not) in float32.

    Returns:
        The model. With neither `policy` nor `rules` it is the model as
        saved; otherwise a rebuilt one, compiled again from the file's
        compile config if it had one, with the saved optimizer state in
        the new configuration's form (a `.keras` file's: slots quantized
        to 8 or 4 bits, or rounded, as the new policy keeps them; float32
        weights split into bfloat16 weights and their Kahan compensation;
        the step count kept). State that does not fit the new optimizer
        is left behind with a warning, the optimizer starting afresh.

    Raises:
        ModelFileError: if the file is not a model or does not load.
        ValueError: if both `policy` and `rules` are given, or a weight
            does not fit the new variable dtype.

    Example:

    >>> model = keras_dtype_policy.load_model(
    ...     "model.keras", policy="float32"
    ... )  # doctest: +SKIP
    """
    chosen = override_rules(policy, rules)
    model, _ = model_files.load_model(model_files.read_model_file(path))
    if chosen is None:
        return model
    new = rules_application.apply_rules(model, chosen, keep_float32)
    carry_state(model, new)
    return new


def carry_state(model, new):
    """Gives `new`, a rebuilt copy of `model`, `model`'s training state
    (see `state_transfer.carry`).

    Returns:
        None where the optimizer state was carried over (or there was
        none to carry); else why the optimizer starts afresh, also
        warned (a `UserWarning`).
    """
    try:
        state_transfer.carry(model, new)
    except ValueError as error:
        reason = f"the saved optimizer state is not carried over: {error}"
        warnings.warn(
            f"{reason}. The optimizer starts afresh.",
            UserWarning,
            stacklevel=3,
        )
        return reason
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not state_transfer.is_built(optimizer):
        return "the loaded optimizer holds no state yet"
    return None


def override_rules(policy, rules):
    """Returns the `PrecisionRules` for `policy` or `rules`, or None."""
    if policy is not None and rules is not None:
        raise ValueError(
            "Give `policy` or `rules`, not both. Received: "
            f"policy={policy!r}, rules={rules!r}"
        )
    if rules is not None:
        if not isinstance(rules, precision_rules.PrecisionRules):
            raise TypeError(
                "`rules` must be a PrecisionRules. Received: "
                f"rules={rules!r} (of type {type(rules).__name__})"
            )
        return rules
    if policy is not None:
        return precision_rules.PrecisionRules(
            precision_rules.rule_policy("policy", policy)
        )
    return None
