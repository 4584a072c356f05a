"""`doctor` and the demo recommend bfloat16 weights with compensated
updates where they fit: training that runs out of memory, on devices that
compute bfloat16 fast.

The rule is checked on made-up devices; `doctor` on this machine's real
devices, whichever they are (the advice appears exactly where the rule
says). The demo's line is checked in `test_cli.py`, whose demo run already
prints doctor's advice.
"""

import json

import keras
import pytest
from made_up_devices import CPU_BF16
from made_up_devices import CPU_PLAIN
from made_up_devices import CPU_UNKNOWN
from made_up_devices import nvidia
from testing import run_cli

from keras_dtype_policy.policies import hardware
from keras_dtype_policy.policies.hardware import Device
from keras_dtype_policy.tools import advice
from keras_dtype_policy.tools import doctor

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
    assert "docs/low-precision-training.md" in line
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
    result = run_cli("doctor", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["low_precision"] == expected
