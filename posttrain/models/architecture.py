"""Which of posttrain's fast paths serve a model exactly, and why not where they do not.

A fast path computes what the model's own forward computes, another way. Each is declared here against
what it needs of the architecture, and each check returns why a model cannot take the path (None: it can),
so that the caller takes the exact path instead and says so in one line (:func:`notices`):

- **packed passes** (:mod:`posttrain.models.packing`): a micro-batch's sequences in one row, attention
  kept inside each. They need every layer that mixes positions to be attention, which the packed attention
  keeps per sequence (full or sliding-window, through SDPA or the model's own eager function, so
  soft-capping and sinks come with it): a recurrent, linear-attention or convolution layer carries state
  along the row, from one sequence into the next, and such a model runs padded rows instead.
- **the folded head** (:func:`posttrain.models.modeling.split_head`): the log-softmax folded into the LM
  head, a block of vocabulary at a time, for families whose logits are exactly ``lm_head(hidden)``
  (:data:`PLAIN_HEADS`); others (soft-capped or scaled logits) take their logits from their own forward.
- **a cache passed to the forward** (a prompt's keys and values reused by its samples, the decode loop's
  preallocated cache): a forward that takes one, and full-attention layers only.
- **the fused decode step** (:mod:`posttrain.rollout.decode_step`): the exact classes of :data:`SUPPORTED`.
- **padding at all**: posttrain batches prompts of different lengths, left-padded. A family whose forward over
  a padded row is not its own over the row alone is refused (:data:`UNBATCHABLE`); one whose ``generate`` is
  not (:data:`PADDED_GENERATE`) samples one prompt length at a time.

Anything not declared is not assumed: a family transformers adds next month takes the paths its config
allows, and the run's probe (:func:`posttrain.models.probe.check_training_path`) compares them with the
model's own forward before the first step.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable

import transformers
from packaging.version import Version
from torch import nn
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from posttrain.models.packing import PACKED

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
"""Causal LMs whose decoder layer is exactly the one :meth:`posttrain.rollout.decode_step.FusedDecoder.step`
computes: RMSNorm, rotary grouped-query attention and a SiLU-gated MLP."""


def _no_final_softcap(config) -> bool:
    return getattr(config, "final_logit_softcapping", None) is None


def _unscaled(config) -> bool:
    return getattr(config, "logits_scaling", 1.0) == 1.0


PLAIN_HEADS: dict[str, Callable[[object], bool]] = {
    **dict.fromkeys(["llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "qwen3_next",
                     "qwen3_5_text", "phi3", "olmo2", "olmo3", "olmoe", "gpt_oss", "deepseek_v2", "deepseek_v3",
                     "glm4", "glm4_moe", "lfm2", "smollm3", "gemma", "ministral", "seed_oss", "starcoder2"],
                    lambda config: True),
    "gemma2": _no_final_softcap,
    "gemma3_text": _no_final_softcap,
    "granite": _unscaled,
    "granitemoe": _unscaled,
    "granitemoehybrid": _unscaled,
}
"""``model_type`` -> whether a config of it has logits exactly ``lm_head(hidden)`` (the family's
``ForCausalLM.forward`` adds nothing after the head for such a config); checked on each family's tiny model
in ``tests/test_families.py``."""


UNBATCHABLE: dict[str, str] = {
    "rwkv": "its forward ignores the attention mask, so a padded prompt's padding runs into its state (a tiny "
            "model's log-probs move 0.06 nats per token, their gradients 0.3 of their size)",
    "recurrent_gemma": "its padded rows give the model's log-probs but not their gradients: the padding's positions "
                       "reach its recurrent blocks' biases (on a tiny model, gradients 37.9 against 6.4 alone)",
}
"""``model_type`` -> why no batch of its rows is its own forward over each row alone. posttrain pads prompts to
batch them, to train and to sample, so it refuses these families by name (in every dtype; the run's probe would
catch the first always and the second in float32). Measured by ``tests/test_families.py``."""


PADDED_GENERATE: dict[str, str] = {
    "minimax": "transformers' generate lets a left-padded prompt's padding into its linear attention (on a tiny "
               "model, the sampled tokens' log-probs up to 2.6 nats from its own forward; exact unpadded)",
}
"""``model_type`` -> why transformers' ``generate`` is not the model's own forward over a left-padded prompt, where
the training passes are: posttrain samples such a family one prompt length at a time (no padding). Measured by
``tests/test_families.py``'s sampler test, which every other family passes padded."""


def padded_generate_reason(model: nn.Module) -> str | None:
    """Why ``model`` must not be sampled with left-padded prompts (:data:`PADDED_GENERATE`), or None."""
    return PADDED_GENERATE.get(getattr(unwrapped(model).config, "model_type", None))


def unbatchable_reason(model: nn.Module) -> str | None:
    """Why posttrain cannot train ``model`` exactly in batches (:data:`UNBATCHABLE`), or None."""
    return UNBATCHABLE.get(getattr(unwrapped(model).config, "model_type", None))


