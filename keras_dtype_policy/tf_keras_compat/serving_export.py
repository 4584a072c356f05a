"""`export_for_serving`: a trained model exported in the dtype chosen.

Keras' `model.export` writes what serving runs: a TensorFlow SavedModel,
a PyTorch `ExportedProgram`, ONNX, OpenVINO or LiteRT. A model trained
under one of this package's policies exports through it as it is (its
layers compute in their compute dtype, bfloat16 for the `kahan_` and
`stochastic_` forms). `export_for_serving` exports a copy in Keras' own
terms instead (`save_for_keras`'s copy, without the optimizer), so
that the served model's dtype is the user's choice: `policy=None` keeps
each layer's compute dtype (Keras' nearest policy), `policy="float32"`
serves the same weights in float32. The model itself is not changed.
"""

import os
import typing

import keras

from keras_dtype_policy.tf_keras_compat import keras_alone


def export_for_serving(
    model: keras.Model,
    path: str | os.PathLike,
    format: str = "tf_saved_model",
    policy: str | None = None,
    **kwargs: typing.Any,
) -> None:
    """Exports `model` for serving, computing in the dtype chosen.

    Args:
        model: A built `keras.Model`, trained under any policy.
        path: Where Keras' `model.export` writes (a folder for a
            SavedModel, a `.pt2` file for `format="torch"`, ...).
        format: Keras' export format (`"tf_saved_model"`, `"torch"`,
            `"onnx"`, `"openvino"`, `"litert"`), as `model.export` takes
            it on the running backend.
        policy: The policy the served model computes in: a policy name
            Keras accepts (`"float32"`, `"bfloat16"`, `"mixed_bfloat16"`,
            ...) for every layer but those `model` pins to float32, or
            None for each layer's nearest Keras policy (the compute dtype
            it trained in).
        **kwargs: Passed to `model.export` (`input_signature`, ...).

    Raises:
        TypeError: if `model` is not a `keras.Model`, or `format` or
            `policy` is not a string.
        ValueError: if `policy` is not one of Keras' policies.

    Example:

    >>> keras_dtype_policy.export_for_serving(
    ...     model, "served", policy="float32"
    ... )  # doctest: +SKIP
    """
    if not isinstance(format, str):
        raise TypeError(
            "`format` must be a string naming one of Keras' export formats. "
            f"Received: format={format!r} (of type {type(format).__name__})"
        )
    # `keras_copy` checks `model` and `policy`; serving needs no optimizer,
    # so none is built and no state dequantized.
    copy = keras_alone.keras_copy(model, policy, with_optimizer=False)
    if model.built and "input_signature" not in kwargs:
        _call_once(copy)
    # A string: Keras' OpenVINO export calls `path.endswith`.
    copy.export(os.fspath(path), format=format, **kwargs)


def _call_once(copy: keras.Model) -> None:
    """Calls `copy` on one example of zeros.

    A copy rebuilt from its config has never been called, and Keras'
    ONNX export reads its input signature only from a called model.
    """
    inputs = getattr(copy, "inputs", None)
    if not inputs:
        return
    zeros = [
        keras.ops.zeros(
            [1 if size is None else size for size in tensor.shape],
            dtype=tensor.dtype,
        )
        for tensor in inputs
    ]
    copy(zeros[0] if len(zeros) == 1 else zeros)
