"""Argument checks and the dtype rule shared by `posttrain.functional`.

Every check raises `ValueError` naming the argument and saying what to change.

Dtype rule: the math runs in at least float32. float16/bfloat16 inputs are
upcast (bfloat16 has a spacing of 2**-7 near 1, so GSPO's clip range
1 ± 4e-4 or a log-probability difference of 1e-3 is not representable);
float64 inputs stay float64.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import reduce

import torch
from torch import Tensor


def compute_dtype(*tensors: Tensor | None) -> torch.dtype:
    """The dtype the math runs in: the promotion of the float inputs, at least float32."""
    float_dtypes = [t.dtype for t in tensors if t is not None and t.is_floating_point()]
    return reduce(torch.promote_types, float_dtypes, torch.float32)


def check_choice(name: str, value: str, choices: Iterable[str]) -> None:
    choices = tuple(choices)
    if value not in choices:
        valid = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name}={value!r} is not known; use one of {valid}")


def check_ndim(name: str, tensor: Tensor, ndim: int, layout: str) -> None:
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must have shape {layout}, got shape {list(tensor.shape)}")


def check_same_shape(**tensors: Tensor | None) -> None:
    """Every given tensor has the shape of the first one; names both shapes otherwise."""
    named = [(name, t) for name, t in tensors.items() if t is not None]
    first_name, first = named[0]
    for name, tensor in named[1:]:
        if tensor.shape != first.shape:
            raise ValueError(
                f"{name} has shape {list(tensor.shape)} but {first_name} has shape "
                f"{list(first.shape)}; they must match"
            )


def check_nonnegative(name: str, value: float | None) -> None:
    if value is not None and value < 0:
        raise ValueError(f"{name}={value} is negative; use a value >= 0")


def check_positive(name: str, value: float | None) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"{name}={value} must be > 0")


def check_unit_interval(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name}={value} must lie in [0, 1]")
