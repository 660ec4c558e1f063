"""LoRA through ``peft``: adapters on the policy, the base model as the reference, merged saving.

1. :func:`apply_lora` wraps a ``transformers`` model in a ``peft`` LoRA model (Hu et al. 2021,
   arXiv:2106.09685): ``h = W x + (lora_alpha / r) * B A x`` with ``A`` Kaiming-initialised and
   ``B = 0``, so the wrapped model starts exactly equal to the base model. Base weights are frozen;
   only ``A`` and ``B`` train. Default targets: every ``nn.Linear`` of the network except the output
   head, i.e. each attention and MLP projection (Llama: q, k, v, o, gate, up, down).
2. :class:`AdaptersDisabled` is the reference model without a second copy in memory: the same
   network, run with its adapters switched off (``disable_adapter()``), in eval mode and without
   gradient. It stands in for ``session.ref`` wherever a reference model is called.
3. :func:`merged_for_saving` gives a plain ``transformers`` model with ``W + (alpha / r) B A``
   folded into the weights, for ``final_model/`` (loads with plain ``from_pretrained``). It merges
   a copy, so the run's model keeps its adapters (the copy costs one model's memory, briefly).

``peft`` is the optional extra ``posttrain[lora]``.
"""

from __future__ import annotations

import copy
import importlib.util
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from posttrain.config import ConfigError, ModelConfig
from posttrain.models.modeling import autocast_dtype, decoder_body, frozen_copy
from posttrain.parallel.offload import offload

LORA_INSTALL = "pip install 'posttrain[lora]'  (or: pip install 'peft>=0.13,<1')"


def default_target_modules(model: nn.Module) -> list[str]:
    """Names (last component) of every ``nn.Linear`` except the output head: the attention and MLP
    projections of a decoder, whatever the architecture calls them."""
    head = model.get_output_embeddings()
    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
             if isinstance(module, nn.Linear) and module is not head}
    return sorted(names)


def apply_lora(model: nn.Module, model_config: ModelConfig) -> nn.Module:
    """``model`` with LoRA adapters of rank ``model_config.lora_r``; only the adapters require grad."""
    if importlib.util.find_spec("peft") is None:
        raise ConfigError(f"lora_r: LoRA needs the peft package, which is not installed; install it with: {LORA_INSTALL}")
    from peft import LoraConfig, get_peft_model

    targets = list(model_config.lora_target_modules) or default_target_modules(model)
    config = LoraConfig(r=model_config.lora_r, lora_alpha=model_config.lora_alpha,
                        lora_dropout=model_config.lora_dropout, target_modules=targets, bias="none",
                        task_type="CAUSAL_LM")
    wrapped = get_peft_model(model, config)
    if autocast_dtype(model) is not None:
        keep_autocast_inputs(wrapped)
    return wrapped


def keep_autocast_inputs(model: nn.Module) -> None:
    """Under mixed precision, stop each LoRA layer from casting its bfloat16 input to its float32 adapter
    weights' dtype before the adapter product: the decoder stack runs under autocast, which casts both
    operands back to bfloat16 for the product, so the cast is two copies of the activation for nothing.
    Layers outside the autocast region see float32 inputs already."""
    for module in decoder_body(model).modules():
        if hasattr(module, "cast_input_dtype_enabled"):
            module.cast_input_dtype_enabled = False


def is_lora(model: Any) -> bool:
    """Whether ``model`` is a ``peft`` model (peft not yet imported: it cannot be)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


class AdaptersDisabled:
    """The base model under a LoRA policy, as a reference model: ``ref(**inputs)`` runs the shared
    network with the adapters off, in eval mode (no dropout) and without gradient.

    Not an ``nn.Module`` on purpose: ``ref.eval()``, ``ref.requires_grad_(False)`` or an optimizer
    over ``ref.parameters()`` must not reach the policy's weights through it.
    """

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), self.model.disable_adapter():
                return self.model(*args, **kwargs)
        finally:
            self.model.train(was_training)

    def parameters(self) -> Iterator[nn.Parameter]:
        """The shared network's parameters (read for the device only)."""
        return self.model.parameters()

    @property
    def device(self) -> torch.device:
        return self.model.device


def reference_model(policy: nn.Module, offloaded: bool = False) -> Any:
    """The reference for ``policy``: its adapter-free base model under LoRA, else a frozen copy;
    ``offloaded``: the copy's weights kept out of memory between passes (:mod:`posttrain.parallel.offload`)."""
    if is_lora(policy):
        return AdaptersDisabled(policy)
    return offload(frozen_copy(policy)) if offloaded else frozen_copy(policy)


def merged_for_saving(model: nn.Module) -> nn.Module:
    """A plain ``transformers`` model to save: under LoRA a merged copy, otherwise ``model`` itself."""
    if not is_lora(model):
        return model
    return copy.deepcopy(model).merge_and_unload()
