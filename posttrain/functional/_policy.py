"""Policy-gradient losses: clipped surrogates at token or sequence level, and NLL.

A policy loss is a choice of three pieces, each a small registry:

- ratio (`RATIOS`): `token` rho[i,t] = exp(logp - old) (PPO); `sequence`
  s_i = exp(mean_t (logp - old)) on every token of completion i (GSPO, Zheng et
  al. 2025, sequence-level importance ratio); `sequence_token`
  sg(s_i) * exp(logp - sg(logp)) (GSPO-token, same paper).
- clip scheme (`CLIPS`): `ppo` -min(w*A, clip(w, 1-eps_low, 1+eps_high)*A)
  (Schulman et al. 2017 eq. (7); decoupled eps_low/eps_high = DAPO's
  Clip-Higher, Sec. 3.1), optionally dual-clipped for A < 0 (Ye et al. 2020);
  `is_weight` -sg(clip(w)) * A * logp (CISPO, MiniMax-M1 2025 Sec. 3.1);
  `none` -w*A; and the trust regions that replace the clip (`_surrogates`): `sapo`
  (SAPO's soft gate), `dppo_tv`/`dppo_kl` (DPPO's divergence mask), `geometric` (GMPO),
  `clip_cov`/`kl_cov` (Cui et al. 2025), whose settings come in `clip_options`.
- aggregation (`posttrain.functional.aggregate`), with an optional KL-in-loss
  term `kl_coef * kl_estimate(logp, ref)` per token (GRPO eq. (3)).

Departures from the papers:
1. `eps_low`/`eps_high` are always relative to 1, for every scheme (CISPO's
   paper writes them as bounds of the weight); None removes that side.
2. CISPO's optional token mask (the paper's unified form) is not offered: no
   preset uses it.
3. Every token of a completion carries the GSPO loss L_i; `sequence_mean`
   then gives GSPO's mean_i L_i, other aggregations weight by length.
4. The aggregation denominator can be the optimizer step's (`normalizer`), so
   micro-batches sum to the whole step.

`policy_loss`'s metrics: `policy_loss` (the policy term alone), `clip_fraction` (share of valid
tokens where the scheme's trust region is active), `ratio_mean`, `empty_batch` (1 if no token is
valid), `kl` (token mean, when ref_logprobs is given), `dual_clip_fraction` (with dual_clip),
`off_policy_masked_fraction` (share of non-empty completions dropped, with off_policy_mask) and
`zero_gradient_fraction` (share of valid tokens with a nonzero advantage whose policy term sends no
gradient to their log-prob: PPO's clipped tokens, never CISPO's, whose clip bounds only a weight;
only when `logprobs` requires grad).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ._aggregate import aggregate, check_aggregation
from ._checks import (
    check_choice,
    check_ndim,
    check_nonnegative,
    check_same_shape,
    compute_dtype,
)
from ._kl import KL_ESTIMATORS, kl_estimate
from ._surrogates import (
    _clip_cov_surrogate,
    _dppo_surrogate,
    _geometric_surrogate,
    _kl_cov_surrogate,
    _sapo_surrogate,
    clamp_ratio,
    off_policy_sequence_mask,
)


def _sequence_log_ratio(logp_NT: Tensor, old_NT: Tensor, valid_NT: Tensor) -> Tensor:
    lengths_N1 = valid_NT.sum(dim=-1, keepdim=True).clamp(min=1)
    return (logp_NT - old_NT).sum(dim=-1, keepdim=True) / lengths_N1  # GSPO: log s_i, padding is 0


def _token_ratio(logp_NT: Tensor, old_NT: Tensor, valid_NT: Tensor) -> Tensor:
    return torch.exp(logp_NT - old_NT)  # PPO: rho[i,t] = pi / pi_old


def _sequence_ratio(logp_NT: Tensor, old_NT: Tensor, valid_NT: Tensor) -> Tensor:
    return torch.exp(_sequence_log_ratio(logp_NT, old_NT, valid_NT)).expand_as(logp_NT)  # GSPO s_i


def _sequence_token_ratio(logp_NT: Tensor, old_NT: Tensor, valid_NT: Tensor) -> Tensor:
    log_s_N1 = _sequence_log_ratio(logp_NT, old_NT, valid_NT).detach()
    return torch.exp(log_s_N1 + logp_NT - logp_NT.detach())  # GSPO-token: sg(s_i) * pi / sg(pi)


RATIOS: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = {
    "token": _token_ratio,
    "sequence": _sequence_ratio,
    "sequence_token": _sequence_token_ratio,
}

Bound = float | None
Surrogate = Callable[..., tuple[Tensor, Tensor]]
"""``fn(ratio_NT, logp_NT, adv_NT, low, high, *, old_NT, valid_NT, **clip_options) -> (loss_NT, clipped_NT)``."""


def _above(ratio_NT: Tensor, bound: Bound) -> Tensor:
    return torch.zeros_like(ratio_NT, dtype=torch.bool) if bound is None else ratio_NT > bound


def _below(ratio_NT: Tensor, bound: Bound) -> Tensor:
    return torch.zeros_like(ratio_NT, dtype=torch.bool) if bound is None else ratio_NT < bound


def _ppo_surrogate(
    ratio_NT: Tensor, logp_NT: Tensor, adv_NT: Tensor, low: Bound, high: Bound, **_: object
) -> tuple[Tensor, Tensor]:
    surrogate_NT = torch.minimum(ratio_NT * adv_NT, clamp_ratio(ratio_NT, low, high) * adv_NT)
    clipped_NT = ((adv_NT > 0) & _above(ratio_NT, high)) | ((adv_NT < 0) & _below(ratio_NT, low))
    return -surrogate_NT, clipped_NT  # PPO eq. (7); DAPO Clip-Higher: low != high


def _is_weight_surrogate(
    ratio_NT: Tensor, logp_NT: Tensor, adv_NT: Tensor, low: Bound, high: Bound, **_: object
) -> tuple[Tensor, Tensor]:
    weight_NT = clamp_ratio(ratio_NT, low, high).detach()
    clipped_NT = _above(ratio_NT, high) | _below(ratio_NT, low)
    return -weight_NT * adv_NT * logp_NT, clipped_NT  # CISPO: sg(clip(r)) * A * log pi


def _unclipped_surrogate(
    ratio_NT: Tensor, logp_NT: Tensor, adv_NT: Tensor, low: Bound, high: Bound, **_: object
) -> tuple[Tensor, Tensor]:
    return -ratio_NT * adv_NT, torch.zeros_like(ratio_NT, dtype=torch.bool)  # importance-weighted PG


CLIPS: dict[str, Surrogate] = {
    "ppo": _ppo_surrogate,
    "is_weight": _is_weight_surrogate,
    "none": _unclipped_surrogate,
    "sapo": _sapo_surrogate,
    "dppo_tv": _dppo_surrogate("tv"),
    "dppo_kl": _dppo_surrogate("kl"),
    "geometric": _geometric_surrogate,
    "clip_cov": _clip_cov_surrogate,
    "kl_cov": _kl_cov_surrogate,
}
CLIP_OPTIONS: dict[str, tuple[str, ...]] = {
    "sapo": ("tau_pos", "tau_neg"),
    "dppo_tv": ("divergence_bound",),
    "dppo_kl": ("divergence_bound",),
    "clip_cov": ("cov_fraction", "cov_bounds"),
    "kl_cov": ("cov_fraction", "kl_cov_coef"),
}
"""The `clip_options` each clip scheme needs (the others need none)."""


def check_clip_options(clip: str, options: dict[str, object]) -> None:
    needed = CLIP_OPTIONS.get(clip, ())
    missing, unused = [k for k in needed if k not in options], [k for k in options if k not in needed]
    if missing or unused:
        raise ValueError(f"clip={clip!r} needs clip_options {', '.join(needed) or '(none)'}; "
                         + (f"missing {', '.join(missing)}" if missing else f"{', '.join(unused)} not used"))
    for key in ("tau_pos", "tau_neg", "cov_fraction"):
        if key in options and not options[key] > 0:
            raise ValueError(f"clip_options {key}={options[key]} must be > 0")
    for key in ("divergence_bound", "kl_cov_coef"):
        check_nonnegative(key, options.get(key))
    if "cov_bounds" in options and not (len(options["cov_bounds"]) == 2 and options["cov_bounds"][0] < options["cov_bounds"][1]):
        raise ValueError(f"clip_options cov_bounds={options['cov_bounds']} must be (lower, upper) with lower < upper")


def _check_policy_args(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    ref_logprobs: Tensor | None,
    ratio: str,
    clip: str,
    eps_low: float | None,
    eps_high: float | None,
    dual_clip: float | None,
    kl_coef: float,
    kl_estimator: str,
    clip_options: dict[str, object],
    off_policy_mask: float | None,
) -> None:
    check_ndim("logprobs", logprobs, 2, "[N, T]")
    check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, mask=mask, ref_logprobs=ref_logprobs)
    if advantages.shape not in (logprobs.shape, logprobs.shape[:1]):
        raise ValueError(
            f"advantages has shape {list(advantages.shape)} but logprobs has shape "
            f"{list(logprobs.shape)}; advantages must be [N] (per sequence) or [N, T] (per token)"
        )
    check_choice("ratio", ratio, RATIOS)
    check_choice("clip", clip, CLIPS)
    check_choice("kl_estimator", kl_estimator, KL_ESTIMATORS)
    check_nonnegative("eps_low", eps_low)
    check_nonnegative("eps_high", eps_high)
    check_nonnegative("kl_coef", kl_coef)
    check_nonnegative("off_policy_mask", off_policy_mask)
    check_clip_options(clip, clip_options)
    if ratio != "token" and clip == "geometric":
        raise ValueError("clip='geometric' (GMPO) builds its own sequence ratio from the token ratios; use ratio='token'")
    if dual_clip is not None and (clip != "ppo" or dual_clip <= 1):
        raise ValueError(f"dual_clip={dual_clip} needs clip='ppo' and a value > 1 (verl uses 3.0), or None")
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logprobs; pass them or set kl_coef=0.0")


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    ratio: str = "token",
    clip: str = "ppo",
    eps_low: float | None = 0.2,
    eps_high: float | None = 0.2,
    dual_clip: float | None = None,
    aggregation: str = "sequence_mean",
    max_tokens: int | None = None,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    normalizer: float | Tensor | None = None,
    clip_options: dict[str, object] | None = None,
    off_policy_mask: float | None = None,
    kl_importance_weighted: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped policy-gradient loss (PPO, GRPO, DAPO, CISPO, GSPO, SAPO, DPPO, GMPO, ...), minimised.

    Args:
        logprobs: [N, T] log-probs of the sampled tokens under the policy (with grad).
        old_logprobs: [N, T] under the policy that sampled them (no grad).
        advantages: [N] per completion (broadcast to its tokens) or [N, T] per token.
        mask: [N, T] 1 for completion tokens, 0 for padding.
        ratio: "token" | "sequence" (GSPO) | "sequence_token" (GSPO-token).
        clip: "ppo" | "is_weight" (CISPO) | "none" | "sapo" | "dppo_tv" | "dppo_kl" (DPPO's weight is
            bounded like CISPO's) | "geometric" (GMPO) | "clip_cov" | "kl_cov" (see `_surrogates`).
        eps_low, eps_high: clip range [1 - eps_low, 1 + eps_high]; None = unbounded side.
        dual_clip: c > 1, for A < 0 bound the loss by -c*A (clip="ppo" only).
        aggregation: "sequence_mean" | "token_mean" | "constant" (see `aggregate`).
        max_tokens: the generation budget; required by "constant".
        ref_logprobs: [N, T] under the reference policy; needed when kl_coef > 0.
        kl_coef: beta of the KL-in-loss term.
        kl_estimator: "k1" | "k2" | "k3".
        normalizer: the optimizer step's denominator (see `aggregate`); None = this batch.
        clip_options: the scheme's settings, by name (`CLIP_OPTIONS`; `_surrogates` defines them).
        off_policy_mask: delta of DeepSeek-V3.2's off-policy sequence mask (`_surrogates`); None = off.
        kl_importance_weighted: weight the KL term by pi / pi_old (DeepSeek-V3.2's unbiased KL).

    Returns:
        (loss 0-dim, metrics): the module docstring's metrics, 0-dim and detached.
    """
    clip_options = dict(clip_options or {})
    _check_policy_args(logprobs, old_logprobs, advantages, mask, ref_logprobs, ratio, clip,
                       eps_low, eps_high, dual_clip, kl_coef, kl_estimator, clip_options, off_policy_mask)
    check_aggregation(aggregation, max_tokens, normalizer)
    valid_NT = mask.bool()
    dtype = compute_dtype(logprobs, old_logprobs, advantages, ref_logprobs)
    # Padding is replaced (not multiplied by 0) before any exp: garbage there never becomes NaN.
    logp_NT = logprobs.to(dtype).masked_fill(~valid_NT, 0.0)
    old_NT = old_logprobs.to(dtype).detach().masked_fill(~valid_NT, 0.0)
    adv_NT = advantages.to(dtype).detach()
    adv_NT = adv_NT[:, None].expand_as(logp_NT) if adv_NT.dim() == 1 else adv_NT.masked_fill(~valid_NT, 0.0)

    low = None if eps_low is None else 1.0 - eps_low
    high = None if eps_high is None else 1.0 + eps_high
    ratio_NT = RATIOS[ratio](logp_NT, old_NT, valid_NT)
    loss_NT, clipped_NT = CLIPS[clip](ratio_NT, logp_NT, adv_NT, low, high, old_NT=old_NT, valid_NT=valid_NT,
                                      **clip_options)
    loss_NT, metrics = _bound_and_mask(loss_NT, logp_NT, old_NT, adv_NT, valid_NT, dual_clip, off_policy_mask)

    def reduce(values_NT: Tensor) -> Tensor:
        return aggregate(values_NT, valid_NT, aggregation, max_tokens=max_tokens, normalizer=normalizer)

    if logp_NT.requires_grad:
        metrics["zero_gradient_fraction"] = _zero_gradient_fraction(loss_NT, logp_NT, adv_NT, valid_NT)
    policy_term = reduce(loss_NT)
    loss = policy_term
    if ref_logprobs is not None:
        ref_NT = ref_logprobs.to(dtype).detach().masked_fill(~valid_NT, 0.0)
        kl_NT = kl_estimate(logp_NT, ref_NT, kl_estimator)
        if kl_importance_weighted:  # DeepSeek-V3.2: E_{pi_old}[(pi / pi_old) k3] estimates KL(pi || ref) unbiasedly
            kl_NT = kl_NT * ratio_NT
        if kl_coef > 0:
            loss = loss + kl_coef * reduce(kl_NT)  # GRPO eq. (3): beta * KL, aggregated like the policy term
        metrics["kl"] = _token_mean(kl_NT.detach(), valid_NT)
    metrics |= {
        "policy_loss": policy_term.detach(),
        "clip_fraction": _token_mean(clipped_NT.to(dtype), valid_NT),
        "ratio_mean": _token_mean(ratio_NT.detach(), valid_NT),
        "empty_batch": (~valid_NT.any()).to(dtype),
    }
    return loss, metrics


