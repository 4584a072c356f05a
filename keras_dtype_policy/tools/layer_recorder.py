"""Recording what layers' `call`s receive and return while a model runs."""

import contextlib


@contextlib.contextmanager
def recording(layers, record):
    """Has each layer report its calls while the block runs.

    Each layer's `call` is replaced, for the while, by one that calls the
    original and then `record(key, layer, args, kwargs, result)`; on leaving the
    block the layers' own `call`s are back.

    Args:
        layers: `(key, layer)` pairs; `key` is passed to `record`.
        record: A function of `(key, layer, args, kwargs, result)`.

    Example:

    >>> calls = []
    >>> with recording([("dense", dense)], lambda *a: calls.append(a)):
    ...     model(x)  # doctest: +SKIP
    """
    layers = list(layers)
    for key, layer in layers:
        object.__setattr__(layer, "call", _recorder(key, layer, record))
    try:
        yield
    finally:
        for _, layer in layers:
            layer.__dict__.pop("call", None)


def _recorder(key, layer, record):
    call = layer.call

    def recording_call(*args, **kwargs):
        result = call(*args, **kwargs)
        record(key, layer, args, kwargs, result)
        return result

    return recording_call
