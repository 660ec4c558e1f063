"""The vLLM backend without vLLM: errors, name mapping for weight sync, turning vLLM's samples into
Completions, the check after each sync on a fake engine; and an end-to-end check on a CUDA GPU.
tests/test_vllm_engine.py runs a real engine (vLLM's CPU build)."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.rollout.vllm import check_vllm_available, completions_from_samples, named_weights, sample_row

HAS_VLLM_GPU = torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None


def test_missing_package_or_a_cuda_build_without_a_gpu_is_a_clear_error(monkeypatch):
    import posttrain.rollout.vllm as backend

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match=r"needs the vllm package, which is not installed: make vllm"):
        check_vllm_available()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(backend, "vllm_is_cpu_build", lambda: False)
    with pytest.raises(RuntimeError, match="this vLLM is a CUDA build and no CUDA GPU is available; on a CPU install "
                                           "vLLM's CPU build"):
        check_vllm_available()
    monkeypatch.setattr(backend, "vllm_is_cpu_build", lambda: True)
    check_vllm_available()  # the CPU build runs without a GPU


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft (extra: lora) is not installed")
def test_lora_weights_are_pushed_merged_under_the_base_models_names(tiny_model_dir):
    from posttrain.config import ModelConfig
    from posttrain.models.lora import apply_lora

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    plain = dict(named_weights(base))
    assert plain.keys() == dict(base.named_parameters()).keys()
    policy = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir), ModelConfig(lora_r=4))
    with torch.no_grad():  # B = 0 at init: make the adapters matter
        for name, p in policy.named_parameters():
            if ".lora_B." in name:
                p.fill_(0.01)
    policy.merge_adapter()
    pushed = {name: w.clone() for name, w in named_weights(policy)}  # views: unmerging changes them back
    policy.unmerge_adapter()
    assert pushed.keys() == plain.keys()  # no lora_A/lora_B, no base_layer, no peft prefix
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(pushed[q], plain[q])  # the merged weight, not the base one


def vllm_sample(ids, logprobs, finish_reason):
    steps = [{t: SimpleNamespace(logprob=lp)} for t, lp in zip(ids, logprobs)]
    return SimpleNamespace(token_ids=ids, logprobs=steps, finish_reason=finish_reason)


def test_samples_become_right_padded_completions_ending_in_eos():
    eos = torch.tensor([2, 7])
    rows = [sample_row(vllm_sample([5, 6, 2], [-0.1, -0.2, -0.3], "stop"), eos),
            sample_row(vllm_sample([5, 6], [-0.4, -0.5], "stop"), eos),  # stopped on EOS, EOS not returned
            sample_row(vllm_sample([3, 3, 3, 3], [-1.0] * 4, "length"), eos)]
    assert rows[1] == ([5, 6, 2], [-0.4, -0.5, 0.0])
    comp = completions_from_samples([r[0] for r in rows], [r[1] for r in rows], eos, pad_id=0)
    assert comp.completion_ids.tolist() == [[5, 6, 2, 0], [5, 6, 2, 0], [3, 3, 3, 3]]
    assert comp.mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    assert comp.truncated.tolist() == [False, False, True]
    assert torch.allclose(comp.sampling_logprobs[0], torch.tensor([-0.1, -0.2, -0.3, 0.0]))


@pytest.mark.skipif(not HAS_VLLM_GPU, reason="needs vLLM and a CUDA GPU (backend=vllm)")
def test_vllm_greedy_matches_hf_and_follows_weight_updates(tiny_model_dir):
    from posttrain.rollout.completions import SamplingParams
    from posttrain.rollout.generators import HFGenerator
    from posttrain.rollout.vllm import VLLMGenerator
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).cuda()
    eos = [tokenizer.eos_token_id]
    params = SamplingParams(max_new_tokens=12)
    prompts = [torch.tensor(tokenizer(text)["input_ids"]) for text in ("12+34=", "7+5=")]
    fast = VLLMGenerator(model, tokenizer, params, eos, model_path=str(tiny_model_dir), gpu_memory_utilization=0.1)
    hf = HFGenerator(model, tokenizer, params, eos)
    a, b = fast.generate(prompts, num_samples=1, greedy=True), hf.generate(prompts, num_samples=1, greedy=True)
    assert torch.equal(a.completion_ids.cpu(), b.completion_ids.cpu())
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)  # a different policy: vLLM must follow it
    a, b = fast.generate(prompts, num_samples=1, greedy=True), hf.generate(prompts, num_samples=1, greedy=True)
    assert torch.equal(a.completion_ids.cpu(), b.completion_ids.cpu())
    sampled = fast.generate(prompts, num_samples=4)
    assert sampled.completion_ids.shape[0] == 8 and sampled.sampling_logprobs.shape == sampled.mask.shape


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="checks the error where vLLM is absent")
def test_selecting_vllm_here_is_a_config_error_before_any_model_loads(reward_file):
    from posttrain.config import ConfigError
    from posttrain.training.session import OnlineSession
    from test_online import make_config

    with pytest.raises(ConfigError, match="backend: backend=vllm needs"):
        OnlineSession.create(make_config("does-not-exist", reward_file, "grpo", backend="vllm"))


def test_an_engines_samples_get_the_same_correction_and_version_bookkeeping(tiny_model_dir, reward_file):
    """The loop does not know which engine sampled: samples converted as the vLLM backend converts them,
    with the engine's log-probs off the trainer's (another precision), are measured, corrected and tagged."""
    from test_online import make_config

    from posttrain.training.online import train_step
    from posttrain.training.session import OnlineSession

    s = OnlineSession.create(make_config(tiny_model_dir, reward_file, "grpo", correction="token-truncate",
                                         correction_high=1.1, max_steps=2))
    policy_sampler = s.generator

    class Engine:  # the policy's tokens, reported through vLLM's sample objects with a biased log-prob
        def generate(self, prompt_ids, *, num_samples, greedy=False, rows=None):
            comp = policy_sampler.generate(prompt_ids, num_samples=num_samples, greedy=greedy)
            eos = policy_sampler.eos_ids
            samples = [vllm_sample([int(t) for t, m in zip(ids, mask) if m],
                                   [float(lp) - 0.3 for lp, m in zip(lps, mask) if m],
                                   "length" if truncated else "stop")
                       for ids, mask, lps, truncated in zip(comp.completion_ids, comp.mask, comp.sampling_logprobs,
                                                            comp.truncated)]
            rows_ = [sample_row(sample, eos) for sample in samples]
            return completions_from_samples([r[0] for r in rows_], [r[1] for r in rows_], eos, policy_sampler.pad_id)

    s.generator = Engine()
    for step in range(2):
        metrics = train_step(s)
        assert s.last_groups.completions.versions.tolist() == [step] * 16 and metrics["staleness/max"] == 0
        # log ratio +0.3 a token: k1 KL -0.3, every weight exp(0.3) = 1.35 truncated at 1.1
        assert metrics["mismatch/kl_k1"] == pytest.approx(-0.3, abs=1e-4)
        assert metrics["mismatch/truncated_fraction"] > 0.99
        s.step += 1


class _FakeEngine:
    """Stands in for vLLM's engine: its model loads weights (or, ``broken``, drops them, as a sync that misnames
    every tensor would), and its prompt log-probs are those of a torch model holding what it loaded."""

    def __init__(self, model, broken: bool):
        self.model, self.broken = model, broken
        self.worker = SimpleNamespace(model_runner=SimpleNamespace(reload_weights=self.reload_weights,
                                                                   get_model=lambda: SimpleNamespace()))

    def collective_rpc(self, method):
        return [method(self.worker)]

    def reload_weights(self, weights_iterator, is_checkpoint_format):
        assert is_checkpoint_format  # vLLM repacks checkpoint-format weights for its kernels
        loaded = {name: tensor.detach().clone() for name, tensor in weights_iterator}
        if not self.broken:
            self.model.load_state_dict(loaded, strict=False)

    def reset_prefix_cache(self):
        pass

    def generate(self, requests, sampling_params, use_tqdm):
        from posttrain.models.logprobs import probe_logprobs

        assert sampling_params.kwargs == dict(max_tokens=1, prompt_logprobs=0, temperature=1.0, top_p=1.0, top_k=-1)
        ids = requests[0]["prompt_token_ids"]
        values = probe_logprobs(self.model, torch.tensor(ids)).tolist()
        entries = [None] + [{token: SimpleNamespace(logprob=value), 99: SimpleNamespace(logprob=-9.0)}
                            for token, value in zip(ids[1:], values)]
        return [SimpleNamespace(prompt_logprobs=entries)]


@pytest.mark.parametrize("broken", [False, True])
def test_each_vllm_weight_sync_is_checked_on_the_engines_prompt_logprobs(broken, tiny_model_dir, monkeypatch):
    """Without vLLM: the engine is a fake whose prompt log-probs come from its own copy of the weights; the
    parsing of vLLM's prompt_logprobs and the check after each sync are what is tested."""
    import sys

    from posttrain.rollout.vllm import VLLMGenerator
    from posttrain.training.guards import SyncCheck, WeightSyncError

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(SamplingParams=lambda **kwargs: SimpleNamespace(kwargs=kwargs)))
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    generator = object.__new__(VLLMGenerator)
    generator.model, generator.syncs, generator.sleeping = policy, 0, False
    generator.llm = _FakeEngine(AutoModelForCausalLM.from_pretrained(tiny_model_dir), broken)
    generator.sync_check = SyncCheck(torch.tensor([1, 5, 6, 7, 8, 9]), torch.float32)
    generator.sync_weights()  # the policy is the engine's starting point: both pass
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))  # a training step moved it
    if broken:
        with pytest.raises(WeightSyncError, match="the vLLM engine: after the weight sync for rollout 2"):
            generator.sync_weights()
    else:
        generator.sync_weights()
        assert generator.sync_check.last_gap < 1e-5
