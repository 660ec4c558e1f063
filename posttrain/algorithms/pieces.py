"""The built-in pieces, registered exactly as a user's are (:mod:`.registry`).

Each function only hands the preset's fields to :mod:`posttrain.functional`, where the math is.
Decisions where the spec is silent:

1. Best-of-N's "advantages" are a 0/1 selection (1 on the kept best completion of each prompt), and
   its loss is the NLL of the selected completions, so the loop needs no special case to train it.
2. KL in the token reward uses ``k1``, as the spec defines the shaped reward.
3. Process rewards (a reward function's step rewards, at the tokens where the steps end): the token-level
   estimators (PPO's GAE, REINFORCE++ and its baseline variant) add them to the token rewards, as
   REINFORCE++'s paper says process rewards enter; GRPO and Dr.GRPO use DeepSeekMath's process supervision
   (Sec. 4.1.3), where the outcome reward counts as the last step (ending at the last token), so a run can
   mix an outcome check with step rewards and the group normalisation sees both. The other estimators
   (RLOO, ReMax, best-of-N) define no use of steps and refuse them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

import posttrain.functional as F
from posttrain.algorithms.registry import (
    register_advantage,
    register_policy_loss,
    register_preference_loss,
)

OnlineAlgorithm = PreferenceAlgorithm = Any  # the preset whose fields configure a piece (presets.py imports this module)

Metrics = dict[str, Tensor]


# -- advantage estimators -------------------------------------------------------------------------

def _group_estimator(name: str):
    def estimator(rewards: Tensor, preset: OnlineAlgorithm, *, mask: Tensor | None = None,
                  step_rewards: Tensor | None = None, step_ends: Tensor | None = None, **_: object) -> Tensor:
        if step_rewards is None:
            return F.advantages(name, rewards, eps=preset.eps)
        return process_supervision(rewards, preset, mask, step_rewards, step_ends, scale=name == "group")

    estimator.__qualname__ = estimator.__name__ = name
    estimator.__doc__ = _GROUP_ESTIMATORS[name]
    return estimator


_GROUP_ESTIMATORS = {
    "group": "GRPO: (r - mean) / (std + eps) within each prompt's group; with step rewards, DeepSeekMath's "
             "process supervision.",
    "group_mean": "Dr.GRPO: r - mean within each prompt's group, with no std division; with step rewards, "
                  "process supervision centred only.",
    "rloo": "RLOO: r minus the mean reward of the prompt's other G - 1 completions (leave-one-out).",
    "group_batch_std": "Lite PPO: r minus the group's mean, divided by the std of every reward in the step's batch.",
    "maxrl": "MaxRL: r minus the group's mean, divided by that mean (the pass rate): 1/p weighting; rewards >= 0.",
}
"""The group estimators' one-line accounts, for the registry's listing (docs/reference/registries.md)."""


def process_supervision(rewards: Tensor, preset: OnlineAlgorithm, mask: Tensor, step_rewards: Tensor,
                        step_ends: Tensor, scale: bool) -> Tensor:
    """[N, T] GRPO's (scale) or Dr.GRPO's (centre only) process supervision (decision 3): the outcome reward
    is the last step, ending at each completion's last token."""
    valid = mask.bool()
    is_last = valid & (valid.flip(1).cumsum(1).flip(1) == 1)
    steps = torch.where(is_last, step_rewards + rewards.reshape(-1, 1), step_rewards)
    return F.process_advantages(steps, step_ends.bool() | is_last, mask, group_size=rewards.shape[1], scale=scale,
                                eps=preset.eps)


for _name in ("group", "group_mean"):  # GRPO, Dr.GRPO: [B, G] -> [B, G] within each group
    register_advantage(_name, compares_group=True, takes_step_rewards=True)(_group_estimator(_name))
register_advantage("rloo", compares_group=True)(_group_estimator("rloo"))  # RLOO: leave-one-out
register_advantage("group_batch_std", compares_group=True)(_group_estimator("group_batch_std"))  # Lite PPO
register_advantage("maxrl", compares_group=True)(_group_estimator("maxrl"))  # MaxRL: 1 / pass-rate weighting


@register_advantage("greedy_baseline", needs_baseline=True)
def greedy_baseline(rewards: Tensor, preset: OnlineAlgorithm, *, baseline: Tensor | None, **_: object) -> Tensor:
    """ReMax: each completion's reward minus its prompt's greedy completion's reward."""
    return F.advantages("greedy_baseline", rewards, baseline=baseline, eps=preset.eps)


@register_advantage("best_of_n")
def best_of_n(rewards: Tensor, preset: OnlineAlgorithm, **_: object) -> Tensor:
    """[B, G] 1 on each kept prompt's best completion, 0 elsewhere (decision 1)."""
    index, keep = F.best_of_n(rewards, min_reward=preset.min_reward, skip_ties=preset.skip_ties)
    return torch.nn.functional.one_hot(index, rewards.shape[1]).to(rewards.dtype) * keep[:, None]


