"""A reward model: a language model with a scalar ``score`` head, as ``transformers`` builds one.

1. :func:`load_reward_model` loads a causal LM checkpoint (any ``--model`` spec
   :func:`posttrain.models.loading.resolve_model_path` resolves) as
   ``AutoModelForSequenceClassification`` with ``num_labels=1``: the decoder's weights, the LM
   head dropped, a fresh ``score`` head (``nn.Linear(hidden, 1, bias=False)``, initialised by
   transformers from the torch generator, so seeded runs agree). The saved model therefore loads
   with plain ``AutoModelForSequenceClassification.from_pretrained`` and scores through
   :class:`posttrain.data.rewards.RewardModel`.
2. The score of a sequence is the head on the hidden state of its last real token. transformers
   finds that token through ``config.pad_token_id`` (the rightmost position whose id is not the
   pad id, for left and right padding alike), so the pad id is written into the model's config
   here. :func:`sequence_scores` runs the sequences packed (no padding) or right-pads them: every real
   token keeps the position it has unpadded, and the score is read where transformers reads it.
3. :func:`apply_reward_lora`: LoRA adapters on the decoder's projections with the ``score`` head
   trained in full (peft's ``modules_to_save``): a fresh head has nothing to adapt from.
   :func:`posttrain.models.lora.merged_for_saving` folds the adapters in and puts the trained head
   back in place, so ``final_model/`` is a plain sequence-classification model.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from torch import Tensor, nn

from posttrain.config import ConfigError, ModelConfig
from posttrain.models.loading import (
    check_dtype,
    launched_mixed_precision,
    resolve_mixed_precision,
    resolve_model_path,
)
from posttrain.models.lora import (
    LORA_INSTALL,
    cast_frozen_weights_once,
    default_target_modules,
    keep_autocast_inputs,
)
from posttrain.models.modeling import DTYPES, resolve_device, right_pad, unwrapped
from posttrain.models.compute import autocast_dtype, use_mixed_precision
from posttrain.models.packing import has_packed_attention, packed_forward, sequences_layout

SCORE_HEAD = "score"
"""transformers' name for the head of every ``*ForSequenceClassification`` decoder (Llama, Qwen2, Mistral ...)."""


def load_reward_model(name: str, *, dtype: str = "float32", device: str = "auto",
                      mixed_precision: str = "no") -> tuple[nn.Module, Any]:
    """(reward model with a fresh one-output ``score`` head, tokenizer) for the ``--model`` spec ``name``,
    checked and placed as :func:`posttrain.models.loading.load_model_and_tokenizer` does for a policy. The
    tokenizer always has a pad token (EOS when it defines none), and the model's config holds its id."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    target = resolve_device(device)
    mixed_precision = launched_mixed_precision(resolve_mixed_precision(mixed_precision, dtype, target))
    if mixed_precision == "bf16" and dtype != "float32":
        raise ConfigError(f"mixed_precision: bf16 computes float32 weights in bfloat16; with dtype {dtype} they "
                          "already are: use one of the two")
    check_dtype(dtype, target, mixed_precision)
    path = resolve_model_path(name)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=DTYPES[dtype]).to(target)
    model.config.pad_token_id = tokenizer.pad_token_id  # how the model finds each row's last real token
    if mixed_precision == "bf16":
        use_mixed_precision(model)  # the decoder stack; the score head stays float32
    return model, tokenizer


def check_reward_model(model: nn.Module, tokenizer: Any) -> None:
    """A model object handed over for reward-model training must be a ``transformers`` sequence-classification
    model with one output; its config gets the tokenizer's pad id when it has none (as :func:`load_reward_model`
    sets it)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    )

    labels = model.config.num_labels
    if labels != 1 or type(model).__name__ not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.values():
        raise ConfigError(
            f"model: a reward model object must be a sequence-classification model with one output, got "
            f"{type(model).__name__} with num_labels {labels}; build it with AutoModelForSequenceClassification."
            "from_pretrained(path, num_labels=1), or give the causal LM's directory as --model")
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id


