"""The floating-point tensors in what a layer takes or returns."""

import keras


def float_tensors(structure):
    """Returns the floating-point tensors in a nested structure.

    Args:
        structure: Anything `keras.tree.flatten` accepts: a tensor, or
            lists, tuples and dicts of tensors and other values.

    Returns:
        A list of the tensors whose dtype Keras reads as floating point,
        in `keras.tree.flatten` order; other values are left out.
    """
    found = []
    for value in keras.tree.flatten(structure):
        dtype = getattr(value, "dtype", None)
        if dtype is None or not hasattr(value, "shape"):
            continue
        try:
            dtype = keras.backend.standardize_dtype(dtype)
        except ValueError:
            continue
        if keras.backend.is_float_dtype(dtype):
            found.append(value)
    return found
