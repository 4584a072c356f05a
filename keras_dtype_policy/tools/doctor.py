"""The `doctor` report: the backend, its devices, and the policy to use."""

import importlib.metadata

import keras

from keras_dtype_policy import backend_dispatch
from keras_dtype_policy.policies import hardware
from keras_dtype_policy.policies import keras_internals
from keras_dtype_policy.tools import advice
from keras_dtype_policy.tools import page_faults
from keras_dtype_policy.tools.tables import format_table
from keras_dtype_policy.tools.tables import wrap

_BACKEND_DISTRIBUTIONS = {
    "jax": ("jax", "jaxlib"),
    "tensorflow": ("tensorflow", "tensorflow-cpu", "tf-nightly"),
    "torch": ("torch",),
}


def build_report():
    """Describes the backend, its devices and the policy they suit.

    Returns:
        A JSON-serializable dict: `backend`, `backend_version`,
        `keras_version`, `keras` (its distribution, the tested range,
        whether the version lies inside it and a verdict in words),
        `devices` (each with its float16 and bfloat16 verdicts),
        `recommended_policy`, `reason`, `demo_policy`, `low_precision`
        (the advice for memory-bound training, or None where it does not
        fit) and `notes`.

    Raises:
        RuntimeError: if the backend cannot list its devices.
    """
    backend = backend_dispatch.name()
    devices = hardware.list_devices(backend)
    policy, reason = hardware.recommend_policy(devices, backend)
    computing = hardware.compute_devices(devices)
    rows = []
    for device in devices:
        float16 = hardware.float16_verdict(device)
        bfloat16 = hardware.bfloat16_verdict(device)
        rows.append(
            {
                "name": device.name,
                "kind": device.kind,
                "description": device.description,
                "compute_capability": None
                if device.compute_capability is None
                else ".".join(map(str, device.compute_capability)),
                "cpu_flags": None
                if device.cpu_flags is None
                else sorted(device.cpu_flags),
                "computes": device in computing,
                "float16": {"speed": float16.speed, "why": float16.reason},
                "bfloat16": {"speed": bfloat16.speed, "why": bfloat16.reason},
            }
        )
    return {
        "backend": backend,
        "backend_version": backend_version(backend),
        "keras_version": keras.__version__,
        "keras": keras_report(),
        "devices": rows,
        "recommended_policy": policy,
        "reason": reason,
        "demo_policy": advice.demo_choice(devices, backend).policy,
        "low_precision": advice.low_precision_advice(devices),
        "notes": _notes(backend, computing),
    }


def keras_report(version=None):
    """Describes the installed Keras against the tested range.

    Args:
        version: A Keras version to judge instead of the installed one.

    Returns:
        A dict: `distribution` (`"keras"`, `"keras-nightly"` or None),
        `tested_range`, `inside_tested_range` (True, False, or None when
        the version cannot be read) and `verdict`.
    """
    inside, verdict = keras_internals.keras_version_status(version)
    return {
        "distribution": keras_internals.keras_distribution(),
        "tested_range": keras_internals.TESTED_KERAS,
        "inside_tested_range": inside,
        "verdict": verdict,
    }


def backend_version(backend):
    """Returns the installed version of the backend's library, or None."""
    for distribution in _BACKEND_DISTRIBUTIONS.get(backend, ()):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def format_report(report):
    """Returns the lines that `doctor` prints for people."""
    version = report["backend_version"] or "version unknown"
    lines = [
        f"backend: {report['backend']} {version} "
        f"(keras {report['keras_version']})",
    ]
    distribution = report["keras"]["distribution"]
    lines += wrap(
        report["keras"]["verdict"]
        + (f" (installed as {distribution})" if distribution else "")
    )
    lines.append("")
    rows = []
    for device in report["devices"]:
        description = device["description"] or "-"
        if device["compute_capability"]:
            description += (
                f" (compute capability {device['compute_capability']})"
            )
        rows.append(
            (
                device["name"] + ("" if device["computes"] else " (idle)"),
                device["kind"],
                description,
                device["float16"]["speed"],
                device["bfloat16"]["speed"],
            )
        )
    lines += format_table(
        ("device", "kind", "model", "float16", "bfloat16"), rows
    )
    lines.append("")
    for device in report["devices"]:
        for dtype in ("float16", "bfloat16"):
            verdict = device[dtype]
            lines += wrap(
                f"{dtype} on {device['name']}: {verdict['speed']}: "
                f"{verdict['why']}"
            )
        if device["cpu_flags"] is not None:
            flags = ", ".join(device["cpu_flags"]) or "none of interest"
            lines.append(f"CPU flags of interest on {device['name']}: {flags}")
    lines += [
        "",
        f"recommended policy: {report['recommended_policy']}",
    ]
    lines += wrap(f"why: {report['reason']}", indent="  ")
    if report.get("low_precision"):
        lines += wrap(f"memory-bound training: {report['low_precision']}")
    if report["notes"]:
        lines.append("")
        for note in report["notes"]:
            lines += wrap(note, bullet="note: ")
    return lines


def _notes(backend, computing):
    notes = []
    on_cpu = all(device.kind == "cpu" for device in computing)
    if on_cpu and backend == "torch":
        notes.append(
            "torch's float16 matmul on a CPU is pathologically slow; Keras' "
            "torch backend computes it in float32 instead"
        )
    if on_cpu and backend == "torch":
        notes.append(_quantized_state_note())
    if on_cpu and backend == "jax":
        note = page_faults.huge_page_note()
        if note:
            notes.append(note)
    if on_cpu:
        notes.append(
            "mixed_float16 trains correctly on a CPU, with loss scaling, "
            "but never faster than float32, and with some backends much "
            "slower: use it there only to try out a GPU setup"
        )
    return notes


def _quantized_state_note():
    """Whether torch can compile the kernels of 8-bit and 4-bit state."""
    torch_kernels = backend_dispatch.module_for("kernels")
    compiler = torch_kernels.c_compiler()
    if not torch_kernels.enabled():
        return (
            f"8-bit and 4-bit optimizer state run eager torch operations "
            f"({torch_kernels.SWITCH}=0 or a failed compile): about twice "
            "as slow as the compiled kernels"
        )
    if compiler is None:
        return (
            "no C++ compiler found, so torch.compile cannot build the "
            "kernels of 8-bit and 4-bit optimizer state: they would run as "
            "eager torch operations, about twice as slow (install g++)"
        )
    return (
        f"8-bit and 4-bit optimizer state use kernels torch.compile builds "
        f"with {compiler} on first use (a few seconds, cached on disk)"
    )
