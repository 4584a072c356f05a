"""What the hardware is, and whether it computes float16 and bfloat16 fast.

The devices are those the running Keras backend sees, found through the
backend's own library (`jax.devices()`, `tf.config`, `torch.cuda`), which is
imported inside the functions only: importing this module imports none.
The answers are cached per backend, since they cannot change within a
process.

The rules, as tf.keras and the vendors state them:

- NVIDIA GPUs compute float16 fast from compute capability 7.0 (Volta's
  Tensor Cores) and bfloat16 from 8.0 (Ampere);
- TPUs compute bfloat16 natively, float16 not;
- CPUs compute float16 no faster than float32 (and torch's CPU float16
  matmul is pathologically slow); bfloat16 is fast on CPUs with AVX512_BF16
  or AMX (x86) or BF16 (Arm), as /proc/cpuinfo reports them.

Setting a global policy that computes in float16 where that is slow warns
once per process with a `SlowFloat16Warning`.
"""

import dataclasses
import functools
import platform
import warnings

from keras_dtype_policy import backend_dispatch

FAST = "fast"
SLOW = "slow"
UNKNOWN = "unknown"

# CPU flags (lower case, as in /proc/cpuinfo) that make bfloat16 fast.
BFLOAT16_CPU_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")
# The flags a `Device` keeps: those above and the float16 ones.
CPU_FLAGS_OF_INTEREST = (
    *BFLOAT16_CPU_FLAGS,
    "amx_fp16",
    "avx512_fp16",
    "avx512f",
    "f16c",
    "fphp",
)
FLOAT16_TENSOR_CORES = (7, 0)
BFLOAT16_TENSOR_CORES = (8, 0)
_CPUINFO = "/proc/cpuinfo"


class SlowFloat16Warning(UserWarning):
    """A float16 policy was set where float16 computations are slow.

    Silence it the usual way:

    >>> warnings.filterwarnings(
    ...     "ignore", category=keras_dtype_policy.SlowFloat16Warning
    ... )
    """


