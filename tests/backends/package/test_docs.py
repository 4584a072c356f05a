"""Every Python block of README.md and docs/*.md, run as written.

Each block runs on the backend of this run, in a fresh namespace, with a
temporary working directory, so that the files it writes land there. HTML
comments right above a block say where and how it runs:

- `<!-- backend: NAME -->`: only on that backend (it uses that backend's
  own library); skipped on the others.
- `<!-- processes: N -->`: one process of a job of N; the block is saved
  as `train.py` and started N times with `PROCESS_ID`, `NUM_PROCESSES` and
  `COORDINATOR` (a free loopback port) set, as the docs say to.
- `<!-- keras: X.Y -->`: only on Keras X.Y or later (it uses something
  that Keras release added); skipped on older ones.
- `<!-- custom-loop: NAME -->`, `<!-- distributed: NAME -->`: run, and
  checked more closely, by the test named in `OWNERS`; skipped here.
"""

import contextlib
import io
import os
import re
import socket
import subprocess
import sys
import time

import keras
import pytest
from testing import BACKEND
from testing import DOC_PAGES
from testing import ROOT
from testing import readme_example

# Marker kinds whose blocks another test runs, and that test's file.
OWNERS = {
    "custom-loop": lambda tag: (
        "tests/backends/package/test_readme_custom_loops.py"
    ),
    "distributed": lambda tag: (
        f"tests/backends/loss_scaling/test_distribution_{tag}.py"
    ),
}
KNOWN_MARKERS = {"backend", "keras", "processes", *OWNERS}
BACKENDS = {"tensorflow", "jax", "torch"}
MARKER = re.compile(r"<!-- ([\w-]+): (\S+) -->")
# A multi-process block's processes must all be done by then.
TIMEOUT = 300


def python_blocks(page):
    """Returns `(line, markers, source)` for each Python block of `page`.

    `markers` maps each marker kind in the HTML comments right above the
    block (blank lines between are allowed) to its value.
    """
    blocks, markers, fence = [], {}, None
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if fence is not None:
            if line.strip() == "```":
                if fence[1] is not None:
                    blocks.append((fence[0], fence[1], "\n".join(fence[2])))
                fence = None
            else:
                fence[2].append(line)
        elif line.startswith("```"):
            language = line[3:].strip()
            fence = (number, markers if language == "python" else None, [])
            markers = {}
        elif match := MARKER.fullmatch(line.strip()):
            markers[match[1]] = match[2]
        elif line.strip():
            markers = {}
    assert fence is None, f"{page.name}: a code block is never closed"
    return blocks


def all_blocks():
    """Returns a pytest param for every Python block of the docs."""
    params = []
    for page in DOC_PAGES:
        name = page.relative_to(ROOT).as_posix()
        for line, markers, source in python_blocks(page):
            # A block for every backend runs on one of them in the
            # default runs (see `rotated` in conftest.py); one marked for
            # a backend, or owned by another test, is left as it is.
            rotates = not ({"backend", *OWNERS} & set(markers))
            params.append(
                pytest.param(
                    name,
                    line,
                    markers,
                    source,
                    id=f"{name}:{line}",
                    marks=(pytest.mark.rotated,) if rotates else (),
                )
            )
    return params


BLOCKS = all_blocks()


def free_port():
    """Returns a loopback port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(source, count, tmp_path):
    """Runs `source` as `count` processes of one job; returns their output."""
    script = tmp_path / "train.py"
    script.write_text(source)
    env = dict(
        os.environ,
        KERAS_BACKEND=BACKEND,
        NUM_PROCESSES=str(count),
        COORDINATOR=f"127.0.0.1:{free_port()}",
        TF_CPP_MIN_LOG_LEVEL="3",
    )
    # Output goes to files: a full pipe nobody reads could stall a process
    # while the test waits for another one.
    logs = [open(tmp_path / f"process_{i}.log", "w+") for i in range(count)]
    processes = [
        subprocess.Popen(
            [sys.executable, str(script)],
            cwd=tmp_path,
            env=dict(env, PROCESS_ID=str(i)),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        for i, log in enumerate(logs)
    ]
    deadline = time.monotonic() + TIMEOUT
    outputs = []
    for i, process in enumerate(processes):
        try:
            process.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
                other.wait()
        logs[i].seek(0)
        output = logs[i].read()
        logs[i].close()
        assert process.returncode == 0, (
            f"process {i} of {count} exited with {process.returncode} "
            f"(killed if still running after {TIMEOUT} s):\n{output[-3000:]}"
        )
        outputs.append(output)
    return outputs


def skip_reason(markers):
    """Says why this run skips a block, or returns None to run it."""
    for kind, owner in OWNERS.items():
        if kind in markers:
            return (
                f"`{kind}: {markers[kind]}` block: run and checked by "
                f"{owner(markers[kind])}"
            )
    backend = markers.get("backend")
    if backend is not None and backend != BACKEND:
        return (
            f"marked `backend: {backend}`: it needs what only {backend} has, "
            f"and this run is on {BACKEND}"
        )
    needed = markers.get("keras")
    if needed is not None and _release(keras.__version__) < _release(needed):
        return (
            f"marked `keras: {needed}`: it needs what Keras {needed} added, "
            f"and Keras {keras.__version__} is installed"
        )
    return None


def _release(version):
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
    return int(major), int(minor)


@pytest.mark.parametrize("page, line, markers, source", BLOCKS)
def test_docs_python_block_runs(page, line, markers, source, tmp_path):
    reason = skip_reason(markers)
    if reason is not None:
        pytest.skip(reason)
    if "processes" in markers:
        count = int(markers["processes"])
        outputs = run_processes(source, count, tmp_path)
        last_lines = [output.strip().splitlines()[-1] for output in outputs]
        # Every process of a job ends with the same state, and says so.
        assert last_lines == [last_lines[0]] * count, outputs
        return
    namespace = {"__name__": "__main__"}
    printed = io.StringIO()
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(source, f"{page}:{line}", "exec"), namespace)
    finally:
        os.chdir(cwd)


def test_docs_have_the_expected_python_blocks():
    pages = {param.values[0] for param in BLOCKS}
    assert {"README.md", "docs/loss-scaling.md"} <= pages
    assert len(BLOCKS) >= 10


def anchor(heading):
    """Returns the anchor GitHub gives a Markdown heading."""
    text = heading.lstrip("#").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@pytest.mark.parametrize("page", DOC_PAGES, ids=lambda page: page.name)
def test_docs_links_point_to_existing_pages_and_headings(page):
    text = page.read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if "://" in target:
            continue
        path, _, fragment = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.name}: {target} is not a file"
        if fragment:
            headings = [
                anchor(line)
                for line in linked.read_text().splitlines()
                if line.startswith("#")
            ]
            assert fragment in headings, f"{page.name}: no heading {target}"


@pytest.mark.parametrize("page, line, markers, source", BLOCKS)
def test_docs_block_markers_are_known(page, line, markers, source):
    assert set(markers) <= KNOWN_MARKERS, f"unknown marker in {markers}"
    if "backend" in markers:
        assert markers["backend"] in BACKENDS
    for kind in OWNERS:
        if kind in markers:
            # The owning test reads this very block through the marker.
            assert readme_example(markers[kind], kind) == source + "\n"
