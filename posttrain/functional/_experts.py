"""A mixture of experts' load-balancing loss and the load its routers put on each expert.

``load_balancing_loss`` is the Switch Transformer's auxiliary loss (Fedus et al. 2021, arXiv:2101.03961,
eq. 4) in the form transformers computes it for its mixtures of experts (``load_balancing_loss_func`` in
Mixtral's, Qwen3-MoE's, OLMoE's, gpt-oss's modeling files), so that a model's ``router_aux_loss_coef`` means
what it meant when the model was trained: every layer's tokens pooled, each token's top-k experts taken from
the softmax of its router logits, ``E * sum_k sum_e f_{k,e} * P_e`` with ``f_{k,e}`` the share of tokens
whose k-th choice is expert e and ``P_e`` the mean router probability of e. ``expert_load`` measures the
experts the routers actually chose (a family whose routing adds a bias, DeepSeek-V3's, chooses otherwise
than the softmax top-k).
"""

from __future__ import annotations

import torch
from torch import Tensor


def load_balancing_loss(router_logits_LTE: Tensor, top_k: int, mask_T: Tensor | None = None) -> Tensor:
    """The auxiliary load-balancing loss (Switch Transformer, eq. 4; transformers' form), a 0-dim tensor.

    router_logits_LTE: [L, T, E] every layer's router logits for the same T tokens.
    mask_T: [T] 1 for the tokens that count (real tokens, not padding); None: all of them.
    Returns ``E * sum_{k,e} f_{k,e} P_e``: f_{k,e} [k, E] the share of counted tokens (over all layers) whose
    k-th choice is expert e, P_e [E] the mean router probability of expert e; ``top_k`` when the load is
    balanced (every f_{k,e} = P_e = 1/E), more as it concentrates."""
    experts = router_logits_LTE.shape[-1]
    probs_LTE = router_logits_LTE.float().softmax(-1)
    chosen_LTKE = torch.nn.functional.one_hot(probs_LTE.topk(top_k, -1).indices, experts).float()
    weight_LT = torch.ones(probs_LTE.shape[:2], device=probs_LTE.device) if mask_T is None else \
        mask_T.to(probs_LTE).expand(probs_LTE.shape[:2])
    total = weight_LT.sum().clamp(min=1)
    tokens_per_expert_KE = (chosen_LTKE * weight_LT[..., None, None]).sum((0, 1)) / total
    prob_per_expert_E = (probs_LTE * weight_LT[..., None]).sum((0, 1)) / total
    return (tokens_per_expert_KE * prob_per_expert_E[None]).sum() * experts


def expert_load(chosen_TK: Tensor, experts: int, mask_T: Tensor | None = None) -> Tensor:
    """[E] the share of counted token-slots routed to each expert (sums to 1): chosen_TK [T, k] the experts
    a router chose for each token, mask_T [T] the tokens that count (None: all). ``E * max`` is 1 when
    the load is balanced and E when one expert takes every token."""
    weight_T = torch.ones(chosen_TK.shape[0], device=chosen_TK.device) if mask_T is None else mask_T.float()
    counts_E = torch.zeros(experts, device=chosen_TK.device).index_add_(
        0, chosen_TK.reshape(-1), weight_T[:, None].expand(chosen_TK.shape).reshape(-1))
    return counts_E / counts_E.sum().clamp(min=1)
