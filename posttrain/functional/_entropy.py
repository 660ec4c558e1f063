"""The entropy bonus and its adaptive coefficient.

The bonus is `-c * H` aggregated like the policy term (`aggregate`), where `H[i, t]` is the
entropy of the policy's next-token distribution at completion token t: minimised, it raises the
entropy (an exploration bonus, as in PPO's `c2 S` term, Schulman et al. 2017 eq. (9)).

Adaptive entropy control (Skywork-OR1, He et al. 2025, arXiv:2505.22312, "adaptive entropy control") holds the
entropy near a target: `c_{k+1} = max(c_k + delta, 0)` if the step's entropy `e_k` is below the
target, `max(c_k - delta, 0)` if above, and the bonus acts only while `e_k <= target`, so a policy
above its target is never pushed higher.
"""

from __future__ import annotations

from torch import Tensor

from ._aggregate import aggregate, check_aggregation
from ._checks import check_nonnegative, check_same_shape


def entropy_bonus(
    entropy: Tensor,
    mask: Tensor,
    *,
    coef: float,
    aggregation: str = "token_mean",
    max_tokens: int | None = None,
    normalizer: float | Tensor | None = None,
) -> Tensor:
    """-coef * aggregate(entropy): the term added to a loss that is minimised.

    Args:
        entropy: [N, T] token entropies under the policy (with grad).
        mask: [N, T] 1 for completion tokens, 0 for padding.
        coef: c >= 0.
        aggregation, max_tokens, normalizer: as in `aggregate` (the policy term's).

    Returns:
        0-dim loss term.
    """
    check_same_shape(entropy=entropy, mask=mask)
    check_nonnegative("coef", coef)
    check_aggregation(aggregation, max_tokens, normalizer)
    valid_NT = mask.bool()
    return -coef * aggregate(entropy.masked_fill(~valid_NT, 0.0), valid_NT, aggregation, max_tokens=max_tokens,
                             normalizer=normalizer)


def adaptive_entropy_coef(coef: float, entropy: float, *, target: float, step: float) -> tuple[float, bool]:
    """Skywork-OR1's adaptive entropy control, one step: (the next coefficient, whether the bonus acts).

    Args:
        coef: c_k >= 0, the current coefficient.
        entropy: e_k, the policy's mean token entropy at this step.
        target: the entropy to hold (Skywork-OR1: 0.2).
        step: delta > 0 (Skywork-OR1: 0.005).
    """
    check_nonnegative("coef", coef)
    if not step > 0:
        raise ValueError(f"step={step} must be > 0")
    following = coef + step if entropy < target else coef - step
    return max(following, 0.0), entropy <= target