@register_advantage("gae", level="token", needs_values=True, takes_step_rewards=True)
def gae(rewards: Tensor, preset: OnlineAlgorithm, *, mask: Tensor, logprobs: Tensor, ref_logprobs: Tensor,
        values: Tensor, kl_coef: float, step_rewards: Tensor | None = None, **_: object) -> tuple[Tensor, Tensor]:
    """PPO: GAE on the KL-shaped token rewards (with a process reward's steps at their tokens), whitened;
    the returns (A + V, before whitening) train the value head."""
    token_rewards = F.kl_shaped_rewards(rewards.flatten(), logprobs, ref_logprobs, mask, kl_coef=kl_coef,
                                        estimator="k1", step_rewards=step_rewards)
    advantages, returns = F.gae(token_rewards, values, mask, gamma=preset.gamma, lam=preset.lam)
    return F.whiten(advantages, mask, eps=preset.eps), returns


@register_advantage("reinforce_pp", level="token", takes_step_rewards=True)
def reinforce_pp(rewards: Tensor, preset: OnlineAlgorithm, *, mask: Tensor, logprobs: Tensor, ref_logprobs: Tensor,
                 kl_coef: float, step_rewards: Tensor | None = None, **_: object) -> Tensor:
    """REINFORCE++: discounted KL-shaped returns (a process reward's steps added at their tokens), whitened
    over the batch."""
    return F.reinforce_pp_advantages(rewards.flatten(), logprobs, ref_logprobs, mask, kl_coef=kl_coef,
                                     baseline=False, eps=preset.eps, step_rewards=step_rewards)


@register_advantage("reinforce_pp_baseline", level="token", compares_group=True, takes_step_rewards=True)
def reinforce_pp_baseline(rewards: Tensor, preset: OnlineAlgorithm, *, mask: Tensor, logprobs: Tensor,
                          ref_logprobs: Tensor, kl_coef: float, step_rewards: Tensor | None = None,
                          **_: object) -> Tensor:
    """REINFORCE++-baseline: the group's mean reward subtracted first (from the outcome; steps as they are)."""
    return F.reinforce_pp_advantages(rewards.flatten(), logprobs, ref_logprobs, mask, kl_coef=kl_coef, baseline=True,
                                     group_size=rewards.shape[1], eps=preset.eps, step_rewards=step_rewards)


@register_advantage("gdpo", compares_group=True, takes_reward_terms=True)
def gdpo(rewards: Tensor, preset: OnlineAlgorithm, *, reward_terms: Tensor, reward_weights: Tensor,
         **_: object) -> Tensor:
    """GDPO: each reward function normalised within the group, then weighted, summed and normalised over the batch."""
    return F.gdpo_advantages(reward_terms, reward_weights, eps=preset.eps)


@register_advantage("reverse_kl", level="token", needs_teacher=True)
def reverse_kl(rewards: Tensor, preset: OnlineAlgorithm, *, mask: Tensor, logprobs: Tensor, teacher_logprobs: Tensor,
               **_: object) -> Tensor:
    """On-policy distillation: each token's teacher-minus-student log-prob, plus ``task_reward_weight`` times the
    task reward's GRPO advantage (which needs G >= 2) when set."""
    advantages = F.distillation_advantages(logprobs, teacher_logprobs, mask)
    if preset.task_reward_weight:
        task = F.advantages("group", rewards, eps=preset.eps).reshape(-1, 1)
        advantages = advantages + preset.task_reward_weight * task * mask
    return advantages


# -- policy losses -------------------------------------------------------------------------------

@register_policy_loss("policy", takes_kl=True)
def clipped_surrogate(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                      preset: OnlineAlgorithm, *, ref_logprobs: Tensor | None, normalizer: float | Tensor | None,
                      max_tokens: int | None) -> tuple[Tensor, Metrics]:
    """The PPO family's surrogate with the preset's ratio level, clip scheme and aggregation, plus the KL
    when the preset places it in the loss."""
    kl_in_loss = preset.kl_placement == "loss" and preset.beta > 0
    return F.policy_loss(
        logprobs, old_logprobs, advantages, mask, ratio=preset.ratio, clip=preset.clip, eps_low=preset.eps_low,
        eps_high=preset.eps_high, dual_clip=preset.dual_clip, aggregation=preset.aggregation, max_tokens=max_tokens,
        normalizer=normalizer, ref_logprobs=ref_logprobs if kl_in_loss else None,
        kl_coef=preset.beta if kl_in_loss else 0.0, kl_estimator=preset.kl_estimator if kl_in_loss else "k3",
        clip_options=preset.clip_options, off_policy_mask=preset.off_policy_mask,
        kl_importance_weighted=preset.kl_importance_weighted and kl_in_loss)


