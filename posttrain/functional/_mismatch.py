"""Correction for samples drawn by a sampler that is not the policy being trained.

The sampler `pi_s` (another engine, another precision, an older copy of the weights) drew the
tokens; the loss's "old" policy `pi_old` is the trainer's. The policy gradient is on-policy for
`pi_old` after re-weighting each token by `rho_t = pi_old(y_t) / pi_s(y_t) = exp(old - sampler)`.
That ratio's variance grows with the mismatch, so it is bounded, at one of three levels:

- ``token``, ``truncate``: `w_t = min(rho_t, high)`: truncated importance sampling (TIS; Yao et al.
  2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training", cap 2).
- ``token``, ``mask``: `w_t = 1` where `low <= rho_t <= high`, else 0 (the token leaves the update).
- ``sequence``, ``truncate`` / ``mask``: the same on the sequence ratio `rho = prod_t rho_t`, one
  weight for every token of the sequence (Liu et al. 2025, "When Speed Kills Stability:
  Demystifying RL Collapse from the Training-Inference Mismatch").
- ``geometric``, ``mask``: a sequence whose geometric-mean ratio `exp(mean_t log rho_t)` lies outside
  `[low, high]` leaves the update (the same paper's length-independent sequence mask).

Defaults: `high = 2`, and `low = 1 / high` where a mask needs a lower bound. Sequence ratios are
compared in log space, so a product of many ratios never overflows.

Metrics, on the completion tokens: the mismatch KL(pi_s || pi_old) estimated on the sampler's own
tokens, `k1 = mean(sampler - old)` and `k3 = mean(rho - 1 - log rho)`; the effective sample size of
the weights at their level, `(sum w)^2 / (n * sum w^2)` (1 when all weights are equal, 0 when all
are 0); and the shares of tokens whose weight was truncated below its ratio or masked to 0.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._checks import check_choice, check_same_shape, compute_dtype

LEVELS = ("token", "sequence", "geometric")
MODES = ("truncate", "mask")


def rollout_correction(logprobs_old: Tensor, sampler_logprobs: Tensor, mask: Tensor, *, level: str = "token",
                       mode: str = "truncate", high: float = 2.0,
                       low: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Importance weights that correct for the sampler, and their metrics.

    Args:
        logprobs_old: [N, T] the trainer's log-probs of the sampled tokens (the loss's old policy).
        sampler_logprobs: [N, T] the sampler's log-probs of the same tokens.
        mask: [N, T] 1 for completion tokens.
        level: "token" | "sequence" | "geometric" (geometric: mask mode only).
        mode: "truncate" (weights capped at ``high``) | "mask" (weights 1 inside ``[low, high]``, else 0).
        high: the cap, or the band's upper bound, > 0.
        low: the band's lower bound (mask mode), default ``1 / high``.

    Returns:
        weights: [N, T] detached, 0 on padding, to multiply the policy-gradient term of each token.
        metrics: ``mismatch/kl_k1``, ``mismatch/kl_k3``, ``mismatch/ess``, ``mismatch/truncated_fraction``,
        ``mismatch/masked_fraction``: 0-dim detached tensors.
    """
    check_choice("level", level, LEVELS)
    check_choice("mode", mode, MODES)
    check_same_shape(logprobs_old=logprobs_old, sampler_logprobs=sampler_logprobs, mask=mask)
    if level == "geometric" and mode != "mask":
        raise ValueError("level 'geometric' bounds sequences by a band: use mode 'mask'")
    if high <= 0:
        raise ValueError(f"high must be > 0, got {high}")
    low = 1.0 / high if low is None else low
    if mode == "mask" and not 0 < low <= high:
        raise ValueError(f"the band needs 0 < low <= high, got low={low}, high={high}")
    dtype = compute_dtype(logprobs_old, sampler_logprobs)
    valid = mask.to(torch.bool)
    # padded positions may hold anything (inf, NaN): zero their log-ratio before any sum
    log_ratio = torch.where(valid, logprobs_old.detach().to(dtype) - sampler_logprobs.detach().to(dtype), 0.0)
    if level == "token":
        unit_log_ratio = log_ratio
    else:
        lengths = valid.sum(-1, keepdim=True)
        total = log_ratio.sum(-1, keepdim=True)
        unit_log_ratio = total if level == "sequence" else total / lengths.clamp(min=1)
    if mode == "truncate":
        unit_weights = unit_log_ratio.clamp(max=math.log(high)).exp()
    else:
        unit_weights = ((unit_log_ratio >= math.log(low)) & (unit_log_ratio <= math.log(high))).to(dtype)
    weights = (unit_weights.expand_as(log_ratio) * valid).detach()
    capped = unit_log_ratio > math.log(high) if mode == "truncate" else torch.zeros_like(unit_log_ratio, dtype=torch.bool)
    return weights, _metrics(log_ratio, capped, weights, valid, level)


def _metrics(log_ratio: Tensor, capped: Tensor, weights: Tensor, valid: Tensor, level: str) -> dict[str, Tensor]:
    tokens = valid.sum().clamp(min=1)
    # KL(pi_s || pi_old) on the sampler's tokens: with d = log(pi_old / pi_s), k1 = -d, k3 = exp(d) - 1 - d
    k1 = torch.where(valid, -log_ratio, 0.0).sum() / tokens
    k3 = torch.where(valid, torch.expm1(log_ratio) - log_ratio, 0.0).sum() / tokens
    if level == "token":
        unit_w, units = weights[valid], valid
    else:
        units = valid.any(-1, keepdim=True)
        unit_w = weights.max(-1, keepdim=True).values[units]  # the sequence's one weight
    n = units.sum().clamp(min=1)
    ess = unit_w.sum().square() / (n * unit_w.square().sum()).clamp(min=torch.finfo(weights.dtype).tiny)
    truncated = valid & capped.expand_as(log_ratio)
    masked = valid & (weights == 0)
    return {"mismatch/kl_k1": k1.detach(), "mismatch/kl_k3": k3.detach(), "mismatch/ess": ess.detach(),
            "mismatch/truncated_fraction": (truncated.sum() / tokens).detach(),
            "mismatch/masked_fraction": (masked.sum() / tokens).detach()}
