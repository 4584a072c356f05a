"""The command line's output: plain lines for a pipe, a bar for a terminal.

Through a pipe (a CI log, `| tee`), and wherever `NO_COLOR` is set, output
holds no carriage return and no ANSI escape; at a terminal (a pseudo
terminal here) the demo keeps Keras' progress bar. The demo runs in a
process of its own, its output a real pipe or terminal; the other commands
run in this process (`call_cli`), on a standard output that is no
terminal.
"""

import io
import os
import pty
import subprocess
import sys
import threading

import keras
import pytest
from testing import call_cli

from keras_dtype_policy.tools import terminal

BACKEND = keras.backend.backend()
DEMO = ("demo", "--epochs", "2", "--samples", "64", "--policy", "float32")
# The demo's output (Keras' progress bar, or plain lines) is formatted the
# same on every backend; each run starts a backend in a process of its
# own (about 10 s), so these run in the torch env only, for CI time.
ONE_BACKEND = pytest.mark.skipif(
    BACKEND != "torch",
    reason="the demo's terminal output does not depend on the backend: "
    "checked in the torch env only (a process start each, CI time)",
)


def environment(**extra):
    values = dict(os.environ, KERAS_BACKEND=BACKEND, TF_CPP_MIN_LOG_LEVEL="2")
    values.pop("NO_COLOR", None)
    values.update(extra)
    return values


def run_at_a_terminal(args, env, cwd):
    """Runs the command line with its standard output on a pseudo terminal;
    returns what it wrote there."""
    leader, follower = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "keras_dtype_policy", *args],
        stdout=follower,
        stderr=subprocess.DEVNULL,
        env=env,
        cwd=cwd,
    )
    os.close(follower)
    chunks = []

    def read():
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the terminal closed
                return
            if not chunk:
                return
            chunks.append(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert process.wait(timeout=240) == 0
    reader.join(timeout=30)
    os.close(leader)
    return b"".join(chunks).decode("utf-8", errors="replace")


@ONE_BACKEND
def test_the_demo_through_a_pipe_prints_plain_lines(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "keras_dtype_policy", *DEMO],
        capture_output=True,
        text=True,
        env=environment(),
        cwd=tmp_path,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr
    assert "\r" not in result.stdout
    assert "\x1b[" not in result.stdout
    epochs = [
        line for line in result.stdout.splitlines() if line.startswith("2/2 ")
    ]
    assert len(epochs) == 2  # one line per epoch
    assert all("loss:" in line for line in epochs)


@pytest.mark.parametrize(
    "args",
    [("doctor",), ("doctor", "--json"), ("--help",)],
    ids=["doctor", "doctor-json", "help"],
)
def test_other_commands_off_a_terminal_print_plain_lines(args, monkeypatch):
    # In this process, on a standard output that is no terminal (the
    # demo's test above is the one through a real pipe).
    monkeypatch.delenv("NO_COLOR", raising=False)
    result = call_cli(*args)
    assert result.returncode == 0, result.stderr
    assert "\r" not in result.stdout and "\x1b[" not in result.stdout


@ONE_BACKEND
def test_the_demo_at_a_terminal_keeps_the_progress_bar(tmp_path):
    output = run_at_a_terminal(DEMO, environment(), tmp_path)
    assert "\u2501" in output  # the bar
    assert "\x1b[" in output  # Keras colours it


@ONE_BACKEND
def test_no_color_at_a_terminal_prints_plain_lines(tmp_path):
    output = run_at_a_terminal(DEMO, environment(NO_COLOR="1"), tmp_path)
    assert "\x1b[" not in output
    assert "\u2501" not in output
    # One line per epoch instead.
    assert output.count("2/2 - ") == 2


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_plain_output_follows_the_stream_and_no_color(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert terminal.plain_output(io.StringIO())
    assert not terminal.plain_output(_Terminal())
    assert terminal.fit_verbosity(io.StringIO()) == 2
    assert terminal.fit_verbosity(_Terminal()) == 1
    monkeypatch.setenv("NO_COLOR", "1")
    assert terminal.plain_output(_Terminal())
    assert terminal.fit_verbosity(_Terminal()) == 2
    monkeypatch.setenv("NO_COLOR", "")  # empty: not set, by the convention
    assert not terminal.plain_output(_Terminal())
