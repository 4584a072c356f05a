"""Hardware advice: the speed rules, the recommendation, and the warning.

The rules are checked on made-up devices; the warning on made-up devices
and, where this machine computes on its CPU, on the real one.
"""

import warnings

import keras
import pytest
from made_up_devices import CPU_BF16
from made_up_devices import CPU_PLAIN
from made_up_devices import CPU_UNKNOWN
from made_up_devices import nvidia

import keras_dtype_policy as kdp
from keras_dtype_policy.policies import hardware
from keras_dtype_policy.policies.hardware import Device

BACKEND = keras.backend.backend()


@pytest.fixture(autouse=True)
def fresh_hardware_state():
    """Each test sees the warning as not yet given, and real devices."""
    hardware.clear_cache()
    yield
    hardware.clear_cache()


def fake_devices(monkeypatch, *devices):
    monkeypatch.setattr(hardware, "list_devices", lambda backend=None: devices)


@pytest.mark.parametrize(
    "device, float16, bfloat16",
    [
        (CPU_BF16, "slow", "fast"),
        (CPU_PLAIN, "slow", "slow"),
        (CPU_UNKNOWN, "slow", "unknown"),
        (nvidia(6, 1), "slow", "slow"),
        (nvidia(7, 0), "fast", "slow"),
        (nvidia(7, 5), "fast", "slow"),
        (nvidia(8, 0), "fast", "fast"),
        (nvidia(9, 0), "fast", "fast"),
        (Device("tpu:0", "tpu", "TPU v4"), "slow", "fast"),
        (Device("gpu:0", "gpu", "MI250", vendor="amd"), "fast", "unknown"),
        (Device("gpu:0", "gpu", "mystery"), "unknown", "unknown"),
    ],
)
def test_speed_rules(device, float16, bfloat16):
    assert hardware.float16_verdict(device).speed == float16
    assert hardware.bfloat16_verdict(device).speed == bfloat16


def test_verdicts_say_why():
    assert "7.0" in hardware.float16_verdict(nvidia(6, 1)).reason
    assert "6.1" in hardware.float16_verdict(nvidia(6, 1)).reason
    assert "8.0" in hardware.bfloat16_verdict(nvidia(7, 5)).reason
    reason = hardware.bfloat16_verdict(CPU_BF16).reason
    assert "AMX_BF16" in reason and "AVX512_BF16" in reason


@pytest.mark.parametrize(
    "devices, backend, expected",
    [
        ((CPU_BF16,), "torch", "mixed_bfloat16"),
        ((CPU_BF16,), "tensorflow", "mixed_bfloat16"),
        # XLA's CPU compiler gains nothing from bfloat16 (measured).
        ((CPU_BF16,), "jax", "float32"),
        ((CPU_PLAIN,), "torch", "float32"),
        ((CPU_UNKNOWN,), "tensorflow", "float32"),
        ((CPU_PLAIN, nvidia(8, 6)), "jax", "mixed_bfloat16"),
        ((CPU_PLAIN, nvidia(7, 5)), "torch", "mixed_float16"),
        ((CPU_BF16, nvidia(6, 0)), "tensorflow", "float32"),
        ((CPU_PLAIN, nvidia(8, 0), nvidia(7, 0, 1)), "jax", "mixed_float16"),
        ((CPU_PLAIN, Device("tpu:0", "tpu")), "jax", "mixed_bfloat16"),
    ],
)
def test_recommended_policy(devices, backend, expected):
    policy, reason = hardware.recommend_policy(devices, backend)
    assert policy == expected
    assert reason


@pytest.mark.parametrize(
    "devices, expected",
    [
        ((CPU_BF16,), "mixed_bfloat16"),
        ((CPU_PLAIN, nvidia(7, 0)), "mixed_float16"),
        ((CPU_PLAIN, nvidia(6, 1)), "mixed_bfloat16"),
    ],
)
def test_demo_policy_is_mixed_float16_only_where_it_is_fast(devices, expected):
    assert hardware.demo_policy(devices) == expected


def test_compute_devices_prefer_accelerators():
    assert hardware.compute_devices((CPU_PLAIN, nvidia(8, 0))) == [nvidia(8, 0)]
    assert hardware.compute_devices((CPU_PLAIN,)) == [CPU_PLAIN]


