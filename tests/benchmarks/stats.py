"""Summaries of repeated timings: medians, spreads and paired ratios.

Pure Python: importing this module imports no backend and not Keras.
"""

import statistics


def quartiles(samples):
    """Returns the (first quartile, median, third quartile) of `samples`.

    Quartiles interpolate linearly between order statistics, as
    `numpy.percentile` does by default.

    Args:
        samples: A non-empty sequence of numbers.

    Returns:
        A tuple of three floats.
    """
    if not samples:
        raise ValueError("Cannot summarize an empty list of samples.")
    ordered = sorted(float(s) for s in samples)
    return tuple(_percentile(ordered, q) for q in (0.25, 0.5, 0.75))


def summarize(samples):
    """Returns the median and spread of `samples` as a dict.

    Args:
        samples: A non-empty sequence of numbers (seconds, ratios...).

    Returns:
        A dict with `median`, `q1`, `q3`, `iqr`, `min`, `max`, `n` and the
        `samples` themselves.
    """
    q1, median, q3 = quartiles(samples)
    return {
        "median": median,
        "q1": q1,
        "q3": q3,
        "iqr": q3 - q1,
        "min": float(min(samples)),
        "max": float(max(samples)),
        "n": len(samples),
        "samples": [float(s) for s in samples],
    }


def compare(numerator, denominator):
    """Returns the ratio of two paired series of samples.

    `ratio` is the ratio of the medians; `paired` summarizes the ratios of
    the samples taken side by side (the i-th of each), whose spread shows
    how far noise moves the ratio.

    Args:
        numerator: The samples of the first arm.
        denominator: The samples of the second arm, as many.

    Returns:
        A dict with `ratio` and `paired` (a `summarize` dict).
    """
    if len(numerator) != len(denominator):
        raise ValueError(
            "Paired samples must be as many on both sides. Received: "
            f"{len(numerator)} and {len(denominator)} samples"
        )
    pairs = [a / b for a, b in zip(numerator, denominator, strict=True)]
    ratio = statistics.median(numerator) / statistics.median(denominator)
    return {"ratio": ratio, "paired": summarize(pairs)}


def verdict(comparison, target, at_most):
    """Returns "ok", "miss" or "unclear" for a ratio against its target.

    "miss" needs the ratio of medians and three quarters of the paired
    ratios on the wrong side of the target; "unclear" is a ratio on the
    wrong side while the paired ratios straddle the target (noise).

    Args:
        comparison: A dict from `compare`.
        target: The target ratio.
        at_most: True if the ratio must be at most `target`, False if at
            least.

    Returns:
        A string.
    """
    ratio = comparison["ratio"]
    paired = comparison["paired"]
    if at_most:
        if ratio <= target:
            return "ok"
        return "miss" if paired["q1"] > target else "unclear"
    if ratio >= target:
        return "ok"
    return "miss" if paired["q3"] < target else "unclear"


def _percentile(ordered, fraction):
    position = fraction * (len(ordered) - 1)
    below = int(position)
    above = min(below + 1, len(ordered) - 1)
    weight = position - below
    return ordered[below] * (1 - weight) + ordered[above] * weight
