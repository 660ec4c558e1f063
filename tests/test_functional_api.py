"""The pinned public API of posttrain.functional (ALGORITHMS.md), and device independence."""

import inspect

import pytest
import torch

import posttrain.functional as F

P, K = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
REQUIRED = inspect.Parameter.empty

# name -> [(parameter, kind, default)] exactly as pinned in ALGORITHMS.md
PINNED = {
    "kl_estimate": [("logprobs", P, REQUIRED), ("ref_logprobs", P, REQUIRED), ("estimator", P, REQUIRED)],
    "advantages": [("estimator", P, REQUIRED), ("rewards", P, REQUIRED), ("baseline", K, None), ("eps", K, 1e-6)],
    "gae": [("token_rewards", P, REQUIRED), ("values", P, REQUIRED), ("mask", P, REQUIRED),
            ("gamma", K, 1.0), ("lam", K, 0.95)],
    "kl_shaped_rewards": [("rewards", P, REQUIRED), ("logprobs", P, REQUIRED), ("ref_logprobs", P, REQUIRED),
                          ("mask", P, REQUIRED), ("kl_coef", K, REQUIRED), ("estimator", K, "k1")],
    "discounted_returns": [("token_rewards", P, REQUIRED), ("mask", P, REQUIRED), ("gamma", K, 1.0)],
    "whiten": [("values", P, REQUIRED), ("mask", P, REQUIRED), ("eps", K, 1e-6)],
    "policy_loss": [("logprobs", P, REQUIRED), ("old_logprobs", P, REQUIRED), ("advantages", P, REQUIRED),
                    ("mask", P, REQUIRED), ("ratio", K, "token"), ("clip", K, "ppo"), ("eps_low", K, 0.2),
                    ("eps_high", K, 0.2), ("dual_clip", K, None), ("aggregation", K, "sequence_mean"),
                    ("max_tokens", K, None), ("ref_logprobs", K, None), ("kl_coef", K, 0.0),
                    ("kl_estimator", K, "k3")],
    "dpo_loss": [("chosen_logps", P, REQUIRED), ("rejected_logps", P, REQUIRED), ("ref_chosen_logps", P, REQUIRED),
                 ("ref_rejected_logps", P, REQUIRED), ("beta", K, 0.1), ("label_smoothing", K, 0.0),
                 ("offset", K, None)],
    "odpo_offset": [("chosen_scores", P, REQUIRED), ("rejected_scores", P, REQUIRED), ("alpha", K, 1.0)],
    "ipo_loss": [("chosen_logps", P, REQUIRED), ("rejected_logps", P, REQUIRED), ("ref_chosen_logps", P, REQUIRED),
                 ("ref_rejected_logps", P, REQUIRED), ("beta", K, 0.1), ("chosen_lengths", K, None),
                 ("rejected_lengths", K, None)],
    "simpo_loss": [("chosen_logps", P, REQUIRED), ("rejected_logps", P, REQUIRED), ("chosen_lengths", P, REQUIRED),
                   ("rejected_lengths", P, REQUIRED), ("beta", K, 2.0), ("gamma", K, 1.0)],
    "orpo_loss": [("chosen_logps", P, REQUIRED), ("rejected_logps", P, REQUIRED), ("chosen_lengths", P, REQUIRED),
                  ("rejected_lengths", P, REQUIRED), ("lam", K, 0.1)],
    "kto_loss": [("logps", P, REQUIRED), ("ref_logps", P, REQUIRED), ("desirable", P, REQUIRED),
                 ("kl_logps", P, REQUIRED), ("kl_ref_logps", P, REQUIRED), ("beta", K, 0.1),
                 ("desirable_weight", K, 1.0), ("undesirable_weight", K, 1.0)],
    "overlong_penalty": [("lengths", P, REQUIRED), ("max_tokens", K, REQUIRED), ("buffer", K, REQUIRED)],
}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_pinned_signature(name):
    params = list(inspect.signature(getattr(F, name)).parameters.values())
    pinned = PINNED[name]
    assert [(p.name, p.kind, p.default) for p in params[: len(pinned)]] == pinned
    extras = params[len(pinned):]
    assert all(p.kind == K and p.default is not REQUIRED for p in extras), "extras must be optional keywords"


def test_all_exports_every_public_function():
    extras = {"aggregate", "reinforce_pp_advantages", "value_loss", "best_of_n", "nll_loss",
              "selective_log_softmax", "entropy_from_logits", "linear_log_softmax", "chosen_nll", "rollout_correction",
              "bradley_terry_loss", "process_advantages", "entropy_bonus", "adaptive_entropy_coef",
              "distillation_advantages", "gdpo_advantages", "generalized_jsd", "ema_weights", "load_balancing_loss", "expert_load",
              "group_length_penalty"}
    assert set(F.__all__) == set(PINNED) | extras
    assert all(callable(getattr(F, name)) for name in F.__all__)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 50, generator=gen)
    tokens = torch.randint(0, 50, (3, 5), generator=gen)
    old = torch.randn(3, 5, generator=gen).clamp(max=0)
    adv = torch.randn(3, generator=gen)
    mask = (torch.arange(5) < torch.tensor([5, 2, 0])[:, None]).long()
    results = []
    for device in ("cpu", "cuda"):
        x = logits.to(device, torch.bfloat16).requires_grad_()
        logp = F.selective_log_softmax(x, tokens.to(device))
        loss, metrics = F.policy_loss(logp, old.to(device), adv.to(device), mask.to(device),
                                      ref_logprobs=old.to(device), kl_coef=0.1, ratio="sequence_token")
        loss.backward()
        results.append((loss.cpu(), x.grad.float().cpu(), metrics["clip_fraction"].cpu()))
    torch.testing.assert_close(results[0], results[1], rtol=2e-2, atol=2e-3)
