"""Precision rules: which policy each layer gets, by class, name or path.

A `PrecisionRules` holds a default policy and a list of `PrecisionRule`s;
the last rule that matches a layer decides its policy, so rules added later
override earlier ones. `float16_rules()` is the default set for float16.
A float8 policy (`"float8_from_mixed_bfloat16"`, or a rule's bare
`"float8"`) reaches only the layers that can train in float8; the others
get its source policy (see `float8.py`).
"""

import dataclasses
import fnmatch
from collections.abc import Iterable
from typing import Any

import keras

from keras_dtype_policy.policies import float8
from keras_dtype_policy.policies import names as policy_names
from keras_dtype_policy.policies.policy import DTypePolicy


def float_policy(argument_name, value):
    """Returns `value` (a name or a policy) as a float `DTypePolicy`.

    Raises a `ValueError` naming `argument_name` for anything else.
    """
    if isinstance(value, keras.DTypePolicy) and not isinstance(
        value, keras.dtype_policies.DTypePolicyMap
    ):
        if value.quantization_mode is None:
            return DTypePolicy(value.name)
    if isinstance(value, str):
        try:
            compute_dtype, _ = policy_names.parse_policy_name(value)
        except (TypeError, ValueError):
            compute_dtype = None
        if compute_dtype is not None and keras.backend.is_float_dtype(
            compute_dtype
        ):
            return DTypePolicy(value)
    raise ValueError(
        f"`{argument_name}` must be the name of a floating-point policy, "
        "such as 'float32', 'mixed_float16' or 'mixed_bfloat16', or such a "
        f"policy. Received: {argument_name}={value!r}"
    )


def rule_policy(argument_name, value, bare_float8=False):
    """Returns `value` as the policy of a rule or of a rules' default.

    Accepts what `float_policy` accepts, float8 policies
    (`"float8_from_mixed_bfloat16"` or a
    `keras.dtype_policies.QuantizedFloat8DTypePolicy`) and, with
    `bare_float8`, `"float8"`: float8 over the rules' default policy.

    Raises:
        ValueError: naming `argument_name`, for anything else.
    """
    if isinstance(value, float8.Float8FromDefault) or (
        isinstance(value, str) and value == float8.FLOAT8_MODE
    ):
        if bare_float8:
            return float8.FLOAT8_FROM_DEFAULT
        raise ValueError(
            f"`{argument_name}` 'float8' needs the policy it quantizes "
            "from, such as 'float8_from_mixed_bfloat16'. Received: "
            f"{argument_name}={value!r}"
        )
    if float8.is_float8_policy(value):
        return value
    if float8.is_float8_name(value):
        return float8.quantized_policy(
            value.split("_from_", 1)[1], argument_name
        )
    try:
        return float_policy(argument_name, value)
    except ValueError:
        pass
    raise ValueError(
        f"`{argument_name}` must be the name of a floating-point policy, "
        "such as 'float32', 'mixed_float16' or 'mixed_bfloat16', a float8 "
        "policy such as 'float8_from_mixed_bfloat16'"
        + (" or 'float8'" if bare_float8 else "")
        + f", or such a policy. Received: {argument_name}={value!r}"
    )


def _strings(argument_name, value):
    """Returns `value` (one string or several) as a tuple of strings."""
    if isinstance(value, str):
        return (value,)
    values = tuple(value)
    if not all(isinstance(v, str) for v in values):
        raise TypeError(
            f"`{argument_name}` must be a string or a sequence of strings. "
            f"Received: {argument_name}={value!r}"
        )
    return values


def _class_names(value):
    """Returns `value` (classes or class names) as a tuple of class names."""
    items = (value,) if isinstance(value, (str, type)) else tuple(value)
    names = []
    for item in items:
        if isinstance(item, type):
            names.append(item.__name__)
        elif isinstance(item, str) and item:
            names.append(item.rsplit(".", 1)[-1])
        else:
            raise TypeError(
                "`layers` must be layer classes or class names, such as "
                f"keras.layers.Softmax or 'Softmax'. Received: layers={value!r}"
            )
    return tuple(names)


