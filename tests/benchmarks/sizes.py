"""What the suite measures and how much of it: full and quick sizes.

Importing this module imports no backend and not Keras.
"""

import dataclasses

BENCHMARKS = (
    "layer_call",
    "loss_scaling",
    "speedup",
    "memory",
    "audit",
    "scaling_cost",
    "low_precision",
    "low_precision_speed",
    "float8",
    "hub_quality",
    "quantized_state_memory",
    "peak_memory",
    "memory_plan",
    "hub_peak_memory",
    "step_buffers",
    "optimizer_step",
)
POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")
MIXED_POLICIES = ("mixed_bfloat16", "mixed_float16")

# The two arms compared everywhere: this package, and Keras' own classes.
PLUGIN = "plugin"
KERAS = "keras"
ARMS = (PLUGIN, KERAS)

# Targets from the issue. Layer calls and training steps: plugin time over
# Keras time, at most. Speed-ups: plugin speed-up over Keras speed-up, at
# least.
TARGETS = {
    "layer_call": 1.05,
    "loss_scaling": 1.02,
    "speedup": 0.98,
    # Step time with a loss-scale optimizer over the bare optimizer.
    "scaling_cost": 1.03,
}


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The sizes of one run of the suite.

    Attributes:
        name: "full" or "quick".
        repeats: Timed repetitions of every training measurement.
        layer_repeats: Timed repetitions of every layer-call measurement.
        layer_calls: Layer calls in one timed repetition.
        layer_shape: The input shape of the layer-call benchmark.
        layer_units: The units of its Dense layer.
        mlp_units: Input features, hidden units..., classes of the MLP.
        mlp_batch: The MLP's batch size.
        conv_image: Height and width of the convnet's images.
        conv_filters: Filters of the convnet's three convolutions.
        conv_batch: The convnet's batch size.
        step_budget: Seconds of training steps wanted in one timed
            repetition (one `fit` epoch) of one model.
        max_steps: The most timed training steps in one repetition.
        memory_batch: Batch size of the activation-heavy model.
        memory_width: Width of its hidden layers.
        memory_depth: Number of its hidden layers.
        memory_steps: Training steps whose peak memory is read.
        memory_repeats: Fresh processes per memory configuration.
        deep_units: Width of the many-tensor model of the scaling cost.
        deep_blocks: Its (Dense + LayerNormalization) blocks.
        deep_batch: Its batch size.
        deep_repeats: Timed repetitions of each of its three arms.
        state_memory_width: Width of the Dense stack of the quantized-state
            memory benchmark.
        state_memory_depth: Its number of Dense layers.
        state_memory_batch: Its batch size.
        state_memory_steps: Training steps whose peak memory is read.
        state_memory_repeats: Fresh processes per configuration.
        peak_width: Width of the Dense stack of the peak-memory benchmark.
        peak_depths: Its depths, one process each (the slope's points).
        peak_batches: Its batch sizes (a slope each).
    """

    name: str
    repeats: int
    layer_repeats: int
    layer_calls: int
    layer_shape: tuple
    layer_units: int
    mlp_units: tuple
    mlp_batch: int
    conv_image: int
    conv_filters: tuple
    conv_batch: int
    step_budget: float
    max_steps: int
    memory_batch: int
    memory_width: int
    memory_depth: int
    memory_steps: int
    memory_repeats: int
    deep_units: int
    deep_blocks: int
    deep_batch: int
    deep_repeats: int
    state_memory_width: int
    state_memory_depth: int
    state_memory_batch: int
    state_memory_steps: int
    state_memory_repeats: int
    peak_width: int
    peak_depths: tuple
    peak_batches: tuple


FULL = Sizes(
    name="full",
    repeats=5,
    layer_repeats=15,
    layer_calls=100,
    layer_shape=(32, 64),
    layer_units=64,
    mlp_units=(784, 512, 512, 10),
    mlp_batch=256,
    conv_image=32,
    conv_filters=(16, 32, 64),
    conv_batch=64,
    step_budget=0.4,
    max_steps=30,
    memory_batch=16384,
    memory_width=256,
    memory_depth=6,
    memory_steps=3,
    memory_repeats=2,
    deep_units=64,
    deep_blocks=48,
    deep_batch=64,
    deep_repeats=15,
    # 12 x (2048 x 2048 + 2048) = 50.36M parameters.
    state_memory_width=2048,
    state_memory_depth=12,
    state_memory_batch=64,
    state_memory_steps=3,
    state_memory_repeats=1,
    # 3, 6 and 12 x (2048 x 2048 + 2048): 12.6M, 25.2M and 50.4M.
    peak_width=2048,
    peak_depths=(3, 6, 12),
    peak_batches=(8, 64),
)

QUICK = Sizes(
    name="quick",
    repeats=5,
    layer_repeats=5,
    layer_calls=20,
    layer_shape=(32, 64),
    layer_units=64,
    mlp_units=(32, 32, 32, 10),
    mlp_batch=32,
    conv_image=8,
    conv_filters=(4, 4, 8),
    conv_batch=8,
    step_budget=0.01,
    max_steps=3,
    memory_batch=256,
    memory_width=32,
    memory_depth=2,
    memory_steps=2,
    memory_repeats=1,
    deep_units=16,
    deep_blocks=4,
    deep_batch=16,
    deep_repeats=3,
    state_memory_width=128,
    state_memory_depth=2,
    state_memory_batch=8,
    state_memory_steps=2,
    state_memory_repeats=1,
    peak_width=128,
    peak_depths=(1, 2, 3),
    peak_batches=(8,),
)


def get_sizes(quick):
    """Returns `QUICK` if `quick` is true, else `FULL`."""
    return QUICK if quick else FULL
