"""Token-level rewards, returns, GAE and whitening over `[N, T]` right-padded batches.

- `kl_shaped_rewards`: token reward `-kl_coef * k1[i,t]` at every completion
  token plus the scalar reward at the last one (PPO as in Ouyang et al. 2022
  eq. (2); REINFORCE++, Hu 2025).
- `discounted_returns`: `R[i,t] = sum_{s>=t} gamma^(s-t) reward[i,s]`.
- `gae`: Schulman et al. 2016 (GAE) eq. (16); the value after the last
  completion token is 0 (the episode ends with the completion).
- `whiten`: `(x - mean) / (std + eps)` over the valid entries of the whole
  batch, unbiased std.

Departures: none in the formulas. Everything is 0 at padding. `whiten` over a
single valid entry gives 0 (its unbiased std is undefined; taken as 0).
The recursions loop over time T (vectorised over the batch), as GAE is defined.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import (
    check_ndim,
    check_nonnegative,
    check_same_shape,
    check_unit_interval,
    compute_dtype,
)
from ._kl import kl_estimate


def _reverse_discounted_cumsum(x_NT: Tensor, discount: float) -> Tensor:
    """y[:, t] = x[:, t] + discount * y[:, t + 1], with y[:, T] = 0."""
    running_N = x_NT.new_zeros(x_NT.shape[0])
    columns = []
    for t in reversed(range(x_NT.shape[1])):
        running_N = x_NT[:, t] + discount * running_N
        columns.append(running_N)
    return torch.stack(columns[::-1], dim=1) if columns else x_NT.clone()  # T = 0: nothing to sum


def kl_shaped_rewards(
    rewards: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    *,
    kl_coef: float,
    estimator: str = "k1",
    step_rewards: Tensor | None = None,
) -> Tensor:
    """Token rewards with the KL penalty in the reward (PPO, REINFORCE++).

    Args:
        rewards: [N] scalar reward of each completion.
        logprobs: [N, T] log-probs of the sampled tokens under the sampling policy.
        ref_logprobs: [N, T] under the reference policy.
        mask: [N, T] 1 for completion tokens, 0 for padding.
        kl_coef: beta >= 0.
        estimator: KL estimator, "k1" (default) | "k2" | "k3".
        step_rewards: [N, T] a process reward's step rewards, each at the token where its step ends;
            added as they are ("adding them at the reward tokens"). None = outcome rewards only.

    Returns:
        [N, T] `-kl_coef * kl[i,t]` at every valid token, plus `rewards[i]` at the
        last valid token of completion i, plus `step_rewards`; 0 at padding. A
        completion with no valid token gets nothing.
    """
    check_ndim("logprobs", logprobs, 2, "[N, T]")
    check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs, mask=mask)
    check_ndim("rewards", rewards, 1, "[N]")
    if rewards.shape[0] != logprobs.shape[0]:
        raise ValueError(
            f"rewards has shape {list(rewards.shape)} but logprobs has shape "
            f"{list(logprobs.shape)}; rewards needs one entry per row of logprobs"
        )
    check_nonnegative("kl_coef", kl_coef)
    valid_NT = mask.bool()
    dtype = compute_dtype(rewards, logprobs, ref_logprobs)
    logp_NT = logprobs.to(dtype).masked_fill(~valid_NT, 0.0)
    ref_NT = ref_logprobs.to(dtype).masked_fill(~valid_NT, 0.0)
    kl_NT = kl_estimate(logp_NT, ref_NT, estimator)
    valid_from_here_NT = valid_NT.flip(1).cumsum(dim=1).flip(1)  # valid tokens at or after t
    is_last_NT = valid_NT & (valid_from_here_NT == 1)
    penalty_NT = (-kl_coef * kl_NT).masked_fill(~valid_NT, 0.0)  # Ouyang et al. 2022 eq. (2)
    token_rewards_NT = penalty_NT + torch.where(is_last_NT, rewards.to(dtype)[:, None], 0.0)
    if step_rewards is not None:
        check_same_shape(step_rewards=step_rewards, mask=mask)
        token_rewards_NT = token_rewards_NT + step_rewards.to(dtype).masked_fill(~valid_NT, 0.0)
    return token_rewards_NT


def discounted_returns(token_rewards: Tensor, mask: Tensor, *, gamma: float = 1.0) -> Tensor:
    """Reward-to-go `R[i,t] = sum_{s>=t} gamma^(s-t) reward[i,s]` over valid tokens.

    Args:
        token_rewards: [N, T].
        mask: [N, T] 1 for completion tokens, 0 for padding.
        gamma: discount in [0, 1].

    Returns:
        [N, T], 0 at padding.
    """
    check_ndim("token_rewards", token_rewards, 2, "[N, T]")
    check_same_shape(token_rewards=token_rewards, mask=mask)
    check_unit_interval("gamma", gamma)
    valid_NT = mask.bool()
    rewards_NT = token_rewards.to(compute_dtype(token_rewards)).masked_fill(~valid_NT, 0.0)
    return _reverse_discounted_cumsum(rewards_NT, gamma).masked_fill(~valid_NT, 0.0)


def gae(
    token_rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016), not whitened.

    Args:
        token_rewards: [N, T] per-token rewards (e.g. from `kl_shaped_rewards`).
        values: [N, T] value estimates V_t of the state before token t.
        mask: [N, T] 1 for completion tokens, 0 for padding (right-padded).
        gamma: discount in [0, 1].
        lam: GAE lambda in [0, 1].

    Returns:
        (advantages [N, T], returns [N, T] = advantages + values), 0 at padding.
    """
    check_ndim("token_rewards", token_rewards, 2, "[N, T]")
    check_same_shape(token_rewards=token_rewards, values=values, mask=mask)
    check_unit_interval("gamma", gamma)
    check_unit_interval("lam", lam)
    valid_NT = mask.bool()
    dtype = compute_dtype(token_rewards, values)
    rewards_NT = token_rewards.to(dtype).masked_fill(~valid_NT, 0.0)
    values_NT = values.to(dtype).masked_fill(~valid_NT, 0.0)
    # V after the last completion token is 0: padding values are 0 and so is the column past T.
    next_values_NT = torch.cat([values_NT[:, 1:], torch.zeros_like(values_NT[:, :1])], dim=1)
    delta_NT = rewards_NT + gamma * next_values_NT - values_NT  # GAE: TD residual delta_t
    delta_NT = delta_NT.masked_fill(~valid_NT, 0.0)
    advantages_NT = _reverse_discounted_cumsum(delta_NT, gamma * lam)  # GAE eq. (16)
    advantages_NT = advantages_NT.masked_fill(~valid_NT, 0.0)
    returns_NT = (advantages_NT + values_NT).masked_fill(~valid_NT, 0.0)
    return advantages_NT, returns_NT


def whiten(values: Tensor, mask: Tensor, *, eps: float = 1e-6) -> Tensor:
    """`(x - mean) / (std + eps)` over the valid entries of the batch (unbiased std).

    Args:
        values: [N, T].
        mask: [N, T] 1 for valid entries, 0 for padding.
        eps: added to the std, >= 0.

    Returns:
        [N, T], 0 at padding.
    """
    check_same_shape(values=values, mask=mask)
    check_nonnegative("eps", eps)
    valid = mask.bool()
    x = values.to(compute_dtype(values)).masked_fill(~valid, 0.0)
    count = valid.sum()
    mean = x.sum() / count.clamp(min=1)
    centered = (x - mean).masked_fill(~valid, 0.0)
    variance = centered.square().sum() / (count - 1).clamp(min=1)  # Bessel's correction
    # Floor at the smallest normal number: sqrt has an infinite slope at 0 (NaN gradients
    # for constant inputs) and eps=0 would divide 0 by 0; the floor is far below any eps.
    std = variance.clamp(min=torch.finfo(variance.dtype).tiny).sqrt()
    return centered / (std + eps)