@dataclasses.dataclass(frozen=True)
class PrecisionRule:
    """One rule: the layers it matches, and the policy they get.

    A layer matches when its class (or a base class) is one of `layers`
    (if given), its name matches one of the `names` patterns (if given)
    and its path matches one of the `paths` patterns (if given); at least
    one of the three must be given.

    A layer's path is the names of the layers that hold it and its own,
    joined by "/", from the model down and without the model's name:
    `"bert_backbone/transformer_layer_0/self_attention_layer/query"`. It is
    known only in a built model, so rules with `paths` act in
    `apply_rules` and `load_model(..., rules=)`, and match nothing in
    `precision_scope`, where a layer is created before it has a place.

    Args:
        policy: The policy for matching layers: a name such as `"float32"`
            or a `keras.DTypePolicy`. A float8 policy
            (`"float8_from_mixed_bfloat16"`), or `"float8"` for float8 over
            the rules' default, reaches the matching layers that can train
            in float8 (`Dense`, `EinsumDense`); the others get its source.
        layers: Layer classes, or their names (`"Softmax"`); subclasses
            match too.
        names: Patterns in `fnmatch` syntax (`"*logits*"`) matched against
            the layer's name.
        paths: Patterns in `fnmatch` syntax matched against the layer's
            path in the model (`"encoder/*/query"`).
        why: Why the rule exists, for people.

    Example:

    >>> rule = PrecisionRule("float32", names="*logits*")
    >>> rule.matches(keras.layers.Dense(3, name="logits"))
    True
    """

    policy: Any
    layers: Any = ()
    names: str | tuple[str, ...] = ()
    why: str = ""
    paths: str | tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(
            self, "policy", rule_policy("policy", self.policy, True)
        )
        object.__setattr__(self, "layers", _class_names(self.layers))
        object.__setattr__(self, "names", _strings("names", self.names))
        object.__setattr__(self, "paths", _strings("paths", self.paths))
        if not self.layers and not self.names and not self.paths:
            raise ValueError(
                "A PrecisionRule needs `layers`, `names` or `paths`. "
                f"Received: layers={self.layers!r}, names={self.names!r}, "
                f"paths={self.paths!r}"
            )
        if not isinstance(self.why, str):
            raise TypeError(
                f"`why` must be a string. Received: why={self.why!r}"
            )

    def __hash__(self):
        # Keras' float8 policies are not hashable: hash by name.
        return hash((self.policy.name, self.layers, self.names, self.paths))

    def matches(
        self, layer: keras.layers.Layer, path: str | None = None
    ) -> bool:
        """Returns True if the rule applies to `layer`.

        Args:
            layer: A layer.
            path: Its path in the model, or None where it has none (a
                rule with `paths` then does not match).
        """
        if self.layers:
            bases = {cls.__name__ for cls in type(layer).__mro__}
            if not bases.intersection(self.layers):
                return False
        if self.names:
            name = getattr(layer, "name", "") or ""
            if not any(fnmatch.fnmatchcase(name, p) for p in self.names):
                return False
        if self.paths:
            if path is None:
                return False
            if not any(fnmatch.fnmatchcase(path, p) for p in self.paths):
                return False
        return True

    def get_config(self) -> dict[str, Any]:
        """Returns the rule as a JSON-serializable dict (`paths` only
        where the rule has some)."""
        config = {
            "policy": self.policy.name,
            "layers": list(self.layers),
            "names": list(self.names),
            "why": self.why,
        }
        if self.paths:
            config["paths"] = list(self.paths)
        return config


