"""Output for a person at a terminal, or plain lines for a pipe or a log."""

import os
import sys


def plain_output(stream=None):
    """Returns True where output must be plain lines, without escapes.

    That is where `stream` is no terminal (a pipe, a file, a CI log), or
    where the `NO_COLOR` environment variable is set and not empty
    (https://no-color.org).

    Args:
        stream: The stream written to; defaults to `sys.stdout`.
    """
    if os.environ.get("NO_COLOR"):
        return True
    stream = sys.stdout if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    try:
        return not (isatty is not None and isatty())
    except ValueError:  # a closed stream
        return True


def fit_verbosity(stream=None):
    """Returns the `verbose` argument of Keras' `fit` for `stream`.

    1 (Keras' progress bar, redrawn with carriage returns and coloured with
    ANSI escapes) at a terminal; else 2: one plain line per epoch.
    """
    return 2 if plain_output(stream) else 1