def _zero_gradient_fraction(loss_NT: Tensor, logp_NT: Tensor, adv_NT: Tensor, valid_NT: Tensor) -> Tensor:
    """Share of valid tokens with a nonzero advantage whose loss sends no gradient to their log-prob, by a
    backward through the elementwise surrogate only (not the model)."""
    (grad_NT,) = torch.autograd.grad(loss_NT.sum(), logp_NT, retain_graph=True)
    dropped_NT = (grad_NT == 0) & (adv_NT != 0) & valid_NT
    return _token_mean(dropped_NT.to(loss_NT.dtype), valid_NT)


def _bound_and_mask(loss_NT: Tensor, logp_NT: Tensor, old_NT: Tensor, adv_NT: Tensor, valid_NT: Tensor,
                    dual_clip: float | None, off_policy_mask: float | None) -> tuple[Tensor, dict[str, Tensor]]:
    """The per-token loss [N, T] after the dual clip and DeepSeek-V3.2's off-policy sequence mask (each when set),
    with the shares of tokens and completions they acted on."""
    metrics: dict[str, Tensor] = {}
    if dual_clip is not None:
        loss_NT, dual_clipped_NT = _dual_clip(loss_NT, adv_NT, dual_clip)
        metrics["dual_clip_fraction"] = _token_mean(dual_clipped_NT.to(loss_NT.dtype), valid_NT)
    if off_policy_mask is not None:
        kept_N1 = off_policy_sequence_mask(logp_NT, old_NT, adv_NT, valid_NT, off_policy_mask)
        loss_NT = loss_NT * kept_N1
        rows_N = valid_NT.any(-1)
        metrics["off_policy_masked_fraction"] = (1 - kept_N1[rows_N]).sum().detach() / rows_N.sum().clamp(min=1)
    return loss_NT, metrics


