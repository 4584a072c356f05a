"""What a training step costs beyond its variables, as measured.

A step's peak is more than its weights, gradients and optimizer state:
the backend casts, copies, compiles and fuses, and the process itself
costs memory before the model exists. Neither follows from first
principles, so both come from measurements: benchmark 12
(`tests/benchmarks/peak_memory.py`) trained Dense stacks 2048 wide, 3, 6
and 12 layers deep, and 512 wide, 8 and 32 deep, at batch 8 with Adam,
one fresh process a size, and the process's peak resident memory less
the ideal (weights, one gradient a weight and the optimizer state) was
fitted by least squares as a baseline plus a cost a parameter plus a
cost a trainable variable. Here, for each backend and configuration:

- working set a parameter, bytes: negative where the backend never holds
  every gradient at once (XLA fuses each gradient into its update).
- working set a variable, bytes: what each trainable variable adds
  whatever its size (under the package's optimizer, some 5 MiB
  each on JAX, under 1 MiB on TensorFlow: its per-variable steps).
- baseline, MiB: what the process holds with no model: the interpreter,
  Keras, the backend and its compiled code.
- embedding tables (JAX and TensorFlow): bytes an element of each
  Embedding layer's table and MiB a table, fitted on Embedding models
  (below); the Dense stacks have no such table.

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

# backend: configuration: (working set a parameter in bytes, working set a
# trainable variable in MiB, baseline in MiB).
CPU_STEP_COSTS = {
    "jax": {
        "float32": (-3.50, 0.07, 413),  # residual <= 11 MiB
        "mixed_bfloat16": (-0.18, 0.44, 406),  # residual <= 4 MiB
        "kahan_bfloat16": (1.68, 4.61, 409),  # residual <= 3 MiB
        "stochastic_bfloat16": (1.63, 6.78, 396),  # residual <= 5 MiB
        "stochastic_bfloat16_8bit": (1.90, 4.99, 424),  # residual <= 4 MiB
        "kahan_bfloat16_8bit": (2.05, 2.70, 452),  # residual <= 5 MiB
        "mixed_bfloat16_8bit": (0.00, 2.85, 426),  # residual <= 4 MiB
        "stochastic_bfloat16_4bit": (1.77, 5.10, 425),  # residual <= 3 MiB
    },
    # Since its group computations are shared (four variables at most,
    # one computation for groups of the same shapes), the package's step
    # costs under 1 MiB a trainable variable here (12-21 MiB before).
    "tensorflow": {
        "float32": (-1.05, -0.40, 661),  # residual <= 36 MiB
        "mixed_bfloat16": (-0.41, 0.32, 627),  # residual <= 15 MiB
        "kahan_bfloat16": (0.08, 0.41, 738),  # residual <= 8 MiB
        "stochastic_bfloat16": (-0.11, 0.59, 735),  # residual <= 10 MiB
        "stochastic_bfloat16_8bit": (0.32, 0.39, 756),  # residual <= 6 MiB
        "kahan_bfloat16_8bit": (0.51, -0.11, 776),  # residual <= 21 MiB
        "mixed_bfloat16_8bit": (1.67, 0.20, 741),  # residual <= 9 MiB
        "stochastic_bfloat16_4bit": (0.45, 0.43, 763),  # residual <= 4 MiB
    },
    # Keras' own step on PyTorch with float32 weights peaks at about twice
    # the ideal; the package's fused low-precision steps do not. No cost a
    # variable above the noise (the fit gives -0.7 to 0.05 MiB): width
    # 2048's slope and intercept alone.
    "torch": {
        "float32": (17.34, 0.0, 448),
        "mixed_bfloat16": (16.00, 0.0, 476),
        "kahan_bfloat16": (3.01, 0.0, 532),
        "stochastic_bfloat16": (2.01, 0.0, 535),
        "stochastic_bfloat16_8bit": (1.06, 0.0, 552),
        "kahan_bfloat16_8bit": (2.48, 0.0, 530),
        "mixed_bfloat16_8bit": (5.32, 0.0, 530),
        "stochastic_bfloat16_4bit": (1.68, 0.0, 568),
    },
}


# An embedding table's step on JAX and TensorFlow makes temporaries of the
# whole table (its dense gradient, scattered from the looked-up rows, and
# the update over it) that no Dense stack has. Fitted on an Embedding of
# 50,000 rows 256 and 768 wide (12.8M and 38.4M elements) under four Dense
# layers, batch 64 of 64 tokens, as the peak less the prediction without
# it: bytes an element of the table and MiB a table. PyTorch's embedding
# step needs none (its plan was within 9% without it).
# backend: configuration: (bytes a table element, MiB a table).
CPU_EMBEDDING_COSTS = {
    "jax": {
        "float32": (6.35, 30),
        "mixed_bfloat16": (3.54, 50),
        "kahan_bfloat16": (5.02, 15),
        "stochastic_bfloat16": (4.24, 19),
        "stochastic_bfloat16_8bit": (10.81, 31),
        "kahan_bfloat16_8bit": (15.07, 19),
        "mixed_bfloat16_8bit": (11.19, 15),
        "stochastic_bfloat16_4bit": (9.95, 21),
    },
    # kahan_bfloat16_8bit's steady steps at 256 wide peaked 172 MiB above
    # its first (1296 against 1124 MiB, twice): hence its MiB a table.
    "tensorflow": {
        "float32": (9.79, 7),
        "mixed_bfloat16": (9.46, 38),
        "kahan_bfloat16": (8.53, 38),
        "stochastic_bfloat16": (4.43, 51),
        "stochastic_bfloat16_8bit": (17.14, 4),
        "kahan_bfloat16_8bit": (11.07, 274),
        "mixed_bfloat16_8bit": (16.47, 0),
        "stochastic_bfloat16_4bit": (13.46, 17),
    },
}


def embedding_costs(backend, configuration):
    """Returns `(bytes a table element, bytes a table)` of the embedding
    tables' step on `backend` (zeros where none was measured beyond the
    Dense stacks' fit)."""
    measured = backend in CPU_STEP_COSTS
    costs = CPU_EMBEDDING_COSTS.get(backend if measured else FALLBACK_BACKEND)
    per_element, per_table = (costs or {}).get(configuration, (0.0, 0.0))
    return per_element, per_table * MIB


def step_costs(backend, configuration):
    """Returns `(bytes a parameter, bytes a variable, baseline, measured)`.

    Args:
        backend: A Keras backend name.
        configuration: A name of `memory_plan.CONFIGURATIONS`.

    Returns:
        The working set in bytes a parameter and a trainable variable,
        the baseline in bytes, and whether they were measured on this
        backend (False: another backend's stand in).
    """
    measured = backend in CPU_STEP_COSTS
    costs = CPU_STEP_COSTS[backend if measured else FALLBACK_BACKEND]
    per_parameter, per_variable, baseline = costs[configuration]
    return per_parameter, per_variable * MIB, baseline * MIB, measured
