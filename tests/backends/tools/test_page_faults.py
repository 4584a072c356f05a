"""`doctor`'s advice on huge pages for JAX's step buffers on a CPU."""

import json
import os

import pytest
from testing import BACKEND
from testing import call_cli

from keras_dtype_policy.tools import page_faults

ADVISED = {"environ": {}, "thp_mode": "madvise", "glibc": (2, 36)}


def test_advised_where_it_helps():
    note = page_faults.huge_page_note(**ADVISED)
    assert "GLIBC_TUNABLES=glibc.malloc.hugetlb=1" in note
    assert "32 MiB" in note


@pytest.mark.parametrize(
    "change",
    [
        # Set already, alone or among other tunables.
        {"environ": {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}},
        {
            "environ": {
                "GLIBC_TUNABLES": "glibc.malloc.arena_max=2:"
                "glibc.malloc.hugetlb=2"
            }
        },
        # The kernel gives huge pages to every large mapping, or to none.
        {"thp_mode": "always"},
        {"thp_mode": "never"},
        # The tunable arrived in glibc 2.35.
        {"glibc": (2, 34)},
    ],
)
def test_not_advised_where_it_cannot_help(change):
    assert page_faults.huge_page_note(**{**ADVISED, **change}) is None


@pytest.mark.parametrize(
    "text, mode",
    [
        ("always [madvise] never\n", "madvise"),
        ("[always] madvise never\n", "always"),
        ("always madvise [never]\n", "never"),
        ("no brackets here\n", None),
        ("", None),
    ],
)
def test_reads_the_kernel_mode(tmp_path, text, mode):
    path = tmp_path / "enabled"
    path.write_text(text)
    assert page_faults.transparent_huge_pages(path) == mode


def test_a_missing_mode_file_is_unknown(tmp_path):
    assert page_faults.transparent_huge_pages(tmp_path / "absent") is None


def test_glibc_version_is_a_pair_or_none():
    version = page_faults.glibc_version()
    # These machines run Debian's glibc; a musl or non-Linux one has none.
    assert version is None or (
        len(version) == 2 and all(isinstance(part, int) for part in version)
    )


@pytest.mark.parametrize("tunables", [None, "glibc.malloc.hugetlb=1"])
def test_doctor_notes_it_on_jax_only(tunables):
    env = {} if tunables is None else {"GLIBC_TUNABLES": tunables}
    result = call_cli("doctor", "--json", env=env)
    assert result.returncode == 0, result.stderr
    notes = json.loads(result.stdout)["notes"]
    ours = [note for note in notes if "hugetlb" in note]
    # JAX on a CPU gets the note where this machine's kernel and glibc
    # let it help; TensorFlow and PyTorch never (their allocators were
    # not measured to fault so).
    seen = {**os.environ, **env}
    expected = BACKEND == "jax" and page_faults.huge_page_note(seen) is not None
    assert len(ours) == (1 if expected else 0), notes
