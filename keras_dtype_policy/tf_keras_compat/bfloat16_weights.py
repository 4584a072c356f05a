"""bfloat16 weights that tf.keras 2 wrote into HDF5, read as bfloat16.

HDF5 has no bfloat16 type: tf.keras 2 handed h5py its bfloat16 arrays (the
weights a layer keeps in its compute dtype, such as Normalization's mean
and variance under mixed_bfloat16), which stored them as an opaque 2-byte
type with no name. Keras 3 reads those back as raw bytes (`void16`), which
no backend takes. Keras 3 itself marks the bfloat16 it writes with a
`dtype` attribute; tf.keras did not, and an unnamed 2-byte opaque value is
always its bfloat16.
"""

import numpy as np


def as_bfloat16(value):
    """Returns a 2-byte opaque array as bfloat16; anything else unchanged."""
    if isinstance(value, np.ndarray) and value.dtype.kind == "V":
        if value.dtype.itemsize == 2 and value.dtype.names is None:
            import ml_dtypes

            return value.view(ml_dtypes.bfloat16)
    return value


def make_set_weights(original):
    """Wraps the .h5 loader's `_set_weights`, which takes the saved arrays."""

    def set_weights(instance, symbolic_weights, weight_values, *args, **kw):
        weight_values = [as_bfloat16(np.asarray(v)) for v in weight_values]
        return original(instance, symbolic_weights, weight_values, *args, **kw)

    set_weights.__wrapped__ = original
    return set_weights


def make_h5_store_getitem(original):
    """Wraps the .keras weights store's `__getitem__` (`H5IOStore`)."""

    def getitem(self, key):
        return as_bfloat16(original(self, key))

    getitem.__wrapped__ = original
    return getitem
