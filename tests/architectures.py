"""Tiny random decoders of the architectures posttrain's fused paths hold (decode_step, the folded head)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

COMMON = dict(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.3, pad_token_id=0)


def build(kind: str):
    """A two-layer model with grouped-query attention, in eval mode; weights std 0.3, random biases."""
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
