"""Reward shaping and sample selection on scalar rewards.

- `overlong_penalty`: DAPO's soft overlong punishment (Yu et al. 2025, Sec. 3.4,
  eq. (13)), added to the task reward.
- `group_length_penalty`: Kimi k1.5's length reward (Kimi Team 2025, arXiv:2501.12599,
  Sec. 2.3.3), relative to the other completions of the same prompt.
- `best_of_n`: keep the highest-reward completion of each group (rejection
  sampling fine-tuning, RAFT: Dong et al. 2023), ties to the first.

Departures: `group_length_penalty` is the paper's per-sample length reward only; the
paper's warm-up (training without it first) is the caller's choice of when to add it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import check_ndim, check_positive, check_same_shape, compute_dtype


def overlong_penalty(lengths: Tensor, *, max_tokens: int, buffer: int) -> Tensor:
    """DAPO soft overlong punishment.

    Args:
        lengths: [N] completion lengths |o| in tokens (int or float).
        max_tokens: L_max, the generation budget, > 0.
        buffer: L_cache, the punishment interval before L_max, 0 < buffer <= max_tokens.

    Returns:
        [N] float: 0 if |o| <= L_max - L_cache; ((L_max - L_cache) - |o|) / L_cache
        if L_max - L_cache < |o| <= L_max; -1 if |o| > L_max.
    """
    check_ndim("lengths", lengths, 1, "[N]")
    check_positive("max_tokens", max_tokens)
    check_positive("buffer", buffer)
    if buffer > max_tokens:
        raise ValueError(f"buffer={buffer} exceeds max_tokens={max_tokens}; use buffer <= max_tokens")
    lengths_N = lengths.to(compute_dtype(lengths))
    safe_length = max_tokens - buffer
    ramp_N = (safe_length - lengths_N) / buffer  # DAPO eq. (13), the middle case
    penalty_N = torch.where(lengths_N <= safe_length, 0.0, ramp_N)
    return torch.where(lengths_N > max_tokens, -1.0, penalty_N)


def group_length_penalty(lengths: Tensor, correct: Tensor) -> Tensor:
    """Kimi k1.5's length reward: within each group, shorter than the group's midpoint earns, longer costs.

    Args:
        lengths: [B, G] completion lengths in tokens (int or float) of G completions for each of B prompts.
        correct: [B, G] bool, whether each completion's answer is right.

    Returns:
        [B, G] float: with lambda = 0.5 - (len - min_len) / (max_len - min_len) over the group's
        lengths (0 for every sample of a group whose lengths are all equal), lambda for a correct
        completion and min(0, lambda) for an incorrect one, in [-0.5, 0.5].
    """
    check_ndim("lengths", lengths, 2, "[B, G]")
    check_same_shape(lengths=lengths, correct=correct)
    lengths_BG = lengths.to(compute_dtype(lengths))
    shortest_B1 = lengths_BG.amin(dim=1, keepdim=True)
    spread_B1 = lengths_BG.amax(dim=1, keepdim=True) - shortest_B1
    # Kimi k1.5 sec. 2.3.3: lambda = 0.5 - (len(i) - min_len) / (max_len - min_len); 0 when max_len = min_len
    safe_spread_B1 = torch.where(spread_B1 > 0, spread_B1, 1.0)  # equal lengths: no 0 / 0 in the unused branch
    lam_BG = torch.where(spread_B1 > 0, 0.5 - (lengths_BG - shortest_B1) / safe_spread_B1, 0.0)
    # len_reward(i) = lambda if r(x, y_i, y*) = 1, min(0, lambda) if r(x, y_i, y*) = 0
    return torch.where(correct.bool(), lam_BG, lam_BG.clamp(max=0.0))


def best_of_n(rewards: Tensor, *, min_reward: float | None = None,
              skip_ties: bool = False) -> tuple[Tensor, Tensor]:
    """The best completion of each group.

    Args:
        rewards: [B, G] rewards of G completions for each of B prompts.
        min_reward: groups whose best reward is below it are not kept; None keeps all.
        skip_ties: groups of two or more completions that all have the same reward are not
            kept: none is better than another, so "the best" is only the first (with a 0/1
            reward, a group without a right answer would train on a wrong one). A group of one
            (already selected) is kept.

    Returns:
        (index [B] long: the argmax over G, ties to the first; keep [B] bool).
    """
    check_ndim("rewards", rewards, 2, "[B, G]")
    if rewards.shape[1] < 1:
        raise ValueError(f"rewards has shape {list(rewards.shape)}; each prompt needs at least one completion")
    index_B = rewards.argmax(dim=1)  # torch documents: the first maximal index
    keep_B = torch.ones_like(index_B, dtype=torch.bool)
    if min_reward is not None:
        keep_B &= rewards.amax(dim=1) >= min_reward
    if skip_ties and rewards.shape[1] > 1:
        keep_B &= rewards.amax(dim=1) > rewards.amin(dim=1)
    return index_B, keep_B
