"""Benchmark 15: the buffers XLA assigns to Keras' compiled training step.

On JAX, `fit` runs one XLA computation a step (`jax.jit` of
`Model.train_step`, the state donated). XLA's buffer assignment says, before
anything runs, how many bytes that computation takes: its arguments (the
weights, optimizer state and batch), how many of those its outputs reuse
(donated, so no second copy of the state is made) and its temporaries (the
gradients and whatever else the step holds at its peak). This benchmark
compiles the step of stacks of Dense layers of two depths and reports, per
configuration, the bytes a parameter of each (the difference between the
two sizes over the difference of their parameter counts, which cancels
what does not grow with the model). Nothing is timed and nothing is run
beyond one step that builds the optimizer.

It is the evidence, per configuration, that the step's working set is the
gradients and no more (issue #43); the process's resident peak (benchmark
12) adds what XLA's runtime and the CPU's kernels keep outside it.

Importing this module imports no backend; `run` imports Keras.
"""

WIDTH = 1024
DEPTHS = (2, 4)
BATCH = 8
LEARNING_RATE = 1e-4
SKIPPED = (
    "XLA's buffer assignment of Keras' compiled step is read on the JAX "
    "backend only (TensorFlow compiles `fit` to a graph, not one XLA "
    "computation, unless jit_compile=True; PyTorch runs eagerly)"
)


def configurations():
    """`{name: (policy, LowPrecisionOptimizer arguments or None)}`."""
    from tests.benchmarks.quantized_state_probe import CONFIGURATIONS

    names = {
        name: value for name, value in CONFIGURATIONS.items() if "+" not in name
    }
    # Keras' own bfloat16 policy with its Adam (bfloat16 state), and the
    # float16 forms, whose loss scale sees every gradient before any update.
    names["bfloat16"] = ("bfloat16", None)
    names["mixed_float16"] = ("mixed_float16", None)
    names["kahan_float16"] = ("kahan_float16", None)
    names["stochastic_float16"] = ("stochastic_float16", None)
    return names


def compiled_step_bytes(policy, arguments, depth, width=WIDTH, batch=BATCH):
    """Bytes of Keras' compiled JAX step for one model.

    Args:
        policy: The global policy name the model is built under.
        arguments: `LowPrecisionOptimizer` arguments, or None for Adam as
            the policy gives it (bare, or wrapped by the compile hook).
        depth: How many Dense layers `width` wide.
        width: Their width.
        batch: The batch the step is compiled for.

    Returns:
        A dict: `parameters`, and XLA's `arguments`, `aliased` (argument
        bytes the outputs reuse) and `temporaries`, in bytes.
    """
    import jax
    import keras
    import numpy as np

    import keras_dtype_policy as kdp
    from tests.benchmarks import low_precision

    with kdp.policy_scope(policy):
        model = keras.Sequential(
            [keras.Input((width,))]
            + [keras.layers.Dense(width) for _ in range(depth)]
        )
    model.compile(
        optimizer=low_precision.make_optimizer(LEARNING_RATE, arguments),
        loss="mean_squared_error",
    )
    x = np.ones((batch, width), "float32")
    model.train_on_batch(x, x)
    state = model._get_jax_state(
        trainable_variables=True,
        non_trainable_variables=True,
        optimizer_variables=True,
        metrics_variables=True,
    )
    step = jax.jit(model.train_step, donate_argnums=0)
    stats = step.lower(state, (x, x)).compile().memory_analysis()
    return {
        "parameters": model.count_params(),
        "arguments": stats.argument_size_in_bytes,
        "aliased": stats.alias_size_in_bytes,
        "temporaries": stats.temp_size_in_bytes,
    }


def per_parameter(small, large):
    """Bytes a parameter of each measure, between two model sizes."""
    added = large["parameters"] - small["parameters"]
    return {
        key: (large[key] - small[key]) / added
        for key in ("arguments", "aliased", "temporaries")
    }


def run(backend, sizes=None):
    """Benchmark 15's results for `backend` (JAX only)."""
    if backend != "jax":
        return {"skipped": SKIPPED}
    import keras

    rows = {}
    for name, (policy, arguments) in configurations().items():
        measured = []
        for depth in DEPTHS:
            keras.utils.clear_session()
            measured.append(compiled_step_bytes(policy, arguments, depth))
        rows[name] = {
            "policy": policy,
            "arguments": arguments,
            "sizes": measured,
            "per_parameter": per_parameter(*measured),
        }
    return {
        "setup": {"width": WIDTH, "depths": DEPTHS, "batch": BATCH},
        "rows": rows,
    }