@register_policy_loss("nll")
def selected_nll(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, preset: OnlineAlgorithm,
                 *, ref_logprobs: Tensor | None, normalizer: float | Tensor | None,
                 max_tokens: int | None) -> tuple[Tensor, Metrics]:
    """Best-of-N (RAFT): the NLL of the completions with a positive advantage (the selected ones)."""
    selected = advantages.reshape(mask.shape[0], -1) > 0
    return F.nll_loss(logprobs, (mask.bool() & selected).to(mask.dtype), aggregation=preset.aggregation,
                      normalizer=normalizer, max_tokens=max_tokens)


# -- preference losses -----------------------------------------------------------------------------

_PAIR = ("chosen_logps", "rejected_logps")
_REF_PAIR = ("ref_chosen_logps", "ref_rejected_logps")
_LENGTHS = ("chosen_lengths", "rejected_lengths")


@register_preference_loss("dpo", inputs=(*_PAIR, *_REF_PAIR), coefficients=("beta", "label_smoothing"))
def dpo(preset: PreferenceAlgorithm, *, chosen_logps: Tensor, rejected_logps: Tensor, ref_chosen_logps: Tensor,
        ref_rejected_logps: Tensor, **_: Tensor) -> tuple[Tensor, Metrics]:
    """DPO: -log sigmoid(beta * (chosen minus rejected policy-vs-reference log-ratio)), label-smoothed."""
    return F.dpo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta=preset.beta,
                      label_smoothing=preset.label_smoothing)


@register_preference_loss("odpo", inputs=(*_PAIR, *_REF_PAIR, "chosen_scores", "rejected_scores"),
                          coefficients=("beta", "alpha"))
def odpo(preset: PreferenceAlgorithm, *, chosen_logps: Tensor, rejected_logps: Tensor, ref_chosen_logps: Tensor,
         ref_rejected_logps: Tensor, chosen_scores: Tensor, rejected_scores: Tensor,
         **_: Tensor) -> tuple[Tensor, Metrics]:
    """ODPO: DPO whose margin must exceed the offset alpha * log(score_w - score_l)."""
    offset = F.odpo_offset(chosen_scores, rejected_scores, alpha=preset.alpha)
    return F.dpo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta=preset.beta,
                      offset=offset)


@register_preference_loss("ipo", inputs=(*_PAIR, *_REF_PAIR, *_LENGTHS), coefficients=("beta",))
def ipo(preset: PreferenceAlgorithm, *, chosen_logps: Tensor, rejected_logps: Tensor, ref_chosen_logps: Tensor,
        ref_rejected_logps: Tensor, chosen_lengths: Tensor, rejected_lengths: Tensor,
        **_: Tensor) -> tuple[Tensor, Metrics]:
    """IPO: (chosen minus rejected per-token policy-vs-reference log-ratio - 1 / (2 beta))^2."""
    return F.ipo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta=preset.beta,
                      chosen_lengths=chosen_lengths, rejected_lengths=rejected_lengths)


@register_preference_loss("simpo", inputs=(*_PAIR, *_LENGTHS), coefficients=("beta", "gamma"))
def simpo(preset: PreferenceAlgorithm, *, chosen_logps: Tensor, rejected_logps: Tensor, chosen_lengths: Tensor,
          rejected_lengths: Tensor, **_: Tensor) -> tuple[Tensor, Metrics]:
    """SimPO: -log sigmoid(beta * (chosen minus rejected mean token log-prob) - gamma); no reference."""
    return F.simpo_loss(chosen_logps, rejected_logps, chosen_lengths, rejected_lengths, beta=preset.beta,
                        gamma=preset.gamma)


@register_preference_loss("orpo", inputs=(*_PAIR, *_LENGTHS), coefficients=("lam",), takes_rpo_alpha=False)
def orpo(preset: PreferenceAlgorithm, *, chosen_logps: Tensor, rejected_logps: Tensor, chosen_lengths: Tensor,
         rejected_lengths: Tensor, **_: Tensor) -> tuple[Tensor, Metrics]:
    """ORPO's loss holds the chosen NLL already (weighted 1), so ``rpo_alpha`` does not apply."""
    return F.orpo_loss(chosen_logps, rejected_logps, chosen_lengths, rejected_lengths, lam=preset.lam)


@register_preference_loss("kto", inputs=("logps", "ref_logps", "desirable", "kl_logps", "kl_ref_logps"),
                          coefficients=("beta", "desirable_weight", "undesirable_weight"))
def kto(preset: PreferenceAlgorithm, *, logps: Tensor, ref_logps: Tensor, desirable: Tensor, kl_logps: Tensor,
        kl_ref_logps: Tensor, **_: Tensor) -> tuple[Tensor, Metrics]:
    """KTO: each example's policy-vs-reference log-ratio against the batch's KL reference point, weighted by kind."""
    return F.kto_loss(logps, ref_logps, desirable, kl_logps, kl_ref_logps, beta=preset.beta,
                      desirable_weight=preset.desirable_weight, undesirable_weight=preset.undesirable_weight)
