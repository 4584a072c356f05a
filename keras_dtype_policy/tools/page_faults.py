"""Whether large step buffers pay the kernel a page fault every 4 KiB.

glibc's `malloc` maps a request above its mmap threshold (at most 32 MiB
on 64-bit Linux) fresh from the kernel and returns it to the kernel when
freed. JAX's CPU runtime allocates a compiled step's temporary buffers
on every run, so a step whose temporaries pass 32 MiB faults in every
page of them every step (about 2.5 microseconds a 4 KiB page measured on
this project's VMs; docs/low-precision-training.md has the figures). With
transparent huge pages in `madvise` mode, glibc 2.35 and later asks for
2 MiB pages when `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` is set when
Python starts: 512 times fewer faults.

Reads `/proc`-like files and the environment only; imports no backend.
"""

import os
import platform

THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"
TUNABLE = "glibc.malloc.hugetlb"
SETTING = f"GLIBC_TUNABLES={TUNABLE}=1"


def transparent_huge_pages(path=THP_MODE_FILE):
    """The kernel's transparent huge page mode ("always", "madvise" or
    "never"), or None where the file is missing or unreadable."""
    try:
        with open(path, encoding="ascii") as modes:
            text = modes.read()
    except (OSError, UnicodeDecodeError):
        return None
    start, end = text.find("["), text.find("]")
    if start < 0 or end <= start:
        return None
    return text[start + 1 : end]


def glibc_version():
    """`(major, minor)` of the C library this Python runs on, or None."""
    library, version = platform.libc_ver()
    if library != "glibc":
        return None
    try:
        major, minor = version.split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def huge_page_note(environ=None, thp_mode=None, glibc=None):
    """The advice for a CPU step with large buffers, or None.

    Args:
        environ: The environment (default `os.environ`).
        thp_mode: The transparent huge page mode (default: read it).
        glibc: glibc's `(major, minor)` (default: this process').

    Returns:
        A sentence naming `GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, or
        None where it is set already, cannot help (huge pages `always`
        or `never`, glibc before 2.35, not glibc), or where nothing is
        known.
    """
    environ = os.environ if environ is None else environ
    thp_mode = transparent_huge_pages() if thp_mode is None else thp_mode
    glibc = glibc_version() if glibc is None else glibc
    if TUNABLE in environ.get("GLIBC_TUNABLES", ""):
        return None
    if thp_mode != "madvise" or glibc is None or glibc < (2, 35):
        return None
    return (
        "JAX's CPU runtime allocates each step's temporary buffers anew, "
        "and glibc maps those above 32 MiB fresh from the kernel, 4 KiB "
        "at a time (a 12.6M-parameter model's step ran 5 to 23% faster "
        "without those page faults): start Python "
        f"with {SETTING} to map them in 2 MiB pages"
    )
