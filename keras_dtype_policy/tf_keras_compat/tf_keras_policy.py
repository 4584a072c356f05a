"""tf.keras 2.4+'s `Policy`: a `DTypePolicy` that also takes "_infer".

The non-experimental policy of `tf.keras.mixed_precision`: no loss scale,
no warning, shown as `<Policy "name">`. It equals the `DTypePolicy` of the
same name, and is the base of the experimental `Policy` of TensorFlow 2.3,
as in tf.keras 2.4+.
"""

import keras

from keras_dtype_policy.policies import names as policy_names
from keras_dtype_policy.policies.policy import DTypePolicy
from keras_dtype_policy.policies.registration import PACKAGE

# Infer policies: name -> variable dtype (None: the inferred dtype).
INFER_POLICIES = {
    "infer": None,
    "_infer": None,
    "infer_with_float32_vars": "float32",
}
# What an infer_with_float32_vars policy becomes once its input is seen.
_FLOAT32_VARS_NAMES = {
    "float16": "mixed_float16",
    "bfloat16": "mixed_bfloat16",
    "float32": "float32",
}


@keras.saving.register_keras_serializable(
    package=PACKAGE, name="mixed_precision.Policy"
)
class Policy(DTypePolicy):
    """A dtype policy for a Keras layer, as tf.keras 2.4+ named it.

    `keras_dtype_policy.mixed_precision.Policy` stands for
    `tf.keras.mixed_precision.Policy`: a `DTypePolicy` (equal to the
    `DTypePolicy` of the same name, accepted by every layer as `dtype=`)
    that also accepts `"_infer"`, and shows itself as tf.keras did.

    Args:
        name: A `DTypePolicy` name such as `"mixed_float16"`, or `"_infer"`
            (also `"infer"`): the layer then takes the dtype of its first
            input, on its first call, for its computations and variables.

    Example:

    >>> policy = Policy("mixed_float16")
    >>> policy
    <Policy "mixed_float16">
    >>> policy.compute_dtype, policy.variable_dtype
    ('float16', 'float32')
    """

    def _parse_name(self, name):
        if isinstance(name, str) and name in INFER_POLICIES:
            return None, INFER_POLICIES[name]
        return policy_names.parse_policy_name(name)

    @property
    def should_cast_variables(self):
        """True if variables are cast to another dtype for computations."""
        return self.variable_dtype != self.compute_dtype

    @property
    def infers(self):
        """True until an infer policy has seen its first input."""
        return self._compute_dtype is None

    def unresolved_copy(self):
        """Returns a fresh copy of this infer policy, for one layer."""
        return type(self).from_config(self.get_config())

    def convert_input(self, x, autocast, dtype):
        if self.infers:
            self._infer_from(x)
            dtype = self._compute_dtype
        return super().convert_input(x, autocast, dtype)

    def _infer_from(self, x):
        """Takes the dtype of the first input as this policy's dtype."""
        leaves = [leaf for leaf in keras.tree.flatten(x) if leaf is not None]
        if not leaves:
            return
        first = leaves[0]
        dtype = getattr(first, "dtype", None)
        dtype = keras.backend.standardize_dtype(
            dtype if dtype is not None else type(first)
        )
        variable_dtype = self._variable_dtype or dtype
        if self._variable_dtype is None:
            name = dtype
        else:
            name = _FLOAT32_VARS_NAMES.get(dtype, self._name)
        self._name = name
        self._compute_dtype = dtype
        self._variable_dtype = variable_dtype
