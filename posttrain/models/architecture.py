"""What posttrain's own code paths need of a model's architecture, and which models have it.

Two paths are written against a model rather than through its ``forward``: the fused decode step
(:mod:`posttrain.rollout.decode_step`) with the folded training head
(:func:`posttrain.models.modeling.split_head`), which compute a Llama-family decoder layer
themselves, and the shared-prompt training forward and preallocated decode cache, which need a cache
of full-attention layers passed through the forward's ``cache=`` argument. Each check returns why a
model cannot take the path (None: it can), so callers fall back to the model's forward and can say why.
"""

from __future__ import annotations

import transformers
from packaging.version import Version
from transformers.cache_utils import DynamicCache, DynamicLayer

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
"""Causal LMs whose decoder layer is exactly the one :meth:`posttrain.rollout.decode_step.FusedDecoder.step`
computes: RMSNorm, rotary grouped-query attention and a SiLU-gated MLP."""


def is_supported_class(model) -> bool:
    """Whether ``model`` is exactly one of transformers' :data:`SUPPORTED` classes (not a subclass, a
    PEFT wrapper or FSDP's dynamic subclass), whose forward the fused decode step and the folded
    training head reproduce."""
    return type(model).__name__ in SUPPORTED and type(model).__module__.startswith("transformers.models.")


def cache_unsupported_reason(config) -> str | None:
    """Why a model with this config cannot run on a cache passed to its forward (None: it can). That
    needs transformers' ``cache=`` forward argument (5.x; tested with 5.24) and layers that all use full
    attention."""
    if Version(transformers.__version__) < Version("5.24"):
        return f"it needs transformers>=5.24 (the model forward's cache= argument); found {transformers.__version__}"
    if config.is_encoder_decoder:
        return "it is an encoder-decoder model"
    layers = DynamicCache(config=config).layers
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        return "its attention layers are not all full attention (sliding window, linear attention or shared KV)"
    return None
