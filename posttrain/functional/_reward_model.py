"""A reward model's loss: the Bradley-Terry model of pairwise preferences on scalar scores.

Bradley and Terry (1952) model the probability that ``y_w`` is preferred to ``y_l`` as
``sigmoid(r(x, y_w) - r(x, y_l))``; InstructGPT (Ouyang et al. 2022, arXiv:2203.02155, eq. (1))
trains the reward model by maximising its log-likelihood on human comparisons:
``loss = -log sigmoid(r_w - r_l)``, a mean over pairs.

Two additions, both off by default, as in Llama 2 and TRL's ``RewardTrainer``:

- a per-pair ``margin`` ``m`` (Touvron et al. 2023, arXiv:2307.09288, eq. (2)):
  ``-log sigmoid(r_w - r_l - m)``, so a pair labelled "much better" must be separated by more;
- score centring (Eisenstein et al. 2023, arXiv:2312.09244): ``c * mean((r_w + r_l)^2)`` added
  to the loss. The Bradley-Terry loss sees only differences, so the scores' level drifts freely;
  the term pins it near 0, which keeps a learned reward on a known scale for the RL stage.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.functional import logsigmoid

from ._checks import check_ndim, check_nonnegative, check_same_shape, compute_dtype


def bradley_terry_loss(
    chosen_scores: Tensor,
    rejected_scores: Tensor,
    *,
    margin: Tensor | None = None,
    center_coefficient: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The Bradley-Terry loss of a reward model on preference pairs.

    Args:
        chosen_scores: ``[B]`` the reward model's score of each pair's chosen completion.
        rejected_scores: ``[B]`` ... of its rejected completion.
        margin: ``[B]`` how much higher the chosen must score (Llama 2's margin); None = 0.
        center_coefficient: ``>= 0``, weight of ``mean((r_w + r_l)^2)``; 0 = off.

    Returns:
        (loss 0-dim, metrics): the loss is ``mean(-log sigmoid(r_w - r_l - m))`` plus the centring
        term. Metrics: ``accuracy`` (share of pairs with ``r_w > r_l``, a tie counting half),
        ``margin`` (mean ``r_w - r_l``), ``rewards/chosen``, ``rewards/rejected``.
    """
    check_ndim("chosen_scores", chosen_scores, 1, "[B]")
    check_same_shape(chosen_scores=chosen_scores, rejected_scores=rejected_scores, margin=margin)
    check_nonnegative("center_coefficient", center_coefficient)
    dtype = compute_dtype(chosen_scores, rejected_scores)
    chosen_B, rejected_B = chosen_scores.to(dtype), rejected_scores.to(dtype)
    difference_B = chosen_B - rejected_B
    shifted_B = difference_B if margin is None else difference_B - margin.to(dtype)
    loss = -logsigmoid(shifted_B).mean()
    if center_coefficient:
        loss = loss + center_coefficient * (chosen_B + rejected_B).pow(2).mean()
    with torch.no_grad():
        wins = (difference_B > 0).to(dtype) + 0.5 * (difference_B == 0).to(dtype)
        metrics = {"accuracy": wins.mean(), "margin": difference_B.mean(),
                   "rewards/chosen": chosen_B.mean(), "rewards/rejected": rejected_B.mean()}
    return loss, metrics
