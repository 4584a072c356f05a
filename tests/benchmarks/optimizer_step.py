"""Benchmark 16: the optimizer step alone, against the memory's bandwidth.

An optimizer step streams over memory: it reads every gradient, reads and
writes every weight and every byte of state. This benchmark times the
step alone (no forward or backward pass: gradients made once, the same
each step), as each backend's trainer runs it (JAX: `stateless_apply`
under `jax.jit` with the weights and state donated; TensorFlow:
`optimizer.apply` in a `tf.function`, as `fit` on a CPU; PyTorch:
`optimizer.apply` eagerly), and divides the bytes the step must move by
its time: its effective bandwidth. Beside it, the same process measures
the machine's stream bandwidth: numpy's copy of a 128 MiB array, and the
backend's own fused triad `a = b + s * c` over 128 MiB arrays. The
configurations are timed side by side, their order alternating.

Importing this module imports no backend; `run` imports Keras.
"""

import numpy as np

from tests.benchmarks import measure
from tests.benchmarks import quantized_state_probe
from tests.benchmarks import stats

WIDTH = 1024
DEPTH = 8
QUICK_DEPTH = 2
STREAM_ELEMENTS = 2**25  # float32: 128 MiB an array
LEARNING_RATE = 1e-4
# Benchmark 10's configurations (name: policy, LowPrecisionOptimizer
# arguments or None), those that keep bfloat16 or float32 weights, and
# the float16 forms.
CONFIGURATIONS = {
    name: quantized_state_probe.CONFIGURATIONS[name]
    for name in (
        "mixed_bfloat16",
        "kahan_bfloat16",
        "stochastic_bfloat16",
        "kahan_bfloat16_8bit",
        "stochastic_bfloat16_8bit",
        "stochastic_bfloat16_4bit",
    )
}
# The float16 forms (benchmark 9's policies): float16 weights, float32
# state, Kahan-compensated or rounded stochastically.
CONFIGURATIONS["kahan_float16"] = ("kahan_float16", None)
CONFIGURATIONS["stochastic_float16"] = ("stochastic_float16", None)


def run(sizes):
    """Benchmark 16's results on the running backend."""
    from tests.benchmarks import backend_support

    depth = QUICK_DEPTH if sizes.name == "quick" else DEPTH
    repeats = max(3, sizes.repeats * 3)
    steps, rows = {}, {}
    for name, (policy, arguments) in CONFIGURATIONS.items():
        step, moved, parameters = _step(policy, arguments, depth)
        steps[name] = measure.timed(step)
        rows[name] = {"bytes_moved": moved, "parameters": parameters}
    samples = measure.interleaved(steps, repeats, warmup=2)
    stream = stream_bandwidth(backend_support.backend(), repeats)
    for name, row in rows.items():
        row["seconds"] = stats.summarize(samples[name])
        row["bandwidth"] = row["bytes_moved"] / row["seconds"]["median"]
        row["of_copy"] = row["bandwidth"] / stream["copy"]
        row["of_triad"] = row["bandwidth"] / stream["triad"]
    reference = rows["mixed_bfloat16"]["seconds"]["median"]
    for row in rows.values():
        row["over_mixed"] = row["seconds"]["median"] / reference
    return {
        "setup": {"width": WIDTH, "depth": depth, "repeats": repeats},
        "stream": stream,
        "rows": rows,
    }


