"""The vLLM backend run for real: vLLM's CPU build (``make vllm`` installs it in .venv-vllm) or its CUDA build.

Skipped where vLLM is not installed; ``make test-vllm`` runs them in .venv-vllm. Each test starts a real
engine in this process on a small random Llama (head size 64, which vLLM's CPU attention supports), so
they are marked ``vllm`` and left out of the default suite.

- the engine's greedy samples are the policy's own greedy samples (fp32, the same model);
- a weight sync makes the engine sample what the new weights predict, for full weights and for LoRA's
  merged weights; the engine's log-probs of its samples match the policy's recomputed ones;
- ``posttrain train --backend vllm`` runs, logs the ``mismatch/`` metrics and keeps the trainer's threads.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM is not installed (make vllm, then make test-vllm)")]


@pytest.fixture(scope="module")
def model_dir(vllm_model_dir) -> Path:
    return vllm_model_dir


@pytest.fixture(scope="module")
def engine(model_dir):
    """(policy, tokenizer, generator): one engine for the module (starting one takes seconds)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.rollout.completions import SamplingParams
    from posttrain.rollout.vllm import VLLMGenerator

    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    threads = torch.get_num_threads()
    generator = VLLMGenerator(policy, tokenizer, SamplingParams(12, 1.0, 1.0, 0), [tokenizer.eos_token_id],
                              model_path=str(model_dir), max_model_len=64, seed=0)
    assert torch.get_num_threads() == threads  # vLLM lowers torch's threads for serving; the trainer keeps its own
    return policy, tokenizer, generator


def prompts(tokenizer) -> list[torch.Tensor]:
    return [torch.tensor(tokenizer(text)["input_ids"]) for text in ("12+34=", "7+8=", "100+1=")]


def hf_greedy(policy, tokenizer, prompt_ids) -> list[list[int]]:
    from posttrain.rollout.completions import SamplingParams
    from posttrain.rollout.generators import make_generator

    generator = make_generator("hf", policy, tokenizer, SamplingParams(12, 1.0, 1.0, 0), [tokenizer.eos_token_id])
    out = generator.generate(prompt_ids, num_samples=1, greedy=True)
    return [row[mask.bool()].tolist() for row, mask in zip(out.completion_ids, out.mask)]


def engine_greedy(generator, prompt_ids) -> list[list[int]]:
    out = generator.generate(prompt_ids, num_samples=1, greedy=True)
    return [row[mask.bool()].tolist() for row, mask in zip(out.completion_ids, out.mask)]


def test_the_engine_samples_what_the_policy_would(engine):
    policy, tokenizer, generator = engine
    ids = prompts(tokenizer)
    assert engine_greedy(generator, ids) == hf_greedy(policy, tokenizer, ids)


def test_a_sync_makes_the_engine_sample_the_new_weights(engine):
    policy, tokenizer, generator = engine
    ids = prompts(tokenizer)
    before = engine_greedy(generator, ids)
    with torch.no_grad():  # a different model: every weight moved
        for param in policy.parameters():
            param.add_(torch.randn_like(param) * 0.5)
    after = engine_greedy(generator, ids)  # generate syncs first
    assert after == hf_greedy(policy, tokenizer, ids)
    assert after != before


def test_sampled_logprobs_are_the_policys(engine):
    from posttrain.models.logprobs import probe_logprobs

    policy, tokenizer, generator = engine
    ids = prompts(tokenizer)
    out = generator.generate(ids, num_samples=4)
    for row in range(len(out.completion_ids)):
        prompt, n = ids[row // 4], int(out.mask[row].sum())
        sequence = torch.cat([prompt, out.completion_ids[row, :n]])
        recomputed = probe_logprobs(policy, sequence)[len(prompt) - 1:]  # log-probs of the completion's tokens
        torch.testing.assert_close(out.sampling_logprobs[row, :n], recomputed.float(), atol=2e-3, rtol=0)


def test_lora_syncs_the_merged_weights(model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.rollout.completions import SamplingParams
    from posttrain.rollout.vllm import VLLMGenerator

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    policy = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    generator = VLLMGenerator(policy, tokenizer, SamplingParams(12, 1.0, 1.0, 0), [tokenizer.eos_token_id],
                              model_path=str(model_dir), max_model_len=64, seed=0)
    ids = prompts(tokenizer)
    before = engine_greedy(generator, ids)
    with torch.no_grad():  # the adapters start at B = 0; make them matter
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.add_(torch.randn_like(param))
    after = engine_greedy(generator, ids)
    assert after == hf_greedy(policy, tokenizer, ids) and after != before
    assert any("lora_A" in name for name, _ in policy.named_parameters())  # unmerged again after the sync


def test_train_with_the_vllm_backend_logs_the_mismatch(model_dir, tmp_path):
    import posttrain
    from posttrain.config import Config
    from posttrain.tracking.metrics import read_metrics

    config = Config.from_flat({"model": str(model_dir), "task": "addition", "backend": "vllm", "max_steps": 2,
                               "prompts_per_step": 4, "group_size": 2, "max_new_tokens": 8, "eval_size": 0,
                               "eval_every": 0, "output": str(tmp_path / "run"), "progress": False,
                               "report_to": "none"})
    posttrain.train(config)
    steps = [row for row in read_metrics(tmp_path / "run") if "mismatch/kl_k3" in row]
    # fp32 engine, fp32 trainer: the same distribution up to kernel order; each sync checked on a probe
    assert len(steps) == 2 and all(abs(row["mismatch/kl_k1"]) < 1e-4 and row["mismatch/kl_k3"] < 1e-6
                                   and row["sync/logprob_gap"] < 1e-4 for row in steps)
