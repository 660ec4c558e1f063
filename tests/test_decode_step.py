"""The fused decode step (posttrain.decode_step) against the model's own forward, step by step.

Both start from the same prefill; each step feeds both the same tokens (with left padding, grouped-query
attention, biases where the architecture has them, and a compaction of rows mid-way) and their logits
must agree to float32 rounding.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM)

from posttrain import decode_step
from posttrain.decode_step import FusedDecoder, unsupported_reason
from posttrain.generation import preallocated_cache

COMMON = dict(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.3, pad_token_id=0)


def build(kind: str):
    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**COMMON)).eval()
    if kind == "llama-biases-untied-rope-scaled":
        config = LlamaConfig(**COMMON, attention_bias=True, mlp_bias=True, tie_word_embeddings=False,
                             rope_scaling={"rope_type": "linear", "factor": 2.0}, head_dim=16)
        model = LlamaForCausalLM(config).eval()
        with torch.no_grad():  # random biases: transformers initialises them to zero
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.3)
        return model
    if kind == "mistral":
        return MistralForCausalLM(MistralConfig(**COMMON, sliding_window=None)).eval()
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**COMMON, use_sliding_window=False)).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.3)
        return model
    raise ValueError(kind)


KINDS = ["llama", "llama-biases-untied-rope-scaled", "mistral", "qwen2"]


@pytest.mark.parametrize("packed", [True, False], ids=["onednn", "f.linear"])
@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_fused_step_logits_equal_the_model_forward(kind, packed, monkeypatch):
    model = build(kind)
    if not packed:
        monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert unsupported_reason(model) is None
    g, steps = 2, 6
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12], [0, 0, 0, 0, 13]])
    attention = (ids != 0).long()
    positions = (attention.cumsum(-1) - 1).masked_fill(attention == 0, 1)
    caches = [preallocated_cache(model.config, g, ids.shape[1] + steps) for _ in range(2)]
    for cache in caches:
        model(input_ids=ids, attention_mask=attention, position_ids=positions, cache=cache, use_cache=True)
    fused = FusedDecoder(model, rows=len(ids) * g)
    assert fused.layers[0].qkv.packed is packed
    mask = attention.repeat_interleave(g, 0)
    position = positions[:, -1:].repeat_interleave(g, 0) + 1
    tokens = torch.arange(len(mask)) + 3
    for t in range(steps):
        if t == 3:  # drop rows 1 and 4, as decode does when they finish
            keep = torch.tensor([0, 2, 3, 5])
            for cache in caches:
                cache.batch_select_indices(keep)
            mask, position, tokens = mask[keep], position[keep], tokens[keep]
        mask = torch.cat([mask, torch.ones(len(mask), 1, dtype=mask.dtype)], 1)
        expected = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=position, cache=caches[0],
                         use_cache=True).logits[:, -1]
        actual = fused.step(tokens, position, mask, caches[1])
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
        tokens, position = expected.argmax(-1), position + 1
    for mine, theirs in zip(caches[1].layers, caches[0].layers):
        torch.testing.assert_close(mine.keys, theirs.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mine.values, theirs.values, rtol=1e-5, atol=1e-5)


def test_fast_generator_takes_the_fused_step_for_llama(monkeypatch):
    from types import SimpleNamespace

    from posttrain.rollout import FastGenerator, SamplingParams

    calls = []
    step = FusedDecoder.step
    monkeypatch.setattr(FusedDecoder, "step", lambda self, *a: calls.append(1) or step(self, *a))
    generator = FastGenerator(build("llama"), SimpleNamespace(pad_token_id=0), SamplingParams(5), [39])
    generator.generate([torch.tensor([4, 5]), torch.tensor([6])], num_samples=2)
    assert len(calls) == 4  # the prefill gives the first token, then one step per token


def test_unsupported_models_say_why(monkeypatch):
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_embd=32, n_layer=1, n_head=4))
    assert "GPT2LMHeadModel is not one of" in unsupported_reason(gpt2)
    llama = build("llama")
    monkeypatch.setattr(llama.config, "hidden_act", "gelu")
    assert "hidden_act is 'gelu'" in unsupported_reason(llama)
    monkeypatch.setattr(llama.config, "hidden_act", "silu")
    monkeypatch.setenv("POSTTRAIN_DECODE_STEP", "forward")
    assert unsupported_reason(llama) == "POSTTRAIN_DECODE_STEP=forward"
    monkeypatch.delenv("POSTTRAIN_DECODE_STEP")

    class Subclass(LlamaForCausalLM):
        pass

    assert "is not one of" in unsupported_reason(Subclass(llama.config))


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft (extra: lora) is not installed")
def test_a_lora_wrapped_model_runs_its_own_forward():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(build("llama"), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    assert "is not one of" in decode_step.unsupported_reason(model)


@pytest.mark.parametrize("shared", [False, True], ids=["distinct-prompts", "shared-prompts"])
@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("kind", ["llama", "llama-biases-untied-rope-scaled", "qwen2"])
def test_training_forward_with_the_folded_head_equals_the_models_own(kind, lora, shared, monkeypatch):
    """modeling.forward through linear_log_softmax (and, with shared prompts, each prompt run once)
    against the model's own forward over whole rows and the unfused log-softmax: log-probs,
    entropies, values and every gradient."""
    from posttrain import modeling
    from posttrain.modeling import ValueHead, collate

    if lora and importlib.util.find_spec("peft") is None:
        pytest.skip("peft (extra: lora) is not installed")
    model = build(kind).train()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    assert modeling.split_head(model) is not None
    torch.manual_seed(1)
    value_head = ValueHead(32)
    torch.nn.init.normal_(value_head.linear.weight)
    a, b, c = torch.tensor([5, 6, 7]), torch.tensor([8]), torch.tensor([9, 10])
    prompts = [a, b, a, c, b] if shared else [a, b, c, torch.tensor([20]), torch.tensor([21, 22, 23, 24])]
    completions = torch.tensor([[11, 12, 13, 0], [14, 15, 0, 0], [16, 17, 18, 19], [25, 0, 0, 0], [26, 27, 28, 0]])
    mask = (completions != 0).long()
    monkeypatch.setattr(modeling, "worth_sharing", lambda *sizes: True)  # these prompts are too short to pay
    batch = collate(prompts, completions, mask, 0, torch.device("cpu"))
    assert (batch.owner_n is not None) is shared
    upstream = torch.randn(5, 4)
    params = [p for p in list(model.parameters()) + list(value_head.parameters()) if p.requires_grad]

    def run():
        for p in params:
            p.grad = None
        out = modeling.forward(model, batch, temperature=0.7, with_entropy=True, value_head=value_head)
        ((out.logprobs * upstream + out.values) * batch.mask).sum().backward()
        return out, [p.grad.clone() for p in params]

    body = modeling.split_head(model)[0]
    rows_per_call = []
    body_forward = body.forward
    monkeypatch.setattr(body, "forward", lambda **kw: rows_per_call.append(len(kw["input_ids"])) or body_forward(**kw))
    folded, folded_grads = run()
    assert rows_per_call == ([3, 5] if shared else [5])  # the distinct prompts once, then every completion
    monkeypatch.setattr(modeling, "split_head", lambda model: None)
    direct, direct_grads = run()
    real = batch.mask.bool()
    torch.testing.assert_close(folded.logprobs[real], direct.logprobs[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(folded.entropy[real], direct.entropy[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(folded.values, direct.values, rtol=1e-5, atol=1e-5)
    assert (folded.logprobs[~real] == 0).all()
    for mine, theirs in zip(folded_grads, direct_grads):  # float32 rounding, relative to each tensor's scale
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5 * max(1.0, float(theirs.abs().max())))


def test_collate_finds_the_rows_that_share_a_prompt(monkeypatch):
    from posttrain import modeling
    from posttrain.modeling import collate

    monkeypatch.setattr(modeling, "worth_sharing", lambda *sizes: True)

    a, b, c = torch.tensor([5, 6]), torch.tensor([7]), torch.tensor([5, 6])  # c equals a in content
    completions = torch.tensor([[1, 2], [3, 0], [4, 5], [6, 7]])
    batch = collate([b, a, c, b], completions, (completions != 0).long(), 0, torch.device("cpu"))
    assert batch.first_U.tolist() == [0, 1] and batch.owner_n.tolist() == [0, 1, 1, 0]
    assert batch.prompt_width == 2
    distinct = collate([a, b], completions[:2], torch.ones(2, 2, dtype=torch.long), 0, torch.device("cpu"))
    assert distinct.first_U is None and distinct.owner_n is None


def test_sharing_prompts_is_chosen_where_it_measured_faster():
    from posttrain.modeling import worth_sharing

    assert worth_sharing(16, 4, 13, 32)  # GRPO, 4 prompts x 4: saves 156 of 720 positions
    assert worth_sharing(16, 4, 75, 32)  # long prompts: saves 900 of 1712
    assert not worth_sharing(8, 4, 13, 18)  # a DPO step of 4 pairs: saves 52 of 248, measured slower
    assert not worth_sharing(4, 4, 100, 10)  # nothing shared
