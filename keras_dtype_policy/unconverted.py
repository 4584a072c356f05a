"""The package's optimizers left to run as written under TensorFlow's AutoGraph.

A `tf.function` rewrites the Python of the function it traces, and of
every function that one calls, into graph control flow (AutoGraph), except
in modules it leaves alone, Keras among them. Keras' `fit` calls the
package's optimizers from Keras' own code, so they run as written; a
user's own `tf.function` that calls `optimizer.apply` made AutoGraph
rewrite the package's code instead, which it does not need (it never
branches on a tensor's value in Python) and which once failed
(`TypeError: tf___rounds_at_random() takes from 1 to 2 positional
arguments but 3 were given`, a rewritten method called with its `self`
twice). `leave_unconverted` marks each method a class defines the way
`tf.autograph.experimental.do_not_convert` marks a function: AutoGraph's
`is_autograph_artifact` (tensorflow.python.autograph.impl.api) finds the
mark and calls it unconverted. It sets one attribute and imports no
backend.
"""

import inspect

# The attribute `tf.autograph.experimental.do_not_convert` sets on what it
# returns, and AutoGraph's `is_autograph_artifact` looks for.
_MARK = "autograph_info__"


def leave_unconverted(cls):
    """Marks every function `cls` defines (not those it inherits) for
    AutoGraph to call unconverted; returns `cls`."""
    for value in vars(cls).values():
        function = value
        if isinstance(value, (staticmethod, classmethod)):
            function = value.__func__
        elif isinstance(value, property):
            function = value.fget
        if inspect.isfunction(function):
            setattr(function, _MARK, frozenset())
    return cls