def unwrapped(model: nn.Module) -> nn.Module:
    """The transformers model under a PEFT wrapper (LoRA keeps its adapters in place inside it), or ``model``."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def decoder_body(model: nn.Module) -> nn.Module:
    """The decoder stack of a causal LM, under a PEFT wrapper if any (``model.model`` for Llama); the
    model itself when it names no base model."""
    return unwrapped(model).base_model


def family(model: nn.Module) -> str:
    """What a message calls the model: its class and ``model_type`` (``Qwen3NextForCausalLM (qwen3_next)``)."""
    base = unwrapped(model)
    return f"{type(base).__name__} ({getattr(base.config, 'model_type', '?')})"


def is_supported_class(model) -> bool:
    """Whether ``model`` is exactly one of transformers' :data:`SUPPORTED` classes (not a subclass, a
    PEFT wrapper or FSDP's dynamic subclass), whose forward the fused decode step and the folded
    training head reproduce."""
    return type(model).__name__ in SUPPORTED and type(model).__module__.startswith("transformers.models.")


def non_lora_adapters(model: nn.Module) -> bool:
    """Whether ``model`` carries PEFT adapters other than LoRA: prompt or prefix tuning act in the wrapper's
    forward, which a call to the decoder stack would skip."""
    return any(c.peft_type != "LORA" for c in getattr(model, "peft_config", {}).values())  # PeftType: a str enum


VISION_PASSES = ("a vision-language model's passes are its own forward over padded rows, each row with its images "
                 "(a group's shared prompt and image run once per row)")


def head_unsupported_reason(model: nn.Module) -> str | None:
    """Why the folded head cannot stand for ``model``'s logits (None: it can)."""
    if non_lora_adapters(model):
        return "it carries adapters other than LoRA, which act in the wrapper's forward"
    base = unwrapped(model)
    if getattr(base.config, "vision_config", None) is not None:
        return VISION_PASSES
    model_type = getattr(base.config, "model_type", None)
    if not type(base).__module__.startswith("transformers.models.") or not type(base).__name__.endswith("ForCausalLM"):
        return f"{type(base).__name__} is not one of transformers' causal LM classes"
    if model_type not in PLAIN_HEADS:
        return f"posttrain has not checked that {model_type}'s logits are its LM head's output"
    if not PLAIN_HEADS[model_type](base.config):
        return "its logits are soft-capped or scaled after the LM head"
    head = getattr(base, "lm_head", None)
    if type(head) is not nn.Linear or any(type(p).__name__ == "DTensor" for p in head.parameters()):
        return "its LM head is not a plain nn.Linear (sharded, or wrapped by adapters)"
    return None


def row_state_reason(config) -> str | None:
    """Why a row of several sequences would not keep them apart in ``config``'s layers (None: it would, given
    attention that does): layers other than attention carry state along the row."""
    if getattr(config, "is_encoder_decoder", False):
        return "it is an encoder-decoder model"
    if getattr(config, "attention_chunk_size", None):
        return "its layers attend in chunks, which the packed attention does not compute"
    layers = DynamicCache(config=config).layers
    kinds = getattr(config, "layer_types", None) or [type(layer).__name__ for layer in layers]
    stateful = sorted({kind for kind, layer in zip(kinds, layers)
                       if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer)})
    if stateful:
        return (f"its {', '.join(stateful)} layers carry state along the row, which would run from one sequence "
                "into the next")
    return None


def packing_unsupported_reason(model: nn.Module) -> str | None:
    """Why a packed pass would not be ``model``'s own forward (None: it would)."""
    if non_lora_adapters(model):
        return "it carries adapters other than LoRA, which act in the wrapper's forward"
    base = unwrapped(model)
    if getattr(base.config, "vision_config", None) is not None:
        return VISION_PASSES
    declined = getattr(base, "posttrain_packing_declined", None)  # a packed pass measured against its own forward
    if declined:
        return declined
    implementation = getattr(base.config, "_attn_implementation", None)
    if implementation not in (*PACKED, *PACKED.values()):
        return f"its attention implementation is {implementation!r}; packing takes 'sdpa' and 'eager'"
    if implementation in ("eager", PACKED["eager"]):
        module = sys.modules[type(base).__module__]
        if getattr(module, "eager_attention_forward", None) is None:
            return f"{module.__name__} has no eager_attention_forward to run per sequence"
    return row_state_reason(base.config)


def cache_unsupported_reason(model: nn.Module) -> str | None:
    """Why ``model`` cannot run on a cache passed to its forward (None: it can). That needs transformers'
    ``cache=`` forward argument (5.x; tested with 5.24), a forward that takes it (RWKV keeps a state of its own,
    OpenAI GPT no cache at all: either would ignore one and see only the new tokens), and layers that all use
    full attention."""
    if Version(transformers.__version__) < Version("5.24"):
        return f"it needs transformers>=5.24 (the model forward's cache= argument); found {transformers.__version__}"
    base = unwrapped(model)
    config = base.config
    if config.is_encoder_decoder:
        return "it is an encoder-decoder model"
    # a transformers model's signature says it; a wrapper of one (``forward(**kwargs)``) hands the cache on
    if isinstance(base, transformers.PreTrainedModel) and "cache" not in inspect.signature(type(base).forward).parameters:
        return "its forward takes no cache (it keeps none, or a state of its own)"
    layers = DynamicCache(config=config).layers
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        return "its attention layers are not all full attention (sliding window, linear attention or shared KV)"
    return None