def _dual_clip(loss_NT: Tensor, adv_NT: Tensor, c: float) -> tuple[Tensor, Tensor]:
    """Dual-clip PPO (Ye et al. 2020): where A < 0 the loss is at most -c * A. Returns the bounded
    loss [N, T] and where the bound is active [N, T]."""
    bound_NT = -c * adv_NT
    return torch.where(adv_NT < 0, torch.minimum(loss_NT, bound_NT), loss_NT), (adv_NT < 0) & (bound_NT < loss_NT)


def _token_mean(values_NT: Tensor, valid_NT: Tensor) -> Tensor:
    return aggregate(values_NT, valid_NT, "token_mean").detach()


def nll_loss(
    logprobs: Tensor,
    mask: Tensor,
    *,
    aggregation: str = "token_mean",
    normalizer: float | Tensor | None = None,
    max_tokens: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Negative log-likelihood of the sampled tokens (SFT; best-of-N / RAFT, Dong et al. 2023).

    Args:
        logprobs: [N, T] log-probs of the target tokens under the policy.
        mask: [N, T] 1 for completion tokens, 0 for padding.
        aggregation, max_tokens, normalizer: as in `aggregate`.

    Returns:
        (loss 0-dim, metrics): `nll` (the loss, detached), `empty_batch`.
    """
    check_ndim("logprobs", logprobs, 2, "[N, T]")
    check_same_shape(logprobs=logprobs, mask=mask)
    valid_NT = mask.bool()
    logp_NT = logprobs.to(compute_dtype(logprobs)).masked_fill(~valid_NT, 0.0)
    loss = aggregate(-logp_NT, valid_NT, aggregation, max_tokens=max_tokens, normalizer=normalizer)
    return loss, {"nll": loss.detach(), "empty_batch": (~valid_NT.any()).to(logp_NT.dtype)}
