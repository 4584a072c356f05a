"""Argument checks shared by the package's public constructors."""

import math
import numbers
from typing import Any


def check_positive_number(argument_name: str, value: Any) -> float:
    """Returns `value` as a float, or raises if it is not finite and > 0."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(
            f"`{argument_name}` must be a number. "
            f"Received: {argument_name}={value!r} "
            f"(of type {type(value).__name__})"
        )
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"`{argument_name}` must be a finite number greater than 0. "
            f"Received: {argument_name}={value!r}"
        )
    return value


def check_positive_int(argument_name: str, value: Any) -> int:
    """Returns `value` as an int, or raises if it is not an int >= 1."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise TypeError(
                f"`{argument_name}` must be an integer. Received: "
                f"{argument_name}={value!r} (of type {type(value).__name__})"
            )
    if value < 1:
        raise ValueError(
            f"`{argument_name}` must be at least 1. "
            f"Received: {argument_name}={value!r}"
        )
    return int(value)