@dataclasses.dataclass(frozen=True)
class Device:
    """One device the backend can compute on.

    Attributes:
        name: The backend's name for it, such as `"cuda:0"` or `"cpu:0"`.
        kind: `"cpu"`, `"gpu"` or `"tpu"`.
        description: The model name, such as `"NVIDIA A100-SXM4-40GB"`.
        vendor: `"nvidia"`, `"amd"`, `"apple"`, or None if unknown.
        compute_capability: `(major, minor)` for NVIDIA GPUs, else None.
        cpu_flags: For CPUs, those of `CPU_FLAGS_OF_INTEREST` it has, or
            None where the flags cannot be read.
    """

    name: str
    kind: str
    description: str = ""
    vendor: str | None = None
    compute_capability: tuple | None = None
    cpu_flags: frozenset | None = None


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Whether a device computes a dtype fast, and why.

    Attributes:
        speed: `FAST`, `SLOW` or `UNKNOWN`.
        reason: One sentence for people.
    """

    speed: str
    reason: str


def float16_verdict(device):
    """Returns whether `device` computes float16 fast, and why."""
    if device.kind == "cpu":
        return Verdict(SLOW, "CPUs compute float16 no faster than float32")
    if device.kind == "tpu":
        return Verdict(SLOW, "TPUs compute bfloat16 natively, not float16")
    if device.compute_capability is not None:
        capability = _capability_text(device.compute_capability)
        if tuple(device.compute_capability) >= FLOAT16_TENSOR_CORES:
            return Verdict(
                FAST, f"compute capability {capability}: float16 Tensor Cores"
            )
        return Verdict(
            SLOW,
            f"compute capability {capability}: float16 Tensor Cores need 7.0 "
            "or higher",
        )
    if device.vendor in ("amd", "apple"):
        return Verdict(FAST, f"{device.vendor} GPUs compute float16 natively")
    return Verdict(UNKNOWN, "the GPU's capabilities are not known")


def bfloat16_verdict(device):
    """Returns whether `device` computes bfloat16 fast, and why."""
    if device.kind == "cpu":
        if device.cpu_flags is None:
            return Verdict(UNKNOWN, "the CPU's flags cannot be read here")
        found = [f for f in BFLOAT16_CPU_FLAGS if f in device.cpu_flags]
        if found:
            return Verdict(
                FAST, "the CPU has " + ", ".join(f.upper() for f in found)
            )
        return Verdict(
            SLOW, "the CPU has neither AVX512_BF16 nor AMX: emulated"
        )
    if device.kind == "tpu":
        return Verdict(FAST, "TPUs compute bfloat16 natively")
    if device.compute_capability is not None:
        capability = _capability_text(device.compute_capability)
        if tuple(device.compute_capability) >= BFLOAT16_TENSOR_CORES:
            return Verdict(
                FAST,
                f"compute capability {capability}: bfloat16 Tensor Cores",
            )
        return Verdict(
            SLOW,
            f"compute capability {capability}: bfloat16 Tensor Cores need "
            "8.0 or higher",
        )
    return Verdict(UNKNOWN, "the GPU's bfloat16 support is not known")


def compute_devices(devices):
    """Returns the devices Keras computes on: the accelerators, else CPUs."""
    accelerators = [d for d in devices if d.kind != "cpu"]
    return accelerators or [d for d in devices if d.kind == "cpu"]


def recommend_policy(devices, backend=None):
    """Returns the policy name this hardware trains best under, and why.

    Args:
        devices: The `Device`s of the backend, as `list_devices` gives them.
        backend: The backend name; defaults to the running one.

    Returns:
        A `(policy_name, reason)` pair.
    """
    backend = backend or backend_dispatch.name()
    targets = compute_devices(devices)
    if not targets:
        return "float32", "no device was found"
    bfloat16 = [bfloat16_verdict(d).speed for d in targets]
    float16 = [float16_verdict(d).speed for d in targets]
    if targets[0].kind == "cpu":
        if all(s == FAST for s in bfloat16):
            if backend == "jax":
                return (
                    "float32",
                    "the CPU computes bfloat16 fast, but XLA's CPU compiler "
                    "does not use it (measured: no speed-up); "
                    "mixed_bfloat16 still halves activation memory",
                )
            return (
                "mixed_bfloat16",
                "the CPU computes bfloat16 fast; float16 is slow on CPUs",
            )
        return (
            "float32",
            "this CPU computes neither float16 nor bfloat16 faster than "
            "float32",
        )
    if all(s == FAST for s in bfloat16):
        return (
            "mixed_bfloat16",
            "bfloat16 is fast here and has float32's range: no loss "
            "scaling needed",
        )
    if all(s == FAST for s in float16):
        return (
            "mixed_float16",
            "float16 is fast here (with dynamic loss scaling); bfloat16 is not",
        )
    return "float32", "neither float16 nor bfloat16 is known to be fast here"


def demo_policy(devices):
    """Returns the demo's default policy: mixed_float16 where it is fast."""
    targets = compute_devices(devices)
    if targets and all(float16_verdict(d).speed == FAST for d in targets):
        return "mixed_float16"
    return "mixed_bfloat16"


def list_devices(backend=None):
    """Returns the devices the backend sees, CPUs included, as a tuple.

    Args:
        backend: `"jax"`, `"tensorflow"` or `"torch"`; defaults to the
            running Keras backend.

    Raises:
        RuntimeError: if the backend's library cannot list its devices.
    """
    return _list_devices(backend or backend_dispatch.name())


@functools.cache
def _list_devices(backend):
    finders = {
        "jax": _jax_devices,
        "tensorflow": _tensorflow_devices,
        "torch": _torch_devices,
    }
    finder = finders.get(backend)
    if finder is None:
        return (cpu_device(),)
    try:
        return tuple(finder())
    except Exception as error:
        raise RuntimeError(
            f"The {backend} backend could not list its devices: "
            f"{type(error).__name__}: {error}"
        ) from error


def clear_cache():
    """Forgets the devices found and whether the warning was given."""
    global _warned
    _list_devices.cache_clear()
    read_cpu_info.cache_clear()
    _warned = False


def _jax_devices():
    import jax

    devices = [cpu_device()]
    for device in jax.devices():
        if device.platform == "cpu":
            continue
        capability = _parse_capability(
            getattr(device, "compute_capability", None)
        )
        devices.append(
            Device(
                name=f"{device.platform}:{device.id}",
                kind="tpu" if device.platform == "tpu" else "gpu",
                description=getattr(device, "device_kind", ""),
                vendor="nvidia" if capability else _jax_vendor(device),
                compute_capability=capability,
            )
        )
    return devices


def _jax_vendor(device):
    version = str(getattr(device.client, "platform_version", "")).lower()
    if "rocm" in version or "hip" in version:
        return "amd"
    return None


