"""Sequence-level advantage estimators on grouped rewards, and REINFORCE++.

Rewards are `[B, G]`: B prompts, G completions each. The estimators form a
registry (`ADVANTAGE_ESTIMATORS`), so a preset names one by string:

| name | formula | source |
|---|---|---|
| `group` | `(r_i - mean(r)) / (std(r) + eps)`, unbiased std | GRPO (Shao et al. 2024) Sec. 4.1.2 |
| `group_mean` | `r_i - mean(r)` | Dr.GRPO (Liu et al. 2025) |
| `group_batch_std` | `(r_i - mean(r)) / (std(R) + eps)`, R every reward of the batch, unbiased | Lite PPO (Liu et al. 2025, arXiv:2508.08221) Sec. 4.1 |
| `rloo` | `r_i - sum_{j!=i} r_j / (G - 1)` | RLOO (Kool et al. 2019; Ahmadian et al. 2024) |
| `greedy_baseline` | `r_i - r_greedy` | ReMax (Li et al. 2023) |
| `maxrl` | `(r_i - mean(r)) / (mean(r) + eps)`, rewards >= 0 | MaxRL (Tajwar et al. 2026, arXiv:2602.02710) |

MaxRL's estimator with binary rewards and K of G correct is `G r_i / K - 1`: the gradient
`(1/K) sum_{correct} grad log p - (1/G) sum_all grad log p`, an unbiased estimate of the gradient of
the truncated log pass rate (the paper's maximum-likelihood objective), which weighs a prompt by the
inverse of its pass rate where GRPO's std weighs it by `1/sqrt(p(1-p))`.

`reinforce_pp_advantages` is REINFORCE++ (Hu 2025): KL-shaped token rewards,
gamma = 1 returns, whitened over the batch; with `baseline=True`, the
REINFORCE++-baseline variant that first subtracts the group mean. Step rewards
(a process reward's, at the tokens where steps end) are added to the token rewards.

`gdpo_advantages` is GDPO (arXiv:2601.05242): each reward function's values normalised within the
group first, then weighted, summed and normalised over the batch, so one reward's scale cannot drown
the others'.

`distillation_advantages` is on-policy distillation's per-token advantage: the teacher's minus
the student's log-prob of each sampled token, the negative of the per-token reverse-KL estimate.

`process_advantages` is GRPO's process supervision (Shao et al. 2024, Sec. 4.1.3):
every step reward of a group's G completions normalised by the mean and std of
all of them, and a token's advantage the sum of the normalised rewards of the
steps that end at or after it.

Departures: a group whose rewards are all equal gets an advantage of exactly
0 (the papers' formulas give 0/eps of rounding noise or NaN); the group std is
floored at the smallest normal float before the square root so that its
gradient stays finite for constant groups.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ._checks import (
    check_choice,
    check_ndim,
    check_nonnegative,
    check_same_shape,
    compute_dtype,
)
from ._returns import discounted_returns, kl_shaped_rewards, whiten


def _group_centered(rewards_BG: Tensor) -> Tensor:
    return rewards_BG - rewards_BG.mean(dim=1, keepdim=True)


def _group(rewards_BG: Tensor, eps: float) -> Tensor:
    centered_BG = _group_centered(rewards_BG)
    variance_B1 = centered_BG.square().sum(dim=1, keepdim=True) / (rewards_BG.shape[1] - 1)  # Bessel
    std_B1 = variance_B1.clamp(min=torch.finfo(variance_B1.dtype).tiny).sqrt()
    return centered_BG / (std_B1 + eps)  # GRPO Sec. 4.1.2: (r_i - mean(r)) / std(r)


def _group_mean(rewards_BG: Tensor, eps: float) -> Tensor:
    return _group_centered(rewards_BG)  # Dr.GRPO: no division by the std


def _group_batch_std(rewards_BG: Tensor, eps: float) -> Tensor:
    if rewards_BG.numel() < 2:
        return _group_centered(rewards_BG)
    return _group_centered(rewards_BG) / (rewards_BG.std() + eps)  # Lite PPO: group mean, batch std


def _maxrl(rewards_BG: Tensor, eps: float) -> Tensor:
    negative_BG = rewards_BG < 0
    if negative_BG.any():
        where = negative_BG.nonzero()[0].tolist()
        raise ValueError(f"estimator 'maxrl' takes rewards >= 0 (a pass rate divides them); reward "
                         f"{rewards_BG[where[0], where[1]].item():g} at [{where[0]}, {where[1]}]: use rewards in [0, 1]")
    mean_B1 = rewards_BG.mean(dim=1, keepdim=True)
    return (rewards_BG - mean_B1) / (mean_B1 + eps)  # MaxRL: divided by the group's mean (pass rate)


def _rloo(rewards_BG: Tensor, eps: float) -> Tensor:
    others_mean_BG = (rewards_BG.sum(dim=1, keepdim=True) - rewards_BG) / (rewards_BG.shape[1] - 1)
    return rewards_BG - others_mean_BG  # RLOO (Kool et al. 2019): leave-one-out baseline


GROUP_ESTIMATORS: dict[str, Callable[[Tensor, float], Tensor]] = {
    "group": _group,
    "group_mean": _group_mean,
    "group_batch_std": _group_batch_std,
    "rloo": _rloo,
    "maxrl": _maxrl,
}
ADVANTAGE_ESTIMATORS = (*GROUP_ESTIMATORS, "greedy_baseline")


def _check_group_size(estimator: str, group_size: int, shape: list[int]) -> None:
    if group_size < 2:
        raise ValueError(
            f"advantage estimator {estimator!r} needs at least 2 completions per prompt, "
            f"got rewards of shape {shape} (G = {group_size}); sample G >= 2 completions "
            "per prompt, or use 'greedy_baseline' with one greedy decode per prompt"
        )


def advantages(
    estimator: str,
    rewards: Tensor,
    *,
    baseline: Tensor | None = None,
    eps: float = 1e-6,
) -> Tensor:
    """Sequence-level advantages from grouped rewards.

    Args:
        estimator: "group" | "group_mean" | "group_batch_std" | "rloo" | "maxrl" | "greedy_baseline".
        rewards: [B, G] rewards of G completions for each of B prompts.
        baseline: [B] reward of each prompt's greedy decode; "greedy_baseline" only.
        eps: added to the group std ("group") or mean ("maxrl"), >= 0.

    Returns:
        [B, G] advantages. A group whose rewards are all equal gets exactly 0.
    """
    check_choice("estimator", estimator, ADVANTAGE_ESTIMATORS)
    check_ndim("rewards", rewards, 2, "[B, G]")
    check_nonnegative("eps", eps)
    rewards_BG = rewards.to(compute_dtype(rewards, baseline))
    if estimator == "greedy_baseline":
        if baseline is None:
            raise ValueError("estimator 'greedy_baseline' needs baseline=[B] rewards of the greedy decodes")
        check_ndim("baseline", baseline, 1, "[B]")
        if baseline.shape[0] != rewards.shape[0]:
            raise ValueError(
                f"baseline has shape {list(baseline.shape)} but rewards has shape "
                f"{list(rewards.shape)}; baseline needs one entry per prompt (row of rewards)"
            )
        return rewards_BG - baseline.to(rewards_BG.dtype)[:, None]  # ReMax: r_i - r(greedy)
    if baseline is not None:
        raise ValueError(f"baseline is used only by 'greedy_baseline', not by {estimator!r}; drop it")
    _check_group_size(estimator, rewards.shape[1], list(rewards.shape))
    advantages_BG = GROUP_ESTIMATORS[estimator](rewards_BG, eps)
    constant_B1 = (rewards_BG == rewards_BG[:, :1]).all(dim=1, keepdim=True)
    return advantages_BG.masked_fill(constant_B1, 0.0)


def reinforce_pp_advantages(
    rewards: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    *,
    kl_coef: float,
    baseline: bool = False,
    group_size: int | None = None,
    eps: float = 1e-6,
    step_rewards: Tensor | None = None,
) -> Tensor:
    """REINFORCE++ token advantages (Hu 2025), optionally with the group-mean baseline.

    Args:
        rewards: [N] scalar rewards, N = B * G with each prompt's G completions contiguous.
        logprobs: [N, T] log-probs of the sampled tokens under the sampling policy.
        ref_logprobs: [N, T] under the reference policy.
        mask: [N, T] 1 for completion tokens, 0 for padding.
        kl_coef: beta of the k1 KL penalty in the token rewards, >= 0.
        baseline: REINFORCE++-baseline: subtract each group's mean reward first.
        group_size: G; required with `baseline=True` (G >= 2), not used otherwise.
        eps: added to the std when whitening, >= 0.
        step_rewards: [N, T] a process reward's step rewards, each at the token where its step ends
            (0 elsewhere), added to the token rewards; the baseline does not see them. None = none.

    Returns:
        [N, T] whitened token returns, 0 at padding.
    """
    check_ndim("rewards", rewards, 1, "[N]")
    if baseline:
        if group_size is None:
            raise ValueError("baseline=True needs group_size (G, the completions per prompt)")
        if group_size < 2:
            raise ValueError(
                f"baseline=True needs group_size >= 2 (got {group_size}): a group mean of one "
                "completion is the reward itself; sample G >= 2 completions per prompt"
            )
        if rewards.shape[0] % group_size != 0:
            raise ValueError(
                f"rewards has {rewards.shape[0]} entries, not a multiple of group_size={group_size}; "
                "pass the completions of each prompt contiguously, G per prompt"
            )
        rewards = advantages("group_mean", rewards.reshape(-1, group_size)).reshape(-1)
    elif group_size is not None:
        raise ValueError("group_size is used only with baseline=True; drop it or set baseline=True")
    token_rewards_NT = kl_shaped_rewards(rewards, logprobs, ref_logprobs, mask, kl_coef=kl_coef,
                                         step_rewards=step_rewards)
    returns_NT = discounted_returns(token_rewards_NT, mask, gamma=1.0)  # REINFORCE++: gamma = 1
    return whiten(returns_NT, mask, eps=eps)  # REINFORCE++: global batch normalisation


def process_advantages(
    step_rewards: Tensor,
    step_ends: Tensor,
    mask: Tensor,
    *,
    group_size: int,
    scale: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """GRPO's process supervision (DeepSeekMath, Shao et al. 2024, Sec. 4.1.3): token advantages from
    step rewards.

    ``r~ = (r - mean(R)) / std(R)`` for every step reward ``r`` of a group, where ``R`` holds the step
    rewards of all the group's G completions; then ``A[i, t] = sum of r~ over the steps of completion i
    that end at or after token t`` (the paper's "sum of the normalized rewards from the following steps").

    Args:
        step_rewards: [N, T] the reward of the step ending at token t (read only where ``step_ends``).
        step_ends: [N, T] bool, True at each token where a step ends (at most one step per token).
        mask: [N, T] 1 for completion tokens, 0 for padding; N = B * G, each prompt's G rows contiguous.
        group_size: G >= 2.
        scale: divide by the group's std (GRPO, unbiased); False only centres (Dr.GRPO's group mean).
        eps: added to the std, >= 0.

    Returns:
        [N, T] advantages, 0 at padding and after a completion's last step. A group whose step rewards are
        all equal (or that has one step) gets exactly 0.
    """
    check_ndim("step_rewards", step_rewards, 2, "[N, T]")
    check_same_shape(step_rewards=step_rewards, step_ends=step_ends, mask=mask)
    check_nonnegative("eps", eps)
    n, t = step_rewards.shape
    _check_group_size("process supervision", group_size, [n // max(group_size, 1), group_size])
    if n % group_size:
        raise ValueError(f"step_rewards has {n} rows, not a multiple of group_size={group_size}; pass each "
                         "prompt's G completions contiguously")
    if (step_ends.bool() & ~mask.bool()).any():
        raise ValueError("step_ends marks a padding position; a step must end at a completion token")
    dtype = compute_dtype(step_rewards)
    ends_BK = step_ends.bool().reshape(-1, group_size * t)  # K = G * T positions of a group
    rewards_BK = step_rewards.to(dtype).reshape(-1, group_size * t).masked_fill(~ends_BK, 0.0)
    count_B1 = ends_BK.sum(-1, keepdim=True)
    mean_B1 = rewards_BK.sum(-1, keepdim=True) / count_B1.clamp(min=1)
    centred_BK = (rewards_BK - mean_B1).masked_fill(~ends_BK, 0.0)
    normalised_BK = centred_BK
    if scale:
        variance_B1 = centred_BK.square().sum(-1, keepdim=True) / (count_B1 - 1).clamp(min=1)  # Bessel
        std_B1 = variance_B1.clamp(min=torch.finfo(dtype).tiny).sqrt()
        normalised_BK = centred_BK / (std_B1 + eps)
    rewards_equal_B1 = (centred_BK == 0).all(-1, keepdim=True)  # no signal: exactly 0, as `advantages`
    normalised_NT = normalised_BK.masked_fill(rewards_equal_B1, 0.0).reshape(n, t)
    from_here_NT = normalised_NT.flip(1).cumsum(1).flip(1)  # sum over steps ending at or after t
    return from_here_NT.masked_fill(~mask.bool(), 0.0)


def distillation_advantages(logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor) -> Tensor:
    """On-policy distillation's advantages: ``log pi_teacher(y_t) - log pi_student(y_t)`` at each sampled token.

    The student samples; each token's advantage is the negative of the one-sample estimate of the reverse KL
    ``KL(pi_student || pi_teacher)`` at that position, with no discounting, so the policy gradient
    lowers the reverse KL token by token (on-policy distillation, Agarwal et al. 2024, arXiv:2306.13649, with
    the reverse KL; the per-token reward of Qwen3, arXiv:2505.09388, and of Thinking Machines' on-policy
    distillation). A token the teacher finds likelier than the student does is pushed up.

    Args:
        logprobs: [N, T] the student's (sampler's) log-probs of the sampled tokens.
        teacher_logprobs: [N, T] the teacher's, of the same tokens after the same prompt.
        mask: [N, T] 1 for completion tokens, 0 for padding.

    Returns:
        [N, T] advantages, 0 at padding (not whitened or normalised: the gap's scale is nats).
    """
    check_ndim("logprobs", logprobs, 2, "[N, T]")
    check_same_shape(logprobs=logprobs, teacher_logprobs=teacher_logprobs, mask=mask)
    dtype = compute_dtype(logprobs, teacher_logprobs)
    gap_NT = teacher_logprobs.to(dtype) - logprobs.to(dtype)
    return gap_NT.masked_fill(~mask.bool(), 0.0)


def _nan_group_normalised(values_BG: Tensor, eps: float) -> Tensor:
    """(r - mean) / (std + eps) over each row's non-NaN entries (unbiased std); 0 for a row with fewer than two
    values or equal ones, and at NaN."""
    present_BG = ~values_BG.isnan()
    count_B1 = present_BG.sum(1, keepdim=True)
    filled_BG = values_BG.nan_to_num(0.0)
    mean_B1 = filled_BG.sum(1, keepdim=True) / count_B1.clamp(min=1)
    centred_BG = (filled_BG - mean_B1).masked_fill(~present_BG, 0.0)
    variance_B1 = centred_BG.square().sum(1, keepdim=True) / (count_B1 - 1).clamp(min=1)
    normalised_BG = centred_BG / (variance_B1.clamp(min=torch.finfo(values_BG.dtype).tiny).sqrt() + eps)
    return normalised_BG.masked_fill((count_B1 < 2) | (centred_BG == 0).all(1, keepdim=True), 0.0)


def gdpo_advantages(reward_terms: Tensor, weights: Tensor, *, eps: float = 1e-6) -> Tensor:
    """GDPO's decoupled normalisation (Group reward-Decoupled Normalization Policy Optimization, arXiv:2601.05242).

    ``A_k = (r_k - mean_group(r_k)) / (std_group(r_k) + eps)`` for each reward function k, then
    ``A = sum_k w_k A_k`` normalised over the batch: ``(A - mean(A)) / (std(A) + eps)`` (unbiased stds).

    Args:
        reward_terms: [B, G, K] each reward function's raw value; NaN where it does not apply (left out of
            its group's statistics, 0 in the sum).
        weights: [K] the reward functions' weights.
        eps: added to every std, >= 0.

    Returns:
        [B, G] advantages. With one reward function this is GRPO's advantage, normalised over the batch.
    """
    check_ndim("reward_terms", reward_terms, 3, "[B, G, K]")
    check_ndim("weights", weights, 1, "[K]")
    if weights.shape[0] != reward_terms.shape[2]:
        raise ValueError(f"weights has {weights.shape[0]} entries but reward_terms has {reward_terms.shape[2]} "
                         "reward functions (its last dimension); give one weight per function")
    check_nonnegative("eps", eps)
    _check_group_size("gdpo", reward_terms.shape[1], list(reward_terms.shape[:2]))
    dtype = compute_dtype(reward_terms, weights)
    terms_BGK = reward_terms.to(dtype)
    per_term = [_nan_group_normalised(terms_BGK[..., k], eps) for k in range(terms_BGK.shape[2])]
    summed_BG = sum(w * a for w, a in zip(weights.to(dtype), per_term))
    if summed_BG.numel() < 2:
        return summed_BG
    return (summed_BG - summed_BG.mean()) / (summed_BG.std() + eps)  # GDPO: batch-level normalisation
