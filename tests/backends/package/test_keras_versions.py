"""The tested Keras range: the package's bound, and what `doctor` says."""

import json
import pathlib
import re

import keras
import pytest
from testing import call_cli

from keras_dtype_policy.policies import keras_internals
from keras_dtype_policy.tools import doctor

BACKEND = keras.backend.backend()
PYPROJECT = pathlib.Path(__file__).resolve().parents[3] / "pyproject.toml"


def test_the_dependency_bound_is_the_tested_range():
    # tomllib is Python 3.11+; the line is simple enough to read on 3.10.
    [dependencies] = re.findall(
        r"^dependencies = \[(.*)\]$", PYPROJECT.read_text(), re.MULTILINE
    )
    [bound] = re.findall(r'"keras([<>=!~][^"]*)"', dependencies)
    assert bound == keras_internals.TESTED_KERAS


def test_the_installed_keras_is_inside_the_tested_range():
    # Each tox environment installs a Keras of the range (or keras-nightly,
    # a development build of its last minor release).
    inside, verdict = keras_internals.keras_version_status()
    assert inside is True
    assert keras.__version__ in verdict


@pytest.mark.parametrize(
    "version, inside, words",
    [
        ("3.12.0", True, "inside the tested range"),
        ("3.15.1", True, "inside the tested range"),
        ("3.16.0.dev2026102704", True, "a development build inside"),
        ("3.16.2", True, "inside the tested range"),
        ("3.11.3", False, "older than the tested range"),
        ("3.17.0", False, "newer than the tested range"),
        ("3.17.0.dev2027010104", False, "newer than the tested range"),
        ("4.0.0", False, "newer than the tested range"),
        ("unknown", None, "cannot read the version"),
    ],
)
def test_versions_against_the_tested_range(version, inside, words):
    got_inside, verdict = keras_internals.keras_version_status(version)
    assert got_inside is inside
    assert words in verdict
    assert version in verdict
    assert keras_internals.TESTED_KERAS in verdict
    if inside is False:
        assert "may have moved" in verdict


def test_the_distribution_is_the_one_that_wrote_the_module():
    # Run from a checkout, the package itself need not be installed; Keras
    # always is, as keras or keras-nightly.
    distribution = keras_internals.keras_distribution()
    assert distribution in ("keras", "keras-nightly")
    expected = "keras-nightly" if "dev" in keras.__version__ else "keras"
    assert distribution == expected


def test_doctor_report_judges_a_given_version():
    report = doctor.keras_report("3.17.1")
    assert report["inside_tested_range"] is False
    assert report["tested_range"] == keras_internals.TESTED_KERAS
    assert "newer than the tested range" in report["verdict"]


def test_doctor_reports_the_installed_keras():
    # The command runs in this process (`call_cli`): the Keras it reports
    # is the one imported here.
    result = call_cli("doctor", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)["keras"]
    assert report["inside_tested_range"] is True
    assert report["distribution"] == keras_internals.keras_distribution()
    assert report["tested_range"] == keras_internals.TESTED_KERAS
    assert keras.__version__ in report["verdict"]
    result = call_cli("doctor")
    assert result.returncode == 0, result.stderr
    flat = " ".join(result.stdout.split())
    assert f"keras {keras.__version__}: " in flat
    assert f"the tested range {keras_internals.TESTED_KERAS}" in flat
    assert f"(installed as {report['distribution']})" in flat
