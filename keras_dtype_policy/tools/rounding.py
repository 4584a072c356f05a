"""Values as a lower-precision dtype would hold them."""

import numpy as np


def round_to(values, dtype):
    """Returns `values` rounded to `dtype`, as float64 NumPy values.

    Args:
        values: float64 NumPy values.
        dtype: A NumPy float dtype name, or `"bfloat16"` (through
            `ml_dtypes`). Values beyond its range become +/-inf.

    Returns:
        The rounded values, as float64.

    Example:

    >>> round_to(np.array([1.0 + 1e-4]), "bfloat16")
    array([1.])
    """
    if dtype == "bfloat16":
        import ml_dtypes

        return values.astype(ml_dtypes.bfloat16).astype("float64")
    with np.errstate(over="ignore"):
        return values.astype(dtype).astype("float64")
