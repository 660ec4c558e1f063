"""Offline preference losses on sequence log-probs: DPO, ODPO, SimPO, ORPO, KTO.

Inputs are sums of completion-token log-probs, one per example, `[B]`. Each
loss is the mean over pairs (examples for KTO).

- DPO (Rafailov et al. 2023, eq. (7)), with label smoothing from cDPO
  (Mitchell 2023): `-(1-ls) logsig(h) - ls logsig(-h)`,
  `h = beta ((pi_w - ref_w) - (pi_l - ref_l))`.
- ODPO (Amini et al. 2024): `-logsig(h - offset)`,
  `offset = alpha log(score_w - score_l)`.
- IPO (Azar et al. 2023, eq. (17)): `(h - 1/(2 tau))^2`, `h = (pi_w - ref_w) - (pi_l - ref_l)`
  (``tau`` is ``beta``), each log-ratio divided by its completion's length when the lengths are given
  (the authors' runs; see `ipo_loss`).
- SimPO (Meng et al. 2024, eq. (6)): `-logsig(beta pi_w/|y_w| - beta pi_l/|y_l| - gamma)`.
- ORPO (Hong et al. 2024, eqs. (6)-(7)): `-a_w + lam (-logsig(logodds_w - logodds_l))`,
  `a = pi/|y|`, `logodds = a - log(1 - exp(a))`.
- KTO (Ethayarajh et al. 2024, L_KTO): `w_d (1 - sigmoid(beta (r - z)))` for a
  desirable example, `w_u (1 - sigmoid(beta (z - r)))` otherwise.
- RPO's NLL term (Pang et al. 2024, eq. (2)), added to any of them:
  `-pi_w / |y_w|`, averaged over the chosen (KTO: desirable) completions.

Departures:
1. `offset` and label smoothing compose: the smoothed DPO loss is applied to
   `h - offset` (with `label_smoothing=0` this is exactly ODPO).
2. ORPO: the mean token log-prob `a` is capped at `-finfo.eps` inside the log
   odds, so a completion of probability 1 (a = 0, infinite odds) gives a large
   finite log-odds instead of inf/NaN; its NLL term is unchanged.
3. KTO's reference point `z` is computed from the given mismatched pairs of
   this batch (as TRL does), not from a running estimate.
Data-dependent preconditions (ordered ODPO scores, positive lengths) are
checked eagerly and raise with the offending indices.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.nn.functional import logsigmoid

from ._checks import (
    check_ndim,
    check_nonnegative,
    check_positive,
    check_same_shape,
    compute_dtype,
)


def _check_pairs(**tensors: Tensor | None) -> None:
    """Every given tensor is [B], all of one shape."""
    for name, tensor in tensors.items():
        if tensor is not None:
            check_ndim(name, tensor, 1, "[B]")
    check_same_shape(**tensors)


def _check_lengths(name: str, lengths: Tensor) -> None:
    bad_B = ~(lengths > 0)
    if bad_B.any():
        indices = bad_B.nonzero().flatten().tolist()
        raise ValueError(f"{name} must be > 0 (token counts); not at indices {indices}: drop empty completions")


def _pair_metrics(
    chosen_rewards_B: Tensor, rejected_rewards_B: Tensor, chosen_logps: Tensor, rejected_logps: Tensor
) -> dict[str, Tensor]:
    return {
        "rewards/chosen": chosen_rewards_B.mean().detach(),
        "rewards/rejected": rejected_rewards_B.mean().detach(),
        "rewards/margin": (chosen_rewards_B - rejected_rewards_B).mean().detach(),
        "rewards/accuracy": (chosen_rewards_B > rejected_rewards_B).to(chosen_rewards_B.dtype).mean(),
        "logps/chosen": chosen_logps.mean().detach(),
        "logps/rejected": rejected_logps.mean().detach(),
    }


def dpo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    offset: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPO loss, with cDPO label smoothing and the ODPO offset.

    Args:
        chosen_logps, rejected_logps: [B] summed completion log-probs under the policy.
        ref_chosen_logps, ref_rejected_logps: [B] under the reference (no grad).
        beta: > 0.
        label_smoothing: probability that a preference label is flipped, in [0, 0.5].
        offset: [B] ODPO margin (see `odpo_offset`), or None.

    Returns:
        (loss 0-dim, metrics): `rewards/chosen`, `rewards/rejected` (beta * (pi - ref)),
        `rewards/margin`, `rewards/accuracy`, `logps/chosen`, `logps/rejected`.
    """
    _check_pairs(chosen_logps=chosen_logps, rejected_logps=rejected_logps,
                 ref_chosen_logps=ref_chosen_logps, ref_rejected_logps=ref_rejected_logps, offset=offset)
    check_positive("beta", beta)
    if not 0.0 <= label_smoothing <= 0.5:
        raise ValueError(f"label_smoothing={label_smoothing} must lie in [0, 0.5] (0 = plain DPO)")
    dtype = compute_dtype(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, offset)
    pi_w, pi_l = chosen_logps.to(dtype), rejected_logps.to(dtype)
    chosen_rewards_B = beta * (pi_w - ref_chosen_logps.to(dtype).detach())
    rejected_rewards_B = beta * (pi_l - ref_rejected_logps.to(dtype).detach())
    h_B = chosen_rewards_B - rejected_rewards_B  # DPO eq. (7): beta * (log-ratio_w - log-ratio_l)
    if offset is not None:
        h_B = h_B - offset.to(dtype).detach()  # ODPO: the chosen must win by the offset
    losses_B = -(1 - label_smoothing) * logsigmoid(h_B) - label_smoothing * logsigmoid(-h_B)  # cDPO
    return losses_B.mean(), _pair_metrics(chosen_rewards_B, rejected_rewards_B, pi_w, pi_l)


