"""Loading a saved model under another policy, or under precision rules.

A model trained in mixed_float16 is loaded as float32 (or mixed_bfloat16,
or per a rule set) without rebuilding it by hand: the file is loaded as
saved (tf.keras 2 files included), then rebuilt with every layer's policy
replaced and the weights cast where a variable's dtype changes.
"""

import os

import keras

from keras_dtype_policy.policies import precision_rules
from keras_dtype_policy.policies import rules_application
from keras_dtype_policy.tf_keras_compat import model_files


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
        compile config if it had one (the optimizer starts afresh).

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
    return rules_application.apply_rules(model, chosen, keep_float32)


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
