"""The decoder families posttrain is checked on, as tiny random models built offline from transformers' configs.

Each entry of :data:`FAMILIES` is a ``model_type`` of the pinned transformers and the config fields that make it
tiny (two layers, hidden size 32) while keeping what makes the family itself: its attention (sliding windows of
:data:`WINDOW` tokens, shorter than the sequences it is checked on; soft-capping; sinks; multi-head latent
attention), its mixture of experts, and its recurrent, linear-attention or convolution layers. The test suite
runs every path posttrain trains and samples through on each of them against the model's own forward
(``tests/test_families.py``), and ``docs/reference/models.md`` is generated from the same list, so the page and the
checks cannot drift apart.

Nothing is downloaded: a config is ``AutoConfig.for_model(model_type, **fields)``, the weights are random.
"""

from __future__ import annotations

from typing import Any

import torch

WINDOW = 4
"""The sliding window of every family that has one, in tokens: shorter than the prompts and completions the
families are checked on, so every windowed layer drops keys."""

_COMMON: dict[str, Any] = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                               tie_word_embeddings=False, initializer_range=0.2)
_UNSET = object()
"""A family's value for a common field its config does not take (it derives it)."""
_MOE: dict[str, Any] = dict(num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=16, shared_expert_intermediate_size=16, n_group=1, topk_group=1,
                            first_k_dense_replace=0, output_router_logits=False)

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "qwen3": {},
    "qwen3_moe": dict(_MOE),
    "qwen3_next": dict(_MOE, layer_types=["linear_attention", "full_attention"], linear_num_value_heads=2,
                       linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8),
    "qwen3_5_text": dict(layer_types=["linear_attention", "full_attention"], linear_num_value_heads=2,
                         linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8),
    "mistral": dict(sliding_window=WINDOW),
    "mixtral": dict(_MOE, sliding_window=WINDOW),
    "phi3": dict(sliding_window=WINDOW),
    "gemma2": dict(sliding_window=WINDOW, attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    "gemma3_text": dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
                        final_logit_softcapping=3.0),
    "olmo2": {},
    "olmoe": dict(_MOE),
    "gpt_oss": dict(_MOE, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
    "deepseek_v3": dict(_MOE, q_lora_rank=16, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                        head_dim=4, num_key_value_heads=4),  # MLA: every head has its own key, as DeepSeek-V3 ships
    "glm4_moe": dict(_MOE),
    "lfm2": dict(layer_types=["conv", "full_attention"], block_ff_dim=48, block_auto_adjust_ff_dim=False),
    "granitemoehybrid": dict(_MOE, layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_head=16,
                             mamba_d_state=8, mamba_n_groups=1, mamba_expand=2, shared_intermediate_size=48,
                             logits_scaling=2.0),
    "smollm3": {},
}
"""``model_type`` -> the fields that make a tiny model of the family (over :data:`_COMMON`)."""