def _step(policy, arguments, depth):
    """(one timed step, bytes it moves, parameters) for a configuration."""
    import keras

    import keras_dtype_policy as kdp
    from tests.benchmarks import low_precision

    keras.utils.clear_session()
    with kdp.policy_scope(policy):
        model = keras.Sequential(
            [keras.Input((WIDTH,))]
            + [keras.layers.Dense(WIDTH) for _ in range(depth)]
        )
    model.compile(
        optimizer=low_precision.make_optimizer(LEARNING_RATE, arguments),
        loss="mean_squared_error",
    )
    variables = model.trainable_variables
    optimizer = model.optimizer
    optimizer.build(variables)
    memory = low_precision.memory_row(model)
    rng = np.random.default_rng(0)
    grads = [
        keras.ops.convert_to_tensor(
            rng.standard_normal(tuple(v.shape)).astype("float32") * 1e-3,
            dtype=v.dtype,
        )
        for v in variables
    ]
    grad_bytes = sum(
        int(np.prod(v.shape)) * np.dtype(_numpy_dtype(v.dtype)).itemsize
        for v in variables
    )
    moved = 2 * memory["weight_bytes"] + 2 * memory["state_bytes"]
    return (
        _backend_step(optimizer, grads, variables),
        moved + grad_bytes,
        memory["parameters"],
    )


def _numpy_dtype(dtype):
    import keras

    name = keras.backend.standardize_dtype(dtype)
    return "float16" if name == "bfloat16" else name


def _backend_step(optimizer, grads, variables):
    """A callable running one step as the backend's trainer runs it."""
    from tests.benchmarks import backend_support

    name = backend_support.backend()
    if name == "jax":
        return _jax_step(optimizer, grads, variables)
    if name == "tensorflow":
        import tensorflow as tf

        applied = tf.function(
            lambda g: optimizer.apply(g, variables), autograph=False
        )

        def step():
            applied(grads)
            backend_support.sync(optimizer.iterations)

        return step

    def step():
        optimizer.apply(grads, variables)
        backend_support.sync(optimizer.iterations)

    return step


def _jax_step(optimizer, grads, variables):
    import jax

    def apply(trainable, optimizer_values, grads):
        return optimizer.stateless_apply(optimizer_values, grads, trainable)

    compiled = jax.jit(apply, donate_argnums=(0, 1))
    state = {
        "trainable": [v.value for v in variables],
        "optimizer": [v.value for v in optimizer.variables],
    }

    def step():
        trainable, values = compiled(
            state["trainable"], state["optimizer"], grads
        )
        jax.block_until_ready(trainable)
        state["trainable"], state["optimizer"] = trainable, values

    return step


def stream_bandwidth(backend, repeats):
    """Bytes a second of a copy (numpy) and a triad (the backend's own).

    Returns:
        A dict: `copy` and `triad` in bytes a second (the medians), and
        their samples.
    """
    source = np.ones(STREAM_ELEMENTS, "float32")
    target = np.empty_like(source)
    triad = _triad(backend)
    samples = measure.interleaved(
        {
            "copy": measure.timed(lambda: np.copyto(target, source)),
            "triad": measure.timed(triad),
        },
        repeats,
        warmup=2,
    )
    array_bytes = source.nbytes
    copy = stats.summarize(samples["copy"])
    fused = stats.summarize(samples["triad"])
    return {
        "copy": 2 * array_bytes / copy["median"],
        "triad": 3 * array_bytes / fused["median"],
        "copy_seconds": copy,
        "triad_seconds": fused,
    }


def _triad(backend):
    """A callable computing `a = b + 3 * c` over float32 arrays once."""
    if backend == "jax":
        import jax
        import jax.numpy as jnp

        b = jnp.ones(STREAM_ELEMENTS, "float32")
        c = jnp.ones(STREAM_ELEMENTS, "float32")
        fused = jax.jit(lambda b, c: b + 3.0 * c)
        return lambda: jax.block_until_ready(fused(b, c))
    if backend == "tensorflow":
        import tensorflow as tf

        b = tf.ones(STREAM_ELEMENTS, "float32")
        c = tf.ones(STREAM_ELEMENTS, "float32")
        fused = tf.function(lambda b, c: b + 3.0 * c, jit_compile=True)
        return lambda: fused(b, c).numpy()
    import torch

    b = torch.ones(STREAM_ELEMENTS)
    c = torch.ones(STREAM_ELEMENTS)
    a = torch.empty(STREAM_ELEMENTS)
    return lambda: torch.add(b, c, alpha=3.0, out=a)
