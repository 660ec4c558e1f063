"""The trust regions after the clip: surrogates that replace PPO's hard ratio clip.

Each is a clip scheme of `policy_loss` (`CLIPS`), called as
``scheme(ratio_NT, logp_NT, adv_NT, low, high, old_NT=, valid_NT=, **options)`` and returning
``(loss_NT, clipped_NT)``: the per-token loss before aggregation and where the scheme's
trust region is active. ``low``/``high`` are the ratio bounds ``1 - eps_low``/``1 + eps_high``.

| scheme | per-token loss | source |
|---|---|---|
| `sapo` | `-(4/tau) sigmoid(tau (r - 1)) A`, `tau = tau_pos` if A > 0 else `tau_neg` | SAPO (Gao et al. 2025) eq. (5) |
| `dppo_tv`, `dppo_kl` | `-sg(clip(r)) A log pi`, 0 where the token left the divergence bound in A's direction | DPPO (Qi et al. 2026) |
| `geometric` | `-A_i exp(mean_t clip_A(log r))` on every token of completion i | GMPO (Zhao et al. 2025) eq. (4) |
| `clip_cov` | PPO's, with a random `cov_fraction` of the tokens whose covariance lies in `cov_bounds` given no gradient | Clip-Cov (Cui et al. 2025) |
| `kl_cov` | `-r A`, plus `kl_cov_coef * abs(log r)` on the `cov_fraction` of tokens of highest covariance | KL-Cov (Cui et al. 2025) |

`off_policy_sequence_mask` is DeepSeek-V3.2's off-policy sequence masking (arXiv:2512.02556): a
completion with a negative advantage whose mean `log pi_old - log pi` exceeds delta leaves the loss.
It applies on top of any scheme (`policy_loss(off_policy_mask=delta)`).

The covariance of Clip-Cov and KL-Cov is `(A - mean A) (log pi - mean log pi)` over the valid
tokens of the batch the loss sees (a micro-batch, as in the authors' code).

Departures and choices:
1. DPPO's divergence is between the policy and the sampler's recorded log-probs (`old`), as the
   paper anchors it (its Sec. 5.5); the binary KL adds 1e-8 inside its logarithm, as the
   authors' code does, so a token whose probability reaches 1 does not give inf.
2. DPPO's importance weight is bounded by `low`/`high` like CISPO's (None: unbounded); the authors'
   recipe truncates at 10000, i.e. not at all, and its Sec. 5.4 finds truncation harmful.
3. GMPO's bounds are given like every scheme's, relative to 1, and applied in log space:
   `log(1 - eps_low) <= log r <= log(1 + eps_high)` (the paper's `(e^-0.4, e^0.4)` is
   eps_low = 1 - e^-0.4, eps_high = e^0.4 - 1). Its completion advantage is the mean of the
   token advantages, so per-token advantages are averaged, as in the authors' code.
4. Clip-Cov draws its tokens with torch's global generator, as the authors' code does, so a
   seeded run repeats the draw.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

Bound = float | None


def clamp_ratio(ratio_NT: Tensor, low: Bound, high: Bound) -> Tensor:
    """The ratio clamped to [low, high], either side None = unbounded."""
    if low is None and high is None:
        return ratio_NT
    return ratio_NT.clamp(min=low, max=high)


def _none(like: Tensor) -> Tensor:
    return torch.zeros_like(like, dtype=torch.bool)


def sapo_gate(ratio_NT: Tensor, tau_NT: Tensor) -> Tensor:
    """SAPO's soft gate f(r) = (4 / tau) sigmoid(tau (r - 1)) (Gao et al. 2025, eq. (5)); its slope
    4 s (1 - s) is 1 at r = 1 and falls off faster the larger tau."""
    return torch.sigmoid(tau_NT * (ratio_NT - 1.0)) * (4.0 / tau_NT)


def _sapo_surrogate(ratio_NT: Tensor, logp_NT: Tensor, adv_NT: Tensor, low: Bound, high: Bound, *,
                    tau_pos: float, tau_neg: float, **_: object) -> tuple[Tensor, Tensor]:
    tau_NT = torch.full_like(ratio_NT, tau_neg).masked_fill(adv_NT > 0, tau_pos)  # SAPO: tau_neg > tau_pos damps A < 0 faster
    return -sapo_gate(ratio_NT, tau_NT) * adv_NT, _none(ratio_NT)


def binary_divergence(logp_NT: Tensor, old_NT: Tensor, kind: str) -> Tensor:
    """DPPO's binary approximation of the policy's divergence from the sampler at each token: the
    vocabulary collapsed to {sampled token, everything else}. ``tv``: p - p_old (signed, so the
    mask can tell a rise from a fall); ``kl``: KL(old || new) of the two Bernoullis."""
    p, p_old = logp_NT.exp(), old_NT.exp()
    if kind == "tv":
        return p - p_old
    rest = torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))  # decision 1: the authors' 1e-8
    return p_old * (old_NT - logp_NT) + (1.0 - p_old) * rest


def _dppo_surrogate(kind: str):
    def surrogate(ratio_NT: Tensor, logp_NT: Tensor, adv_NT: Tensor, low: Bound, high: Bound, *, old_NT: Tensor,
                  divergence_bound: float, **_: object) -> tuple[Tensor, Tensor]:
        divergence_NT = binary_divergence(logp_NT.detach(), old_NT, kind)
        if kind == "tv":  # DPPO-Binary-TV: p - p_old within [-delta, delta] in the direction A pushes
            outside_NT = torch.where(adv_NT > 0, divergence_NT > divergence_bound, divergence_NT < -divergence_bound)
        else:  # DPPO-Binary-KL: KL <= delta, or the token moving back towards the sampler
            p_NT, p_old_NT = logp_NT.detach().exp(), old_NT.exp()
            beyond_NT = divergence_NT > divergence_bound
            outside_NT = beyond_NT & torch.where(adv_NT > 0, p_NT > p_old_NT, p_NT < p_old_NT)
        weight_NT = clamp_ratio(ratio_NT.detach(), low, high)
        return -weight_NT * adv_NT * logp_NT * ~outside_NT, outside_NT

    surrogate.__name__ = f"_dppo_{kind}_surrogate"
    return surrogate


def _geometric_surrogate(ratio_NT: Tensor, logp_NT: Tensor, adv_NT: Tensor, low: Bound, high: Bound, *,
                         old_NT: Tensor, valid_NT: Tensor, **_: object) -> tuple[Tensor, Tensor]:
    log_ratio_NT = logp_NT - old_NT
    bounded_NT = log_ratio_NT.clamp(min=None if low is None else math.log(low),
                                    max=None if high is None else math.log(high))  # decision 3: in log space
    sign_NT = torch.sign(adv_NT)
    pessimistic_NT = sign_NT * torch.minimum(sign_NT * log_ratio_NT, sign_NT * bounded_NT)  # GMPO eq. (4)
    lengths_N1 = valid_NT.sum(-1, keepdim=True).clamp(min=1)
    log_ratio_N1 = (pessimistic_NT * valid_NT).sum(-1, keepdim=True) / lengths_N1
    adv_N1 = (adv_NT * valid_NT).sum(-1, keepdim=True) / lengths_N1
    loss_N1 = -adv_N1 * torch.exp(log_ratio_N1)  # GMPO: the geometric mean of the token ratios
    clipped_NT = (log_ratio_NT != bounded_NT) & (adv_NT != 0)
    return loss_N1.expand_as(logp_NT), clipped_NT


def token_covariance(adv_NT: Tensor, logp_NT: Tensor, valid_NT: Tensor) -> Tensor:
    """[N, T] each valid token's term of cov(A, log pi) over the valid tokens (Cui et al. 2025, eq. (11)):
    (A - mean A) (log pi - mean log pi), detached; 0 at padding."""
    count = valid_NT.sum().clamp(min=1)
    adv_mean = (adv_NT * valid_NT).sum() / count
    logp_NT = logp_NT.detach()
    logp_mean = (logp_NT * valid_NT).sum() / count
    return ((adv_NT - adv_mean) * (logp_NT - logp_mean)).masked_fill(~valid_NT, 0.0)


def _selected_count(valid_NT: Tensor, fraction: float) -> int:
    return max(int(fraction * int(valid_NT.sum())), 1)


def _clip_cov_surrogate(ratio_NT: Tensor, logp_NT: Tensor, adv_NT: Tensor, low: Bound, high: Bound, *,
                        valid_NT: Tensor, cov_fraction: float, cov_bounds: tuple[float, float],
                        **_: object) -> tuple[Tensor, Tensor]:
    unclipped_NT = -adv_NT * ratio_NT
    clipped_loss_NT = -adv_NT * clamp_ratio(ratio_NT, low, high)
    ppo_clipped_NT = (clipped_loss_NT > unclipped_NT) & valid_NT
    cov_NT = token_covariance(adv_NT, logp_NT, valid_NT)
    lower, upper = cov_bounds
    candidates = torch.nonzero(valid_NT & ~ppo_clipped_NT & (cov_NT > lower) & (cov_NT < upper))
    chosen = candidates[torch.randperm(len(candidates))[:_selected_count(valid_NT, cov_fraction)]]  # decision 4
    detached_NT = _none(ratio_NT)
    detached_NT[chosen[:, 0], chosen[:, 1]] = True
    loss_NT = torch.maximum(unclipped_NT, clipped_loss_NT).masked_fill(detached_NT, 0.0)  # Clip-Cov
    return loss_NT, detached_NT | ppo_clipped_NT


def _kl_cov_surrogate(ratio_NT: Tensor, logp_NT: Tensor, adv_NT: Tensor, low: Bound, high: Bound, *,
                      old_NT: Tensor, valid_NT: Tensor, cov_fraction: float, kl_cov_coef: float,
                      **_: object) -> tuple[Tensor, Tensor]:
    cov_NT = token_covariance(adv_NT, logp_NT, valid_NT).masked_fill(~valid_NT, -math.inf)
    k = min(_selected_count(valid_NT, cov_fraction), int(valid_NT.sum()))
    penalised_NT = _none(ratio_NT)
    penalised_NT.view(-1)[torch.topk(cov_NT.flatten(), k).indices] = True
    penalty_NT = kl_cov_coef * (logp_NT - old_NT).abs()  # KL-Cov: |log r| on the highest-covariance tokens
    return -adv_NT * ratio_NT + penalty_NT * penalised_NT, penalised_NT


def off_policy_sequence_mask(logp_NT: Tensor, old_NT: Tensor, adv_NT: Tensor, valid_NT: Tensor,
                             delta: float) -> Tensor:
    """[N, 1] 1 to keep a completion, 0 to drop it: DeepSeek-V3.2 drops those with a negative advantage (their
    mean token advantage) whose mean ``log pi_old - log pi`` over their tokens exceeds ``delta``: learning from
    one's own mistakes is what goes wrong once the policy has moved far from the one that made them."""
    lengths_N1 = valid_NT.sum(-1, keepdim=True).clamp(min=1)
    drift_N1 = ((old_NT - logp_NT.detach()) * valid_NT).sum(-1, keepdim=True) / lengths_N1
    negative_N1 = (adv_NT * valid_NT).sum(-1, keepdim=True) < 0
    return (~negative_N1 | (drift_N1 <= delta)).to(logp_NT.dtype)
