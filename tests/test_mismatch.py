"""The sampler's log-probs, kept from generation, against the trainer's: measured, and corrected.

An identical sampler (the policy itself, through posttrain's decode loop) matches the trainer's
log-probs to float rounding; a perturbed sampling copy (``sampler_noise``) does not, and the
configured correction re-weights each token's policy-gradient term by ``F.rollout_correction``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_online import make_config

import posttrain.functional as F
from posttrain.config import ConfigError
from posttrain.models.modeling import collate, forward
from posttrain.rollout.generation import sample_tokens
from posttrain.training.online import train_step
from posttrain.training.session import OnlineSession


def test_the_sampler_log_prob_is_that_of_the_distribution_it_drew_from():
    logits = torch.randn(64, 10, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    tokens, logprobs = sample_tokens(logits, greedy=False, temperature=0.7, top_k=0, top_p=1.0)
    expected = torch.log_softmax(logits / 0.7, -1).gather(1, tokens[:, None])[:, 0]
    assert torch.allclose(logprobs, expected, atol=1e-6)
    tokens, logprobs = sample_tokens(logits, greedy=False, temperature=1.0, top_k=3, top_p=1.0)
    top = logits.topk(3, -1)
    renormalised = torch.log_softmax(top.values, -1)[top.indices == tokens[:, None]]
    assert torch.allclose(logprobs, renormalised, atol=1e-6)  # the top-3 distribution, renormalised
    assert sample_tokens(logits, greedy=True, temperature=1.0, top_k=0, top_p=1.0)[1] is None


def test_an_identical_sampler_shows_no_mismatch(tiny_model_dir, reward_file):
    s = OnlineSession.create(make_config(tiny_model_dir, reward_file, "grpo", max_steps=1))
    metrics = train_step(s)
    assert s.last_groups.completions.sampling_logprobs is not None
    assert abs(metrics["mismatch/kl_k1"]) < 1e-6 and metrics["mismatch/kl_k3"] < 1e-10  # float rounding
    assert metrics["mismatch/ess"] == pytest.approx(1.0, abs=1e-6)


def test_a_perturbed_sampler_shows_a_mismatch_and_evaluation_uses_the_policy(tiny_model_dir, reward_file):
    s = OnlineSession.create(make_config(tiny_model_dir, reward_file, "grpo", sampler_noise=0.05))
    policy = copy.deepcopy(s.policy)
    metrics = train_step(s)
    assert metrics["mismatch/kl_k3"] > 1e-5 and metrics["mismatch/ess"] < 1 - 1e-5
    assert s.eval_generator.model is s.policy and s.generator.model is s.sampling_copy
    # the copy is the pre-update policy times (1 + 0.05 N(0, 1)): its relative deviation is about 0.05
    deviation = torch.cat([((c - p) / p).flatten() for c, p in zip(s.sampling_copy.parameters(), policy.parameters())
                           if p.abs().min() > 0])
    assert deviation.std().item() == pytest.approx(0.05, rel=0.05)


def test_a_bfloat16_sampling_copy_shows_the_engine_precision_mismatch(tiny_model_dir, reward_file):
    s = OnlineSession.create(make_config(tiny_model_dir, reward_file, "grpo", sampler_dtype="bfloat16"))
    metrics = train_step(s)
    assert {p.dtype for p in s.sampling_copy.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in s.policy.parameters()} == {torch.float32}
    assert 1e-8 < metrics["mismatch/kl_k3"] < 1e-2  # rounding of the weights: small, and not zero
    s.step += 1
    s.refresh_sampler()  # as the next step begins: its copy is the updated policy, rounded
    assert all(torch.equal(c, p.to(torch.bfloat16)) for c, p in zip(s.sampling_copy.parameters(), s.policy.parameters()))


@pytest.mark.parametrize("correction, high", [("token-truncate", 1.02), ("sequence-mask", 1.05),
                                              ("geometric-mask", 1.005)])
def test_the_correction_weights_each_tokens_policy_gradient_term(tiny_model_dir, reward_file, correction, high):
    s = OnlineSession.create(make_config(tiny_model_dir, reward_file, "grpo", sampler_noise=0.3,
                                         correction=correction, correction_high=high, micro_batch_size=5))
    policy = copy.deepcopy(s.policy)
    metrics = train_step(s)
    g, alg = s.last_groups, s.alg
    comp = g.completions
    batch = collate(g.prompt_ids, comp.completion_ids, comp.mask, s.pad_id, s.device)
    with torch.no_grad():
        logprobs = forward(policy, batch).logprobs
    t = logprobs.shape[1]
    level, mode = {"token-truncate": ("token", "truncate"), "sequence-mask": ("sequence", "mask"),
                   "geometric-mask": ("geometric", "mask")}[correction]
    weights, expected_metrics = F.rollout_correction(logprobs, comp.sampling_logprobs[:, :t], batch.mask,
                                                     level=level, mode=mode, high=high)
    advantages = alg.advantages(g.rewards, mask=comp.mask)[:, :t]
    # one update per rollout: old = the current log-probs; the reference is the start, so its KL term is 0
    expected, _ = alg.policy_loss(logprobs, logprobs, advantages * weights, batch.mask,
                                  ref_logprobs=logprobs if alg.kl_placement == "loss" else None,
                                  max_tokens=s.max_new_tokens)
    assert metrics["loss"] == pytest.approx(float(expected), abs=1e-5)
    share = "mismatch/truncated_fraction" if mode == "truncate" else "mismatch/masked_fraction"
    assert metrics[share] == pytest.approx(float(expected_metrics[share]), abs=1e-6) and metrics[share] > 0


def test_a_run_with_a_perturbed_sampler_resumes_exactly(tiny_model_dir, reward_file, tmp_path):
    from conftest import assert_online_resume_is_exact

    assert_online_resume_is_exact(lambda output: make_config(
        tiny_model_dir, reward_file, "grpo", sampler_noise=0.05, correction="token-truncate", max_steps=4,
        save_every=2, eval_every=2, output=output), tmp_path)


def test_correction_settings_are_checked(tiny_model_dir, reward_file):
    with pytest.raises(ConfigError, match="correction: got 'token'; use one of token-truncate, token-mask"):
        make_config(tiny_model_dir, reward_file, correction="token")
    with pytest.raises(ConfigError, match="correction_low: got 3.0; use a value in"):
        make_config(tiny_model_dir, reward_file, correction="token-mask", correction_low=3.0)
    with pytest.raises(ConfigError, match="sampler_noise: got -0.1"):
        make_config(tiny_model_dir, reward_file, sampler_noise=-0.1)
    with pytest.raises(ConfigError, match="sampler_dtype: got 'int8'; use bfloat16 or float16"):
        make_config(tiny_model_dir, reward_file, sampler_dtype="int8")