def test_read_cpu_info(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nmodel name\t: Test CPU 9000\n"
        "flags\t\t: fpu avx512f AVX512_BF16 amx_bf16\n\n"
        "processor\t: 1\nmodel name\t: Test CPU 9000\nflags\t\t: fpu\n"
    )
    name, flags = hardware.read_cpu_info(str(cpuinfo))
    assert name == "Test CPU 9000"
    assert {"avx512f", "avx512_bf16", "amx_bf16"} <= flags
    assert hardware.read_cpu_info(str(tmp_path / "missing")) == ("", None)


def test_the_backend_lists_a_cpu_and_its_devices():
    devices = hardware.list_devices()
    assert devices[0].kind == "cpu"
    assert all(d.kind in ("cpu", "gpu", "tpu") for d in devices)
    assert hardware.list_devices() is devices  # cached


@pytest.mark.parametrize(
    "set_policy",
    [
        kdp.set_dtype_policy,
        kdp.set_policy,
        kdp.mixed_precision.set_global_policy,
        lambda name: kdp.policy_scope(name).__enter__(),
    ],
    ids=["set_dtype_policy", "set_policy", "set_global_policy", "policy_scope"],
)
def test_float16_on_a_cpu_warns_once_pointing_at_the_caller(
    set_policy, monkeypatch
):
    fake_devices(monkeypatch, CPU_BF16)
    with pytest.warns(kdp.SlowFloat16Warning) as caught:
        set_policy("mixed_float16")
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "'mixed_float16' computes in float16" in message
    assert "cpu:0" in message and "SlowFloat16Warning" in message
    assert caught[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        set_policy("mixed_float16")  # once per process
        set_policy("float16")


def test_the_warning_is_a_user_warning_that_filters_silence(monkeypatch):
    fake_devices(monkeypatch, CPU_PLAIN)
    assert issubclass(kdp.SlowFloat16Warning, UserWarning)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=kdp.SlowFloat16Warning)
        kdp.set_dtype_policy("mixed_float16")
    assert caught == []
    assert kdp.dtype_policy().name == "mixed_float16"


def test_no_warning_for_bfloat16_float32_or_infer(monkeypatch):
    fake_devices(monkeypatch, CPU_PLAIN)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kdp.set_dtype_policy("mixed_bfloat16")
        kdp.set_dtype_policy("float32")
        kdp.set_policy("infer")
        with kdp.policy_scope("bfloat16"):
            pass


def test_no_warning_where_float16_is_fast(monkeypatch):
    fake_devices(monkeypatch, CPU_PLAIN, nvidia(7, 0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kdp.set_dtype_policy("mixed_float16")


def test_a_slow_gpu_warns_with_its_compute_capability(monkeypatch):
    fake_devices(monkeypatch, CPU_BF16, nvidia(6, 1))
    with pytest.warns(kdp.SlowFloat16Warning, match="compute capability 6.1"):
        kdp.set_dtype_policy("mixed_float16")


def test_device_discovery_failure_is_silent(monkeypatch):
    def fail(backend=None):
        raise RuntimeError("no devices")

    monkeypatch.setattr(hardware, "list_devices", fail)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kdp.set_dtype_policy("mixed_float16")
    assert kdp.dtype_policy().name == "mixed_float16"


def test_an_error_filter_leaves_the_scope_unentered(monkeypatch):
    fake_devices(monkeypatch, CPU_PLAIN)
    with warnings.catch_warnings():
        warnings.simplefilter("error", kdp.SlowFloat16Warning)
        with pytest.raises(kdp.SlowFloat16Warning):
            with kdp.policy_scope("mixed_float16"):
                pass
    assert kdp.dtype_policy().name == "float32"


def test_real_hardware_warns_when_it_computes_on_a_cpu():
    devices = hardware.list_devices()
    on_cpu = all(d.kind == "cpu" for d in hardware.compute_devices(devices))
    if not on_cpu:
        pytest.skip("this machine computes on an accelerator")
    with pytest.warns(kdp.SlowFloat16Warning, match="CPUs compute float16"):
        kdp.set_dtype_policy("mixed_float16")