def _tensorflow_devices():
    import tensorflow as tf

    devices = [cpu_device()]
    for index, gpu in enumerate(tf.config.list_physical_devices("GPU")):
        details = tf.config.experimental.get_device_details(gpu)
        capability = _parse_capability(details.get("compute_capability"))
        devices.append(
            Device(
                name=f"GPU:{index}",
                kind="gpu",
                description=details.get("device_name", gpu.name),
                vendor="nvidia" if capability else None,
                compute_capability=capability,
            )
        )
    for index, _ in enumerate(tf.config.list_physical_devices("TPU")):
        devices.append(Device(name=f"TPU:{index}", kind="tpu"))
    return devices


def _torch_devices():
    import torch

    devices = [cpu_device()]
    if torch.cuda.is_available():
        amd = getattr(torch.version, "hip", None) is not None
        for index in range(torch.cuda.device_count()):
            devices.append(
                Device(
                    name=f"cuda:{index}",
                    kind="gpu",
                    description=torch.cuda.get_device_name(index),
                    vendor="amd" if amd else "nvidia",
                    compute_capability=None
                    if amd
                    else tuple(torch.cuda.get_device_capability(index)),
                )
            )
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        devices.append(
            Device(
                name="mps:0",
                kind="gpu",
                description="Apple GPU",
                vendor="apple",
            )
        )
    return devices


def cpu_device():
    """Returns the machine's CPU as a `Device`."""
    model_name, flags = read_cpu_info()
    return Device(
        name="cpu:0",
        kind="cpu",
        description=model_name or platform.processor() or platform.machine(),
        cpu_flags=None
        if flags is None
        else frozenset(f for f in CPU_FLAGS_OF_INTEREST if f in flags),
    )


@functools.cache
def read_cpu_info(path=_CPUINFO):
    """Returns the CPU's model name and its flags from /proc/cpuinfo.

    Returns:
        A `(model_name, flags)` pair: a string (empty if unknown) and a
        frozenset of lower-case flags, or None where the file is missing or
        lists none (as outside Linux).
    """
    model_name = ""
    flags = None
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key in ("model name", "cpu model") and not model_name:
                    model_name = value.strip()
                elif key in ("flags", "features") and flags is None:
                    flags = frozenset(value.lower().split())
                if model_name and flags is not None:
                    break
    except OSError:
        pass
    return model_name, flags


def _parse_capability(capability):
    """Returns `(major, minor)` from "8.6" or (8, 6); None if not NVIDIA's."""
    if capability is None:
        return None
    if isinstance(capability, str):
        capability = capability.split(".")
    try:
        parts = tuple(int(part) for part in capability)
    except (TypeError, ValueError):
        return None  # such as AMD's "gfx90a"
    return (parts + (0,))[:2] if parts else None


def _capability_text(capability):
    return ".".join(str(part) for part in capability)


# Whether the SlowFloat16Warning was given in this process.
_warned = False


def warn_if_float16_is_slow(policy, stacklevel=3):
    """Warns, once per process, if `policy` computes in slow float16.

    Called where a global policy is set. Never raises for lack of device
    information: if the devices cannot be listed, it says nothing.

    Args:
        policy: The policy being set (a `keras.DTypePolicy`).
        stacklevel: Passed to `warnings.warn`, to point at the caller.
    """
    global _warned
    if _warned or getattr(policy, "compute_dtype", None) != "float16":
        return
    try:
        devices = list_devices()
    except RuntimeError:
        return
    slow = [
        (device, verdict)
        for device in compute_devices(devices)
        for verdict in [float16_verdict(device)]
        if verdict.speed == SLOW
    ]
    if not slow:
        return
    _warned = True
    where = "; ".join(
        f"{device.name} ({device.description}): {verdict.reason}"
        if device.description
        else f"{device.name}: {verdict.reason}"
        for device, verdict in slow
    )
    advice, _ = recommend_policy(devices)
    warnings.warn(
        f"The dtype policy {policy.name!r} computes in float16, which is "
        f"slow here: {where}. Consider {advice!r} "
        "(`keras-dtype-policy doctor` explains). Silence this with "
        "warnings.filterwarnings('ignore', "
        "category=keras_dtype_policy.SlowFloat16Warning).",
        SlowFloat16Warning,
        stacklevel=stacklevel,
    )
