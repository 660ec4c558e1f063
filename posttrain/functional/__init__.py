"""posttrain.functional: the pure tensor math of RL and preference post-training.

`import posttrain.functional as F` gives every estimator and loss as a small,
typed, pure function (no model, no I/O, no `.item()` in the math), usable from
any training loop. The exact formulas are those of `docs/algorithms.md`; each module
docstring says where, if anywhere, it departs from the paper.

Conventions:
- Token tensors are `[N, T]`, right-padded, with a `mask` of 1 for completion
  tokens. Padded values never reach a result or a gradient, even if they are
  inf or NaN.
- Losses return `(loss, metrics)`: a 0-dim tensor and a dict of 0-dim detached
  tensors (convert them with `.item()` outside the step).
- The math runs in at least float32: float16/bfloat16 inputs are upcast.

Modules: `_kl` (KL estimators), `_aggregate` (loss aggregation), `_advantages`
(group estimators, REINFORCE++, GRPO's process supervision), `_returns` (token rewards, returns, GAE,
whitening), `_policy` (policy losses, NLL), `_value` (PPO value loss),
`_preference` (DPO, ODPO, SimPO, ORPO, KTO), `_reward_model` (the Bradley-Terry loss), `_shaping` (overlong penalty,
Kimi k1.5's group length penalty, best-of-N), `_entropy` (the entropy bonus and its adaptive coefficient), `_surrogates` (SAPO, DPPO,
GMPO, Clip-Cov, KL-Cov), `_distillation` (GKD's generalised JSD, SDFT's moving-average teacher), `_mismatch` (importance weights for a sampler that is not the trained policy), `_experts` (a mixture of
experts' load-balancing loss and expert load), `_logprobs` (chunked log-softmax and entropy, and `linear_log_softmax`,
which folds in the LM head so that no `[N, T, V]` logits tensor exists).
"""

from ._advantages import (
    advantages,
    distillation_advantages,
    gdpo_advantages,
    process_advantages,
    reinforce_pp_advantages,
)
from ._aggregate import aggregate
from ._distillation import ema_weights, generalized_jsd
from ._entropy import adaptive_entropy_coef, entropy_bonus
from ._experts import expert_load, load_balancing_loss
from ._kl import kl_estimate
from ._logprobs import entropy_from_logits, linear_log_softmax, selective_log_softmax
from ._mismatch import rollout_correction
from ._policy import nll_loss, policy_loss
from ._preference import (
    chosen_nll,
    dpo_loss,
    ipo_loss,
    kto_loss,
    odpo_offset,
    orpo_loss,
    simpo_loss,
)
from ._returns import discounted_returns, gae, kl_shaped_rewards, whiten
from ._reward_model import bradley_terry_loss
from ._shaping import best_of_n, group_length_penalty, overlong_penalty
from ._value import value_loss

__all__ = [
    "adaptive_entropy_coef",
    "advantages",
    "aggregate",
    "best_of_n",
    "bradley_terry_loss",
    "discounted_returns",
    "distillation_advantages",
    "dpo_loss",
    "ema_weights",
    "ipo_loss",
    "entropy_bonus",
    "entropy_from_logits",
    "expert_load",
    "gae",
    "gdpo_advantages",
    "generalized_jsd",
    "group_length_penalty",
    "linear_log_softmax",
    "load_balancing_loss",
    "kl_estimate",
    "kl_shaped_rewards",
    "kto_loss",
    "chosen_nll",
    "nll_loss",
    "odpo_offset",
    "orpo_loss",
    "overlong_penalty",
    "policy_loss",
    "process_advantages",
    "reinforce_pp_advantages",
    "rollout_correction",
    "selective_log_softmax",
    "simpo_loss",
    "value_loss",
    "whiten",
]
