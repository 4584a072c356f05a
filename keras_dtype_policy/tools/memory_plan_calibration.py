"""What a training step costs beyond its variables, as measured.

A step's peak is more than its weights, gradients and optimizer state:
the backend casts, copies and fuses, and the process itself costs memory
before the model exists. Neither follows from first principles, so both
come from measurements: benchmark 12 (`tests/benchmarks/peak_memory.py`)
trained Dense stacks 2048 wide, 3, 6 and 12 layers deep, at batch 8 with
Adam, one fresh process a size, and fitted the process's peak resident
memory against the parameter count. Here, for each backend and
configuration:

- working set, bytes a parameter: the slope less the ideal (weights, one
  gradient a weight and the optimizer state). Negative where the backend
  never holds every gradient at once (XLA fuses each gradient into its
  update on JAX and TensorFlow at float32).
- baseline, MiB: the intercept, what the process holds with no model:
  the interpreter, Keras, the backend and its compiled code.

Measured on a 2-core Intel Xeon @ 2.50GHz (one core used, one thread),
keras 3.15.1, jax 0.10.2, torch 2.13.0+cpu, tensorflow-cpu 2.21.0, on the
CPU. A GPU or another machine differs: there the figures are this CPU's.
"""

MIB = 2**20
# The machine the figures were measured on, as the plan reports it.
MACHINE = (
    "2-core Intel Xeon @ 2.50GHz, CPU, keras 3.15.1, jax 0.10.2, "
    "torch 2.13.0+cpu, tensorflow-cpu 2.21.0, batch 8"
)
# The backend whose figures stand in for a backend not measured.
FALLBACK_BACKEND = "jax"

# backend: configuration: (working set in bytes a parameter, baseline MiB).
CPU_STEP_COSTS = {
    "jax": {
        "float32": (-3.80, 425),
        "mixed_bfloat16": (0.15, 403),
        "kahan_bfloat16": (4.08, 406),
        "stochastic_bfloat16": (5.16, 390),
        "stochastic_bfloat16_8bit": (4.30, 427),
        "kahan_bfloat16_8bit": (3.28, 456),
        "mixed_bfloat16_8bit": (1.35, 429),
        "stochastic_bfloat16_4bit": (4.26, 427),
    },
    "tensorflow": {
        "float32": (-3.08, 673),
        "mixed_bfloat16": (-0.90, 652),
        "kahan_bfloat16": (3.66, 725),
        "stochastic_bfloat16": (4.98, 708),
        "stochastic_bfloat16_8bit": (5.79, 731),
        "kahan_bfloat16_8bit": (4.17, 775),
        "mixed_bfloat16_8bit": (5.41, 742),
        "stochastic_bfloat16_4bit": (6.90, 725),
    },
    # Keras' own step on PyTorch with float32 weights peaks at about twice
    # the ideal; the package's fused low-precision steps do not.
    "torch": {
        "float32": (17.34, 448),
        "mixed_bfloat16": (16.00, 476),
        "kahan_bfloat16": (3.01, 532),
        "stochastic_bfloat16": (2.01, 535),
        "stochastic_bfloat16_8bit": (1.06, 552),
        "kahan_bfloat16_8bit": (2.48, 530),
        "mixed_bfloat16_8bit": (5.32, 530),
        "stochastic_bfloat16_4bit": (1.68, 568),
    },
}


def step_costs(backend, configuration):
    """Returns `(working set a parameter, baseline bytes, measured)`.

    Args:
        backend: A Keras backend name.
        configuration: A name of `memory_plan.CONFIGURATIONS`.

    Returns:
        The working set in bytes a parameter, the baseline in bytes, and
        whether they were measured on this backend (False: another
        backend's stand in).
    """
    measured = backend in CPU_STEP_COSTS
    costs = CPU_STEP_COSTS[backend if measured else FALLBACK_BACKEND]
    working_set, baseline = costs[configuration]
    return working_set, baseline * MIB, measured
