"""This process's resident memory: current, peak, and resetting the peak.

Linux keeps the peak resident set size (VmHWM in /proc/self/status); writing
"5" to /proc/self/clear_refs resets it to the current size, so the peak of
one phase of a process can be read on its own. Elsewhere the peak comes
from `resource.getrusage` and cannot be reset.

Importing this module imports no backend and not Keras.
"""

import resource
import sys

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def current_rss():
    """Returns the resident set size in bytes, or None if unknown."""
    return _status_bytes("VmRSS")


def peak_rss():
    """Returns the peak resident set size in bytes since start or reset."""
    peak = _status_bytes("VmHWM")
    if peak is not None:
        return peak
    # ru_maxrss is in kilobytes on Linux, in bytes on macOS.
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024


def reset_peak_rss():
    """Resets the peak to the current size; returns False if it cannot."""
    try:
        with open(_CLEAR_REFS, "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _status_bytes(field):
    try:
        with open(_STATUS, encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