def ipo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float = 0.1,
    chosen_lengths: Tensor | None = None,
    rejected_lengths: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """IPO loss (Azar et al. 2023, eq. (17)): the squared distance of the log-ratio margin from ``1 / (2 beta)``.

    Args:
        chosen_logps, rejected_logps: [B] summed completion log-probs under the policy.
        ref_chosen_logps, ref_rejected_logps: [B] under the reference (no grad).
        beta: the paper's tau, > 0: the margin's target is 1 / (2 beta).
        chosen_lengths, rejected_lengths: [B] completion token counts: each log-ratio is divided by its
            completion's length (both or neither given).

    Returns:
        (loss 0-dim, metrics) as ``dpo_loss``'s, the rewards ``beta * (pi - ref)``.

    Eq. (17) writes h on sequence log-likelihoods, so a sum over tokens makes the squared loss grow with the
    completions' length; the authors' reported runs divide each log-ratio by its length (TRL's
    ``loss_type="ipo"`` does, and says the authors confirmed it). The preset passes the lengths; without them
    this is eq. (17) on sums.
    """
    _check_pairs(chosen_logps=chosen_logps, rejected_logps=rejected_logps, ref_chosen_logps=ref_chosen_logps,
                 ref_rejected_logps=ref_rejected_logps, chosen_lengths=chosen_lengths,
                 rejected_lengths=rejected_lengths)
    check_positive("beta", beta)
    if (chosen_lengths is None) != (rejected_lengths is None):
        raise ValueError("ipo_loss: give chosen_lengths and rejected_lengths together, or neither")
    dtype = compute_dtype(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
    pi_w, pi_l = chosen_logps.to(dtype), rejected_logps.to(dtype)
    chosen_ratio_B = pi_w - ref_chosen_logps.to(dtype).detach()
    rejected_ratio_B = pi_l - ref_rejected_logps.to(dtype).detach()
    if chosen_lengths is not None:
        _check_lengths("chosen_lengths", chosen_lengths)
        _check_lengths("rejected_lengths", rejected_lengths)
        chosen_ratio_B = chosen_ratio_B / chosen_lengths.to(dtype)
        rejected_ratio_B = rejected_ratio_B / rejected_lengths.to(dtype)
    h_B = chosen_ratio_B - rejected_ratio_B
    losses_B = (h_B - 1 / (2 * beta)).square()  # IPO eq. (17)
    return losses_B.mean(), _pair_metrics(beta * chosen_ratio_B, beta * rejected_ratio_B, pi_w, pi_l)


def odpo_offset(chosen_scores: Tensor, rejected_scores: Tensor, *, alpha: float = 1.0) -> Tensor:
    """ODPO offset `alpha * log(score_w - score_l)` (Amini et al. 2024).

    Args:
        chosen_scores, rejected_scores: [B] scores of the pair (e.g. reward-model scores).
        alpha: scale, >= 0.

    Returns:
        [B]. Raises ValueError naming the indices where `chosen_scores <= rejected_scores`.
    """
    _check_pairs(chosen_scores=chosen_scores, rejected_scores=rejected_scores)
    check_nonnegative("alpha", alpha)
    unordered_B = ~(chosen_scores > rejected_scores)
    if unordered_B.any():
        indices = unordered_B.nonzero().flatten().tolist()
        raise ValueError(
            f"ODPO needs chosen_scores > rejected_scores for every pair; not at indices {indices}: "
            "swap chosen and rejected there, or drop those pairs"
        )
    dtype = compute_dtype(chosen_scores, rejected_scores)
    return alpha * torch.log(chosen_scores.to(dtype) - rejected_scores.to(dtype))  # ODPO offset


def simpo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    chosen_lengths: Tensor,
    rejected_lengths: Tensor,
    *,
    beta: float = 2.0,
    gamma: float = 1.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """SimPO loss: length-normalised implicit reward with a target margin, no reference.

    Args:
        chosen_logps, rejected_logps: [B] summed completion log-probs under the policy.
        chosen_lengths, rejected_lengths: [B] completion token counts |y|, > 0.
        beta: > 0.
        gamma: target reward margin.

    Returns:
        (loss 0-dim, metrics): `rewards/chosen`, `rewards/rejected` (beta * pi / |y|),
        `rewards/margin`, `rewards/accuracy`, `logps/chosen`, `logps/rejected`.
    """
    _check_pairs(chosen_logps=chosen_logps, rejected_logps=rejected_logps,
                 chosen_lengths=chosen_lengths, rejected_lengths=rejected_lengths)
    check_positive("beta", beta)
    _check_lengths("chosen_lengths", chosen_lengths)
    _check_lengths("rejected_lengths", rejected_lengths)
    dtype = compute_dtype(chosen_logps, rejected_logps)
    pi_w, pi_l = chosen_logps.to(dtype), rejected_logps.to(dtype)
    chosen_rewards_B = beta * pi_w / chosen_lengths.to(dtype)  # SimPO: reward = beta/|y| log pi
    rejected_rewards_B = beta * pi_l / rejected_lengths.to(dtype)
    losses_B = -logsigmoid(chosen_rewards_B - rejected_rewards_B - gamma)  # SimPO eq. (6)
    return losses_B.mean(), _pair_metrics(chosen_rewards_B, rejected_rewards_B, pi_w, pi_l)


def _log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x < 0, stable on both sides of -ln 2 (Maechler 2012)."""
    near_zero = x > -math.log(2)
    # Each branch gets an input that is safe for it, so the unused one cannot put NaN in the gradient.
    x_near = torch.where(near_zero, x, -1.0)
    x_far = torch.where(near_zero, -1.0, x)
    return torch.where(near_zero, torch.log(-torch.expm1(x_near)), torch.log1p(-torch.exp(x_far)))


def orpo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    chosen_lengths: Tensor,
    rejected_lengths: Tensor,
    *,
    lam: float = 0.1,
) -> tuple[Tensor, dict[str, Tensor]]:
    """ORPO loss: NLL of the chosen completion plus lam times the odds-ratio loss.

    Args:
        chosen_logps, rejected_logps: [B] summed completion log-probs under the policy.
        chosen_lengths, rejected_lengths: [B] completion token counts |y|, > 0.
        lam: weight of the odds-ratio term, >= 0.

    Returns:
        (loss 0-dim, metrics): `rewards/chosen`, `rewards/rejected` (mean log-odds
        log(P/(1-P)) with P = exp(pi/|y|)), `rewards/margin` (mean log odds ratio),
        `rewards/accuracy`, `logps/chosen`, `logps/rejected`, `nll`, `odds_ratio_loss`.
    """
    _check_pairs(chosen_logps=chosen_logps, rejected_logps=rejected_logps,
                 chosen_lengths=chosen_lengths, rejected_lengths=rejected_lengths)
    check_nonnegative("lam", lam)
    _check_lengths("chosen_lengths", chosen_lengths)
    _check_lengths("rejected_lengths", rejected_lengths)
    dtype = compute_dtype(chosen_logps, rejected_logps)
    pi_w, pi_l = chosen_logps.to(dtype), rejected_logps.to(dtype)
    a_w = pi_w / chosen_lengths.to(dtype)  # mean token log-prob, log P(y|x) in ORPO
    a_l = pi_l / rejected_lengths.to(dtype)
    cap = -torch.finfo(dtype).eps  # P = 1 has infinite odds: cap a just below 0
    logodds_w = a_w.clamp(max=cap) - _log1mexp(a_w.clamp(max=cap))  # ORPO: log odds = log(P / (1 - P))
    logodds_l = a_l.clamp(max=cap) - _log1mexp(a_l.clamp(max=cap))
    odds_ratio_loss_B = -logsigmoid(logodds_w - logodds_l)  # ORPO eq. (7)
    nll_B = -a_w  # ORPO eq. (6): L_SFT over completion tokens
    loss = (nll_B + lam * odds_ratio_loss_B).mean()  # ORPO eq. (6)
    metrics = _pair_metrics(logodds_w, logodds_l, pi_w, pi_l)
    metrics["nll"] = nll_B.mean().detach()
    metrics["odds_ratio_loss"] = odds_ratio_loss_B.mean().detach()
    return loss, metrics


def kto_loss(
    logps: Tensor,
    ref_logps: Tensor,
    desirable: Tensor,
    kl_logps: Tensor,
    kl_ref_logps: Tensor,
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """KTO loss on unpaired examples.

    Args:
        logps, ref_logps: [B] summed completion log-probs under the policy / reference.
        desirable: [B] bool, True for a desirable completion.
        kl_logps, kl_ref_logps: [B] the same for mismatched pairs (prompt i with
            completion i-1, cyclic), used only for the reference point z.
        beta: > 0.
        desirable_weight, undesirable_weight: w_d, w_u >= 0.

    Returns:
        (loss 0-dim, metrics): `rewards/desirable`, `rewards/undesirable` (mean
        beta * (pi - ref) over each kind, 0 if none), `kl` (z).
    """
    _check_pairs(logps=logps, ref_logps=ref_logps, desirable=desirable)
    _check_pairs(kl_logps=kl_logps, kl_ref_logps=kl_ref_logps)
    check_positive("beta", beta)
    check_nonnegative("desirable_weight", desirable_weight)
    check_nonnegative("undesirable_weight", undesirable_weight)
    dtype = compute_dtype(logps, ref_logps, kl_logps, kl_ref_logps)
    desirable_B = desirable.bool()
    r_B = logps.to(dtype) - ref_logps.to(dtype).detach()  # KTO implied reward log(pi/ref)
    kl_B = kl_logps.to(dtype) - kl_ref_logps.to(dtype)
    z = kl_B.mean().clamp(min=0).detach()  # KTO reference point z_0 = max(0, KL estimate)
    desirable_loss_B = desirable_weight * (1 - torch.sigmoid(beta * (r_B - z)))  # KTO L_KTO, y desirable
    undesirable_loss_B = undesirable_weight * (1 - torch.sigmoid(beta * (z - r_B)))  # y undesirable
    loss = torch.where(desirable_B, desirable_loss_B, undesirable_loss_B).mean()
    rewards_B = (beta * r_B).detach()
    metrics = {
        "rewards/desirable": _masked_mean(rewards_B, desirable_B),
        "rewards/undesirable": _masked_mean(rewards_B, ~desirable_B),
        "kl": z,
    }
    return loss, metrics


def chosen_nll(chosen_logps: Tensor, chosen_lengths: Tensor, keep: Tensor | None = None) -> Tensor:
    """Mean per-token negative log-likelihood of the chosen completions: the NLL term that RPO
    (Pang et al. 2024, "Iterative Reasoning Preference Optimization", arXiv:2404.19733, eq. (2):
    `L = L_DPO + alpha * -log M(y_w|x) / |y_w|`; TRL's `rpo_alpha`) adds to a preference loss,
    so that the chosen completions' likelihood rises instead of falling with the rejected ones'.

    Args:
        chosen_logps: `[B]` summed completion log-probs.
        chosen_lengths: `[B]` completion token counts, > 0.
        keep: `[B]` bool, the examples the term covers (KTO: the desirable ones); None = all.

    Returns:
        Scalar: the mean over all B examples of `-chosen_logps / chosen_lengths` where `keep`,
        0 elsewhere. A mean over examples like every preference loss here, so it adds up over
        micro-batches and processes (a mean over the kept ones alone would not).
    """
    check_ndim("chosen_logps", chosen_logps, 1, "[B]")
    check_same_shape(chosen_logps=chosen_logps, chosen_lengths=chosen_lengths, keep=keep)
    _check_lengths("chosen_lengths", chosen_lengths)
    dtype = compute_dtype(chosen_logps)
    per_token_B = -chosen_logps.to(dtype) / chosen_lengths.to(dtype)
    if keep is not None:
        per_token_B = per_token_B.masked_fill(~keep, 0.0)
    return per_token_B.mean()


def _masked_mean(values_B: Tensor, keep_B: Tensor) -> Tensor:
    return values_B.masked_fill(~keep_B, 0.0).sum() / keep_B.sum().clamp(min=1)
