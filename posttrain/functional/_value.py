"""PPO's clipped value loss.

Per token `0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)`, as in
OpenAI baselines' PPO2 and cleanrl (the PPO paper itself has an unclipped
squared error), aggregated with `posttrain.functional.aggregate`.

Departures: none from that implementation; `clip=None` gives the unclipped
loss of the paper.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._aggregate import aggregate
from ._checks import check_ndim, check_nonnegative, check_same_shape, compute_dtype


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip: float | None = 0.2,
    aggregation: str = "sequence_mean",
    normalizer: float | Tensor | None = None,
    max_tokens: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value-function loss (PPO).

    Args:
        values: [N, T] value predictions V of the model being trained (with grad).
        old_values: [N, T] predictions at rollout time V_old (no grad).
        returns: [N, T] targets R (e.g. from `gae`; no grad).
        mask: [N, T] 1 for completion tokens, 0 for padding.
        clip: c >= 0, the allowed move of V away from V_old; None = no clipping.
        aggregation, max_tokens, normalizer: as in `aggregate`.

    Returns:
        (loss 0-dim, metrics): `value_clip_fraction` (share of valid tokens where the
        clipped error is the larger one), `explained_variance` (1 - Var[R - V] / Var[R]
        over valid tokens, 0 when Var[R] = 0). All 0-dim and detached.
    """
    check_ndim("values", values, 2, "[N, T]")
    check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    check_nonnegative("clip", clip)
    valid_NT = mask.bool()
    dtype = compute_dtype(values, old_values, returns)
    values_NT = values.to(dtype).masked_fill(~valid_NT, 0.0)
    old_NT = old_values.to(dtype).detach().masked_fill(~valid_NT, 0.0)
    returns_NT = returns.to(dtype).detach().masked_fill(~valid_NT, 0.0)

    unclipped_NT = (values_NT - returns_NT).square()
    if clip is None:
        clipped_NT = unclipped_NT
    else:
        clipped_values_NT = old_NT + (values_NT - old_NT).clamp(-clip, clip)  # PPO2 value clipping
        clipped_NT = (clipped_values_NT - returns_NT).square()
    loss_NT = 0.5 * torch.maximum(unclipped_NT, clipped_NT)
    loss = aggregate(loss_NT, valid_NT, aggregation, max_tokens=max_tokens, normalizer=normalizer)

    count = valid_NT.sum().clamp(min=1)
    clip_fraction = ((clipped_NT > unclipped_NT) & valid_NT).sum() / count
    metrics = {
        "value_clip_fraction": clip_fraction.to(dtype).detach(),
        "explained_variance": explained_variance(values_NT.detach(), returns_NT, valid_NT),
    }
    return loss, metrics


def explained_variance(values_NT: Tensor, returns_NT: Tensor, valid_NT: Tensor) -> Tensor:
    """1 - Var[R - V] / Var[R] over valid entries; 0 when Var[R] is 0."""
    count = valid_NT.sum().clamp(min=1)

    def variance(x_NT: Tensor) -> Tensor:
        mean = x_NT.masked_fill(~valid_NT, 0.0).sum() / count
        return (x_NT - mean).masked_fill(~valid_NT, 0.0).square().sum() / count

    returns_variance = variance(returns_NT)
    residual_variance = variance(returns_NT - values_NT)
    ratio = residual_variance / returns_variance.clamp(min=torch.finfo(returns_variance.dtype).tiny)
    return torch.where(returns_variance > 0, 1 - ratio, 0.0)
