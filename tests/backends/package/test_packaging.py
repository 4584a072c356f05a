"""The installed distribution's metadata: license, bounds, classifiers.

Nothing is built: these read what pip installed (a wheel under tox, or an
editable install).
"""

import importlib.metadata
import pathlib
import re

import pytest

import keras_dtype_policy
from keras_dtype_policy.policies import keras_internals

DISTRIBUTION = importlib.metadata.distribution("keras_dtype_policy")
METADATA = DISTRIBUTION.metadata
ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_the_version_is_the_package_version():
    assert DISTRIBUTION.version == keras_dtype_policy.__version__


def test_the_license_is_apache_2_in_spdx_form():
    assert METADATA["License-Expression"] == "Apache-2.0"
    assert METADATA.get_all("License-File") == ["LICENSE"]
    assert not [
        c for c in METADATA.get_all("Classifier") if c.startswith("License ::")
    ]


def test_the_license_file_is_the_apache_license():
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("Copyright ")
    assert "the keras_dtype_policy authors" in text.splitlines()[0]
    assert "Apache License\n" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    installed = [f for f in DISTRIBUTION.files or () if f.name == "LICENSE"]
    if installed:  # a wheel install ships it in the .dist-info folder
        assert installed[0].read_text() == text


def test_keras_has_an_upper_bound_below_the_next_untested_minor():
    # "keras" itself, not keras-hub (the hub extra) or another keras-*.
    [keras] = [r for r in DISTRIBUTION.requires if re.match(r"keras[<>=!~]", r)]
    bounds = set(re.sub(r"^keras", "", keras).split(","))
    assert bounds == set(keras_internals.TESTED_KERAS.split(","))
    assert bounds == {">=3.12", "<3.17"}


def test_keras_hub_is_only_in_the_hub_extra():
    hub = [r for r in DISTRIBUTION.requires if r.startswith("keras-hub")]
    assert [r.split(";")[1].strip() for r in hub] == ['extra == "hub"']


def test_the_jax_extra_does_not_force_the_cpu_build():
    jax = [r for r in DISTRIBUTION.requires if 'extra == "jax"' in r]
    assert [r.split(";")[0].strip() for r in jax] == ["jax"]


@pytest.mark.parametrize(
    "classifier",
    [
        "Development Status :: 3 - Alpha",
        "Operating System :: OS Independent",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Programming Language :: Python :: 3.13",
        "Typing :: Typed",
    ],
)
def test_classifiers(classifier):
    assert classifier in METADATA.get_all("Classifier")


def test_project_urls():
    urls = dict(
        entry.split(", ", 1) for entry in METADATA.get_all("Project-URL")
    )
    assert set(urls) == {"Homepage", "Documentation", "Issues"}
    for url in urls.values():
        assert url.startswith(
            "https://github.com/keras-dtype-policy/keras_dtype_policy"
        )


def test_py_typed_ships_with_the_package():
    package_dir = pathlib.Path(keras_dtype_policy.__file__).parent
    assert (package_dir / "py.typed").is_file()
    recorded = [str(f) for f in DISTRIBUTION.files or ()]
    if any(f.startswith("keras_dtype_policy/") for f in recorded):
        # A wheel install records every file it put in place.
        assert "keras_dtype_policy/py.typed" in recorded
