"""Loss aggregation: how per-token losses `L[i, t]` become one scalar.

| name | formula | source |
|---|---|---|
| `sequence_mean` | `(1/N) sum_i (1/|o_i|) sum_t L[i,t]` | GRPO eq. (3), PPO |
| `token_mean` | `sum_{i,t} L[i,t] / sum_i |o_i|` | DAPO Sec. 3.3 (token-level loss) |
| `constant` | `(1/N) sum_i sum_t L[i,t] / max_tokens` | Dr.GRPO (Liu et al. 2025) Sec. 3 |

`N` counts only sequences with at least one valid token. The denominators
(`sum_i |o_i|` for `token_mean`, `N` otherwise) belong to the optimizer step:
pass the step's count as `normalizer` to every micro-batch, and the sum of the
micro-batch losses equals one call on the whole step (value and gradient).

Departure from the papers: none in the formula. An empty input (no valid
token) gives a loss of exactly 0 that is still connected to the graph (its
gradient is zero), never NaN; a `normalizer` of 0 (an empty step) is treated
as 1 for the same reason.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import (
    check_choice,
    check_ndim,
    check_nonnegative,
    check_positive,
    check_same_shape,
    compute_dtype,
)

AGGREGATIONS = ("sequence_mean", "token_mean", "constant")


def check_aggregation(aggregation: str, max_tokens: int | None, normalizer: float | Tensor | None) -> None:
    """Validate the aggregation arguments (shared by every loss that aggregates)."""
    check_choice("aggregation", aggregation, AGGREGATIONS)
    check_positive("max_tokens", max_tokens)
    if aggregation == "constant" and max_tokens is None:
        raise ValueError(
            "aggregation='constant' needs max_tokens (the generation budget, the maximum "
            "completion length); pass max_tokens=..."
        )
    if not isinstance(normalizer, Tensor):
        check_nonnegative("normalizer", normalizer)


def aggregate(
    values: Tensor,
    mask: Tensor,
    aggregation: str,
    *,
    max_tokens: int | None = None,
    normalizer: float | Tensor | None = None,
) -> Tensor:
    """Aggregate per-token values into a scalar over the valid tokens.

    Args:
        values: [N, T] per-token losses.
        mask: [N, T] 1 (or True) for completion tokens, 0 for padding. Padded
            values never reach the result or the gradient, even if inf or NaN.
        aggregation: "sequence_mean" | "token_mean" | "constant".
        max_tokens: the generation budget; required by "constant".
        normalizer: the optimizer step's denominator: for "token_mean" the number
            of valid tokens in the whole step, otherwise the number of non-empty
            sequences in the whole step. None uses this call's own count.

    Returns:
        0-dim tensor.
    """
    check_ndim("values", values, 2, "[N, T]")
    check_same_shape(values=values, mask=mask)
    check_aggregation(aggregation, max_tokens, normalizer)
    valid_NT = mask.bool()
    # masked_fill, not a product: 0 * inf would be NaN in the value or the gradient.
    values_NT = values.to(compute_dtype(values)).masked_fill(~valid_NT, 0.0)
    if aggregation == "token_mean":
        total = values_NT.sum()  # DAPO Sec. 3.3: every token of the step weighs the same
        count = valid_NT.sum()
    else:
        lengths_N = valid_NT.sum(dim=-1)
        if aggregation == "sequence_mean":
            per_sequence_N = values_NT.sum(dim=-1) / lengths_N.clamp(min=1)  # GRPO eq. (3): 1/|o_i|
        else:
            assert max_tokens is not None  # checked by check_aggregation
            per_sequence_N = values_NT.sum(dim=-1) / max_tokens  # Dr.GRPO: a constant, not |o_i|
        total = per_sequence_N.sum()
        count = (lengths_N > 0).sum()
    if normalizer is not None:
        count = torch.as_tensor(normalizer, device=values.device)
    return total / count.clamp(min=1).to(total.dtype)