class PrecisionRules:
    """A default policy and the rules that override it for some layers.

    Apply them as a scope while building a model
    (`keras_dtype_policy.precision_scope`), to a built model
    (`keras_dtype_policy.apply_rules`) or while loading one
    (`keras_dtype_policy.load_model(path, rules=...)`).

    Args:
        default: The policy of every layer that no rule matches: a name or
            a `keras.DTypePolicy`. A float8 default
            (`"float8_from_mixed_bfloat16"`) puts every layer that can
            train in float8 there, and the others in its source policy.
        rules: `PrecisionRule`s. The last one that matches a layer wins.

    Example:

    >>> rules = PrecisionRules("mixed_float16").extend(
    ...     PrecisionRule("float32", layers="Softmax"),
    ...     PrecisionRule("float32", names="*logits*"),
    ... )
    >>> rules.policy_for(keras.layers.Softmax()).name
    'float32'
    """

    def __init__(
        self,
        default: str | keras.DTypePolicy,
        rules: Iterable[PrecisionRule] = (),
    ) -> None:
        self._default = rule_policy("default", default)
        rules = tuple(rules)
        for rule in rules:
            if not isinstance(rule, PrecisionRule):
                raise TypeError(
                    "`rules` must hold PrecisionRule objects. "
                    f"Received: {rule!r} (of type {type(rule).__name__})"
                )
        self._rules = rules
        self._float8 = None
        if any(
            isinstance(rule.policy, float8.Float8FromDefault) for rule in rules
        ):
            self._float8 = self._float8_over_default()

    def _float8_over_default(self):
        """The policy a rule's bare "float8" stands for."""
        if float8.is_float8_policy(self._default):
            return self._default
        return float8.quantized_policy(self._default, "default")

    @property
    def default(self) -> keras.DTypePolicy:
        """The policy of the layers that no rule matches."""
        return self._default

    @property
    def rules(self) -> tuple[PrecisionRule, ...]:
        """The rules, in order (the last matching one wins)."""
        return self._rules

    def policy_for(
        self, layer: keras.layers.Layer, path: str | None = None
    ) -> keras.DTypePolicy:
        """Returns the `DTypePolicy` that the rules give `layer`.

        `path` is the layer's path in its model, for rules with `paths`.
        """
        rule = self.rule_for(layer, path)
        policy = self._default if rule is None else rule.policy
        if isinstance(policy, float8.Float8FromDefault):
            policy = self._float8
        return float8.policy_for_layer(policy, layer)

    def rule_for(
        self, layer: keras.layers.Layer, path: str | None = None
    ) -> PrecisionRule | None:
        """Returns the rule that decides `layer`'s policy, or None."""
        for rule in reversed(self._rules):
            if rule.matches(layer, path):
                return rule
        return None

    @property
    def uses_paths(self) -> bool:
        """True if some rule matches on layer paths."""
        return any(rule.paths for rule in self._rules)

    def extend(self, *rules: PrecisionRule) -> "PrecisionRules":
        """Returns new rules with `rules` added last (they win)."""
        return PrecisionRules(self._default, self._rules + tuple(rules))

    def get_config(self) -> dict[str, Any]:
        """Returns the rules as a JSON-serializable dict."""
        return {
            "default": self._default.name,
            "rules": [rule.get_config() for rule in self._rules],
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "PrecisionRules":
        """Builds rules from the output of `get_config`."""
        if not isinstance(config, dict) or "default" not in config:
            raise ValueError(
                "A PrecisionRules config must be a dict with a 'default' "
                f"key. Received: config={config!r}"
            )
        rules = [PrecisionRule(**rule) for rule in config.get("rules", ())]
        return cls(config["default"], rules)

    def __iter__(self):
        return iter(self._rules)

    def __len__(self):
        return len(self._rules)

    def __eq__(self, other):
        if not isinstance(other, PrecisionRules):
            return NotImplemented
        return self.get_config() == other.get_config()

    def __hash__(self):
        # Keras' float8 policies are not hashable: hash by names.
        return hash((self._default.name, self._rules))

    def __repr__(self):
        return (
            f'<PrecisionRules default="{self._default.name}", '
            f"{len(self._rules)} rules>"
        )


def float16_rules(
    default: str | keras.DTypePolicy = "mixed_float16",
) -> PrecisionRules:
    """Returns the default rules for float16: a few float32 islands.

    Each rule keeps in float32 a kind of layer whose result float16 cannot
    hold (see `docs/precision-rules-and-audit.md` for the reasons):

    - `Softmax` layers, and layers named `*softmax*`: probabilities below
      6e-8 flush to zero in float16, and the loss takes their log.
    - layers named `*logits*`: the final scores feed the loss, and
      float16's 3 significant digits blur the gap between classes.
    - `UnitNormalization`: its sum of squares overflows float16 (65504)
      once the inputs' norm exceeds 256.

    Extend them with `.extend(PrecisionRule(...))`.

    Args:
        default: The policy of every other layer.

    Returns:
        A `PrecisionRules`.
    """
    return PrecisionRules(
        default,
        (
            PrecisionRule(
                "float32",
                layers="Softmax",
                why="probabilities below 6e-8 flush to zero in float16, "
                "and the loss takes their log",
            ),
            PrecisionRule(
                "float32",
                names="*softmax*",
                why="an Activation('softmax') named so: as for Softmax",
            ),
            PrecisionRule(
                "float32",
                names="*logits*",
                why="the final scores feed the loss; float16's 3 digits "
                "blur the gaps between classes",
            ),
            PrecisionRule(
                "float32",
                layers="UnitNormalization",
                why="its sum of squares overflows float16 once the "
                "input's norm exceeds 256",
            ),
        ),
    )