MORE_FAMILIES: dict[str, dict[str, Any]] = {
    "gemma": {},
    "cohere2": dict(sliding_window=WINDOW),
    "exaone4": dict(sliding_window=WINDOW),
    "olmo3": dict(sliding_window=WINDOW),
    "ministral": dict(sliding_window=WINDOW),
    "starcoder2": dict(sliding_window=WINDOW),
    "afmoe": dict(_MOE, sliding_window=WINDOW),
    "granite": dict(logits_scaling=2.0, attention_multiplier=0.2),
    "phi": {},
    "gpt_neox": {},
    "glm4": {},
    "seed_oss": {},
    "apertus": {},
    "arcee": {},
    "nemotron": {},
    "hunyuan_v1_dense": {},
    "hunyuan_v1_moe": dict(_MOE),
    "qwen2_moe": dict(_MOE),
    "deepseek_v2": dict(_MOE, q_lora_rank=16, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                        head_dim=4, num_key_value_heads=4),
    "minimax_m2": dict(_MOE),
    "minimax": dict(_MOE, layer_types=["linear_attention", "full_attention"], block_size=4),
    "lfm2_moe": dict(_MOE, layer_types=["conv", "full_attention"]),
    "falcon_h1": dict(mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_n_groups=1),
    "jamba": dict(_MOE, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  mamba_d_state=8, mamba_dt_rank=4),
    "bamba": dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_expand=2,
                  attn_layer_indices=[1]),
    "nemotron_h": dict(_MOE, layers_block_type=["mamba", "attention"], mamba_num_heads=4, mamba_head_dim=8,
                       ssm_state_size=8, n_groups=1),
    "zamba2": dict(layers_block_type=["mamba", "hybrid"], mamba_d_state=8, mamba_headdim=8, n_mamba_heads=8,
                   num_mem_blocks=1),
    # the older families: learned or ALiBi positions, parallel blocks, no cache in the forward (OpenAI GPT)
    "gpt2": dict(n_inner=48),
    "openai-gpt": {},
    "ctrl": dict(dff=48),
    "opt": dict(ffn_dim=48, word_embed_proj_dim=32),
    "bloom": {},
    "gptj": dict(rotary_dim=4, n_inner=48),
    "codegen": dict(rotary_dim=4, n_inner=48),
    "gpt_bigcode": dict(n_inner=48),
    "xglm": dict(ffn_dim=48),
    "biogpt": {},
    "mpt": dict(expansion_ratio=2),
    "stablelm": {},
    "persimmon": {},
    "cohere": {},
    "helium": {},
    "glm": {},
    "diffllama": {},
    "bitnet": {},
    "doge": {},
    "ernie4_5": {},
    "jetmoe": dict(_MOE),
    "phimoe": dict(_MOE),
    "granitemoe": dict(_MOE),
    "llama4_text": dict(_MOE, attention_chunk_size=4),
    "mamba": {},
    "falcon": dict(head_dim=_UNSET),  # Falcon derives it (hidden_size / num_attention_heads)
}
"""More families of the pinned transformers, beyond those the issue of any model named: checked on the log-probs
and gradients of the training passes, the run's probe and the sampler (``tests/test_families.py``), where the
declared checks were written without them in view (Nemotron's layers, for one, do not hand the packed layout to
their attention, and Doge's attention adds a bias the packed one leaves out: the measured check in
:func:`posttrain.models.compute.use_packed_attention` declines packing for both)."""


UNBATCHABLE_FAMILIES: dict[str, dict[str, Any]] = {
    "rwkv": {},
    "recurrent_gemma": dict(num_hidden_layers=3),  # its third layer is attention: without one it builds no cache
}
"""The families posttrain refuses by name (:data:`posttrain.models.architecture.UNBATCHABLE`), as tiny models: the
tests measure why."""


def tiny_config(family: str, vocab_size: int = 64, *, pad_token_id: int = 0, bos_token_id: int = 1,
                eos_token_id: int = 2, **fields: Any):
    """A two-layer config of ``family`` (a key of :data:`FAMILIES`, or any ``model_type`` transformers knows, with
    :data:`_COMMON`'s sizes), ``fields`` over the family's own."""
    from transformers import AutoConfig

    own = FAMILIES.get(family, MORE_FAMILIES.get(family, UNBATCHABLE_FAMILIES.get(family, {})))
    values = {key: value for key, value in {**_COMMON, **own, **fields}.items() if value is not _UNSET}
    return AutoConfig.for_model(family, vocab_size=vocab_size, pad_token_id=pad_token_id, bos_token_id=bos_token_id,
                                eos_token_id=eos_token_id, **values)


def tiny_model(family: str, vocab_size: int = 64, seed: int = 0, **fields: Any):
    """A randomly initialised causal LM of ``family`` (:func:`tiny_config`), seeded, in eval mode, float32."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, vocab_size, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    return model