def apply_reward_lora(model: nn.Module, model_config: ModelConfig) -> nn.Module:
    """``model`` with LoRA adapters of rank ``model_config.lora_r`` on its projections (the configured targets,
    else every ``nn.Linear`` but the head) and its ``score`` head trainable in full; the rest frozen."""
    if importlib.util.find_spec("peft") is None:
        raise ConfigError(f"lora_r: LoRA needs the peft package, which is not installed; install it with: {LORA_INSTALL}")
    from peft import LoraConfig, get_peft_model

    targets = [t for t in (model_config.lora_target_modules or default_target_modules(model)) if t != SCORE_HEAD]
    config = LoraConfig(r=model_config.lora_r, lora_alpha=model_config.lora_alpha,
                        lora_dropout=model_config.lora_dropout, target_modules=targets, bias="none",
                        task_type="SEQ_CLS", modules_to_save=[SCORE_HEAD])
    wrapped = get_peft_model(model, config)
    if autocast_dtype(model) is not None:
        keep_autocast_inputs(wrapped)
        cast_frozen_weights_once(wrapped)
    return wrapped


SCORED_CLASSES = ("LlamaForSequenceClassification", "MistralForSequenceClassification",
                  "Qwen2ForSequenceClassification")
"""Reward models whose score is exactly ``score(model(...).last_hidden_state)`` at the scored token."""


def split_score_head(model: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """``(decoder stack, score head)`` of one of transformers' :data:`SCORED_CLASSES` (under LoRA or not); None
    for any other model, which is scored through its own forward."""
    if any(c.peft_type != "LORA" for c in getattr(model, "peft_config", {}).values()):  # PeftType is a str enum
        return None  # prompt or prefix tuning act in the wrapper's forward, which the stack's call would skip
    base = unwrapped(model)
    if type(base).__name__ not in SCORED_CLASSES or not type(base).__module__.startswith("transformers.models."):
        return None
    return base.model, getattr(base, SCORE_HEAD)


def scored_positions(sequences: list[Tensor], pad_id: int | None) -> list[int]:
    """Where transformers' sequence classifier reads each sequence's score: its last token whose id is not
    ``pad_id`` (its first position when every token is)."""
    positions = []
    for ids in sequences:
        real = (ids != pad_id).nonzero() if pad_id is not None else torch.arange(len(ids))[:, None]
        positions.append(int(real[-1]) if len(real) else 0)
    return positions


def sequence_scores(model: nn.Module, sequences: list[Tensor], pad_id: int) -> Tensor:
    """[M] the reward model's score of each token sequence, in one forward pass (gradient as the caller's
    mode has it). The head reads each row's last token whose id is not ``config.pad_token_id``.

    With the packed attention (``posttrain.models.packing``: the trainer's default, ``trim_padding``) the
    sequences run as one row without padding, one causal attention call each, and the head only at the
    scored tokens; otherwise right-padded rows through the model's own forward."""
    device = next(model.parameters()).device
    parts = split_score_head(model)
    if parts is not None and has_packed_attention(parts[0]):
        stack, score = parts
        lengths = [len(ids) for ids in sequences]
        starts = torch.tensor([0] + lengths[:-1]).cumsum(0)
        ends = starts + torch.tensor(scored_positions(sequences, unwrapped(model).config.pad_token_id))
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
        hidden_SD = packed_forward(stack, torch.cat(sequences)[None].to(device), positions.to(device),
                                   sequences_layout(lengths).to(device)).last_hidden_state[0]
        return score(hidden_SD[ends.to(device)])[:, 0]
    ids_ML, attention_ML = right_pad(sequences, pad_id)
    logits_M1 = model(input_ids=ids_ML.to(device), attention_mask=attention_ML.to(device), use_cache=False).logits
    return logits_M1[:, 0]
