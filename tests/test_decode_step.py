"""The fused decode step (posttrain.rollout.decode_step) against the model's own forward, step by step.

Both start from the same prefill; each step feeds both the same tokens (with left padding, grouped-query
attention, biases where the architecture has them, and a compaction of rows mid-way) and their logits
must agree to float32 rounding.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

from posttrain.rollout import decode_step
from posttrain.rollout.decode_step import FusedDecoder, unsupported_reason
from posttrain.rollout.generation import fill_order, preallocated_cache
from posttrain.models.compute import use_mixed_precision

from architectures import KINDS, build



@pytest.mark.parametrize("kernel, dtype", [("onednn", torch.float32), ("mm", torch.float32), ("linear", torch.float32),
                                           ("onednn", torch.bfloat16), ("linear", torch.bfloat16),
                                           ("onednn", "mixed"), ("linear", "mixed")],
                         ids=["onednn", "mm", "f.linear", "onednn-bf16", "bf16", "mixed-onednn", "mixed"])
@pytest.mark.parametrize("angles", ["table", "per-step"])  # rotary angles computed once, or by the module per step
@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_fused_step_logits_equal_the_model_forward(kind, angles, kernel, dtype, monkeypatch):
    """"mixed": float32 weights, the decoder stack under bfloat16 autocast (use_mixed_precision)."""
    if kernel == "onednn" and dtype != torch.float32 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN's bfloat16 products need AVX512 (BW, VL, DQ) or AVX-NE-CONVERT; posttrain refuses "
                    "bfloat16 on such a CPU (models.loading.check_dtype), so it never runs this kernel there")
    model = build(kind).to(torch.float32 if dtype == "mixed" else dtype)
    if dtype == "mixed":
        use_mixed_precision(model)
    monkeypatch.setattr(decode_step, "choose_kernel", lambda weight, dtype: kernel)  # whatever the weights' size
    assert unsupported_reason(model) is None
    g, steps = 2, 6
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12], [0, 0, 0, 0, 13]])
    attention = (ids != 0).long()
    positions = (attention.cumsum(-1) - 1).masked_fill(attention == 0, 1)
    caches = [preallocated_cache(model.config, g, ids.shape[1] + steps) for _ in range(2)]
    for cache in caches:
        model(input_ids=ids, attention_mask=attention, position_ids=positions, cache=cache, use_cache=True)
    fused = FusedDecoder(model, rows=len(ids) * g,
                         positions=int(positions.max()) + steps + 1 if angles == "table" else None)
    assert fused.layers[0].qkv.kernel == fused.lm_head.kernel == kernel
    if dtype == "mixed":  # the layers' products in bfloat16, the LM head in float32
        assert fused.layers[0].qkv.dtype == fused.layers[0].down.dtype == torch.bfloat16
        assert fused.lm_head.dtype == torch.float32
    assert (fused.cos_PD is not None) == (angles == "table")
    mask = attention.repeat_interleave(g, 0)
    position = positions[:, -1:].repeat_interleave(g, 0) + 1
    tokens = torch.arange(len(mask)) + 3
    for t in range(steps):
        if t == 3:  # drop rows 1 and 4 (Cache.batch_select_indices: the rest keep their order)
            keep = torch.tensor([0, 2, 3, 5])
            for cache in caches:
                cache.batch_select_indices(keep)
            mask, position, tokens = mask[keep], position[keep], tokens[keep]
        if t == 4:  # drop row 0 as decode does when it finishes: the last row takes its place
            order, holes, movers = fill_order(torch.tensor([False, True, True, True]))
            for cache in caches:
                for layer in cache.layers:
                    layer.move_rows(holes, movers, len(order))
            mask, position, tokens = mask[order], position[order], tokens[order]
        mask = torch.cat([mask, torch.ones(len(mask), 1, dtype=mask.dtype)], 1)
        expected = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=position, cache=caches[0],
                         use_cache=True).logits[:, -1]
        actual = fused.step(tokens, position, mask, caches[1])
        assert actual.dtype == expected.dtype == (torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
        tol = 1e-5 if dtype == torch.float32 else 3e-2  # bf16: the fused products round differently
        atol = tol if dtype == torch.float32 else tol * float(expected.abs().max())
        torch.testing.assert_close(actual, expected, rtol=tol, atol=atol)
        tokens, position = expected.argmax(-1), position + 1
    for mine, theirs in zip(caches[1].layers, caches[0].layers):
        for a, b in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
            # mixed: the forward's attention runs in bfloat16, the fused step's in float32
            atol = tol if dtype == torch.float32 else tol * float(b.abs().max())
            torch.testing.assert_close(a, b, rtol=tol, atol=atol)


def test_kernel_choice_by_size_dtype_and_cpu_vendor(monkeypatch):
    tiny, small, medium, large = torch.zeros(256, 256), torch.zeros(256, 768), torch.zeros(1376, 256), torch.zeros(3072, 576)
    weights = (tiny, small, medium, large)
    # float32 on Intel (and CPUs not measured): MKL on the transposed copy below 2**19 elements
    for vendor in ("GenuineIntel", "", "HygonGenuine"):
        monkeypatch.setattr(decode_step, "cpu_vendor", lambda v=vendor: v)
        assert [decode_step.choose_kernel(w, torch.float32) for w in weights] == ["mm", "mm", "mm", "onednn"]
    # on AMD, where MKL's kernels are not its tuned ones, oneDNN from 2**17
    monkeypatch.setattr(decode_step, "cpu_vendor", lambda: "AuthenticAMD")
    assert [decode_step.choose_kernel(w, torch.float32) for w in weights] == ["mm", "onednn", "onednn", "onednn"]
    # bfloat16 (the layers under mixed precision): oneDNN from 2**18 elements, F.linear below
    assert [decode_step.choose_kernel(w, torch.bfloat16) for w in (small, medium, large)] == ["linear", "onednn", "onednn"]
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert decode_step.choose_kernel(large, torch.float32) == "linear"
    assert decode_step.choose_kernel(torch.zeros(1024, 1024, device="meta"), torch.float32) == "linear"  # not a CPU


@torch.no_grad()
def test_rotary_angles_that_depend_on_the_batch_are_computed_per_step():
    """Dynamic NTK scaling rescales the angles by the longest position in the batch: no table."""
    from transformers import LlamaConfig

    from architectures import COMMON

    model = LlamaForCausalLM(LlamaConfig(**COMMON, rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
    assert FusedDecoder(model, rows=2, positions=10).cos_PD is None
    assert FusedDecoder(build("llama-biases-untied-rope-scaled"), rows=2, positions=10).cos_PD is not None


def test_fast_generator_takes_the_fused_step_for_llama(monkeypatch):
    from types import SimpleNamespace

    from posttrain.rollout.completions import SamplingParams
    from posttrain.rollout.generators import FastGenerator

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
@pytest.mark.parametrize("adapters", ["active", "disabled"])
@torch.no_grad()
def test_lora_adapters_are_folded_into_the_fused_step(adapters):
    """The fused step on W + (alpha / r) B A equals PEFT's forward, adapters on (the policy) or off (the
    reference); random B, so the adapters change the logits."""
    from contextlib import nullcontext

    from peft import LoraConfig, get_peft_model

    model = get_peft_model(build("llama"), LoraConfig(r=2, lora_alpha=4, init_lora_weights=False,
                                                      target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]))
    model.eval()
    assert unsupported_reason(model) is None
    ids = torch.tensor([[0, 5, 6, 7], [8, 9, 10, 11]])
    attention = (ids != 0).long()
    positions = (attention.cumsum(-1) - 1).masked_fill(attention == 0, 1)
    with model.disable_adapter() if adapters == "disabled" else nullcontext():
        caches = [preallocated_cache(model.config, 1, ids.shape[1] + 3) for _ in range(2)]
        for cache in caches:
            model(input_ids=ids, attention_mask=attention, position_ids=positions, cache=cache, use_cache=True)
        fused = FusedDecoder(model, rows=len(ids), positions=int(positions.max()) + 4)
        mask, position, tokens = attention, positions[:, -1:] + 1, torch.tensor([3, 4])
        for _ in range(3):
            mask = torch.cat([mask, torch.ones(len(mask), 1, dtype=mask.dtype)], 1)
            expected = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=position,
                             cache=caches[0], use_cache=True).logits[:, -1]
            torch.testing.assert_close(fused.step(tokens, position, mask, caches[1]), expected, rtol=1e-5, atol=1e-5)
            tokens, position = expected.argmax(-1), position + 1
    base_qkv = torch.cat([model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight,
                          model.get_base_model().model.layers[0].self_attn.k_proj.weight,
                          model.get_base_model().model.layers[0].self_attn.v_proj.base_layer.weight])
    folded = fused.layers[0].qkv
    weight = folded.weight if folded.kernel != "mm" else folded.weight.t()
    if folded.kernel != "onednn":  # oneDNN's reordered weight is opaque
        assert torch.equal(weight, base_qkv) == (adapters == "disabled")


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft (extra: lora) is not installed")
def test_dora_adapters_run_the_model_forward():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(build("llama"), LoraConfig(r=2, target_modules=["q_proj", "v_proj"], use_dora=True))
    assert unsupported_reason(model) == "its LoRA adapters use DoRA"

@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft (extra: lora) is not installed")
def test_other_peft_methods_run_the_model_forward():
    from peft import IA3Config, get_peft_model

    model = get_peft_model(build("llama"), IA3Config(target_modules=["k_proj", "down_proj"],
                                                     feedforward_modules=["down_proj"]))
    assert unsupported_reason(model) == "its PEFT method is IA3, not LoRA"
