"""Made-up devices for the hardware advice tests: CPUs and NVIDIA GPUs."""

from keras_dtype_policy.policies.hardware import Device

CPU_BF16 = Device(
    "cpu:0", "cpu", "Xeon", cpu_flags=frozenset({"avx512_bf16", "amx_bf16"})
)
CPU_PLAIN = Device("cpu:0", "cpu", "Old CPU", cpu_flags=frozenset({"f16c"}))
CPU_UNKNOWN = Device("cpu:0", "cpu", "Some CPU", cpu_flags=None)


def nvidia(major, minor, index=0):
    """Returns an NVIDIA GPU of compute capability `major.minor`."""
    return Device(
        f"cuda:{index}",
        "gpu",
        f"NVIDIA GPU {major}.{minor}",
        vendor="nvidia",
        compute_capability=(major, minor),
    )
