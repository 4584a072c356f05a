"""`doctor` and the demo recommend bfloat16 weights with compensated
updates where they fit: training that runs out of memory, on devices that
compute bfloat16 fast.

The advice names 8-bit and 4-bit optimizer state with their bytes a
parameter (`state_memory` computes them; checked here against the figures
worked out by hand). The rule is checked on made-up devices; `doctor` on
this machine's real devices, whichever they are (the advice appears
exactly where the rule says). The demo's line is checked in `test_cli.py`,
whose demo run already prints doctor's advice.
"""

import json

import keras
import pytest
from made_up_devices import CPU_BF16
from made_up_devices import CPU_PLAIN
from made_up_devices import CPU_UNKNOWN
from made_up_devices import nvidia
from testing import call_cli

from keras_dtype_policy.policies import hardware
from keras_dtype_policy.policies.hardware import Device
from keras_dtype_policy.tools import advice
from keras_dtype_policy.tools import doctor
from keras_dtype_policy.tools import state_memory

BACKEND = keras.backend.backend()


@pytest.mark.parametrize(
    "devices, fits",
    [
        ((CPU_BF16,), True),
        ((CPU_PLAIN,), False),
        ((CPU_UNKNOWN,), False),
        ((CPU_PLAIN, nvidia(8, 0)), True),
        ((CPU_PLAIN, nvidia(7, 5)), False),
        ((CPU_BF16, nvidia(8, 0), nvidia(7, 0, index=1)), False),
        ((CPU_PLAIN, Device("tpu:0", "tpu", "TPU v4")), True),
        ((), False),
    ],
)
def test_the_advice_fits_where_bfloat16_is_fast(devices, fits):
    line = advice.low_precision_advice(devices)
    if not fits:
        assert line is None
        return
    assert "'kahan_bfloat16'" in line and "kdp.LowPrecisionOptimizer" in line
    assert "8 bytes a parameter instead of mixed precision's 12" in line
    assert (
        "8-bit optimizer state takes 4.03 ('stochastic_bfloat16_8bit'" in line
    )
    assert "state_dtype='8bit'" in line
    assert "4-bit state 3.06 ('stochastic_bfloat16_4bit')" in line
    assert "docs/low-precision-training.md" in line
    # Gradient release runs on PyTorch only: named there, nowhere else.
    assert ("release_gradients=True frees each gradient" in line) == (
        BACKEND == "torch"
    )
    assert advice.demo_choice(devices, BACKEND).low_precision == line


def test_doctor_reports_the_advice_for_this_machine():
    devices = hardware.list_devices()
    expected = advice.low_precision_advice(devices)
    report = doctor.build_report()
    assert report["low_precision"] == expected
    text = "\n".join(doctor.format_report(report))
    flat = " ".join(text.split())
    if expected is None:
        assert "memory-bound training" not in text
    else:
        assert f"memory-bound training: {expected}" in flat


def test_doctor_prints_the_advice_where_it_fits(monkeypatch):
    monkeypatch.setattr(
        hardware, "list_devices", lambda backend=None: (CPU_BF16,)
    )
    lines = doctor.format_report(doctor.build_report())
    flat = " ".join(" ".join(lines).split())
    assert "memory-bound training: if training runs out of memory" in flat
    monkeypatch.setattr(
        hardware, "list_devices", lambda backend=None: (CPU_PLAIN,)
    )
    report = doctor.build_report()
    assert report["low_precision"] is None
    assert "memory-bound" not in "\n".join(doctor.format_report(report))


def test_doctor_json_carries_the_advice():
    expected = advice.low_precision_advice(hardware.list_devices())
    result = call_cli("doctor", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["low_precision"] == expected


@pytest.mark.parametrize(
    "weight_dtype, update, state_dtype, expected",
    [
        ("float32", None, None, 12.0),  # mixed_bfloat16 with Adam
        ("bfloat16", "kahan", None, 8.0),
        ("bfloat16", "stochastic_rounding", None, 6.0),
        ("bfloat16", "kahan", "8bit", 6.0 + 2 * 4 / 256),
        ("bfloat16", "stochastic_rounding", "8bit", 4.0 + 2 * 4 / 256),
        ("bfloat16", "kahan", "4bit", 5.0 + 2 * 4 / 128),
        ("bfloat16", "stochastic_rounding", "4bit", 3.0 + 2 * 4 / 128),
        ("float16", "kahan", "float32", 12.0),
    ],
)
def test_bytes_per_parameter(weight_dtype, update, state_dtype, expected):
    found = state_memory.adam_bytes_per_parameter(
        weight_dtype, update, state_dtype
    )
    assert found == expected
