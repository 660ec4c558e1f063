"""Mixtures of experts in the training passes: what the routers chose, the load-balancing loss the model's config
asks for, and how evenly the experts are loaded.

transformers' mixtures of experts (Mixtral, Qwen3-MoE, Qwen3-Next, OLMoE, gpt-oss, DeepSeek-V3, GLM-4.5,
Granite 4) route through a ``...TopKRouter`` module that returns ``(router logits [T, E], weights [T, k],
chosen experts [T, k])``. :class:`RouterTrace` records those outputs for every pass that runs while it is
active, whatever path the pass takes (packed, grouped by length, on a cache), with which of the pass's tokens
are real (its attention mask, read from the decoder stack's call): padding is counted in neither the loss
nor the load. The loss is added as transformers adds it in ``ForCausalLM.forward`` and TRL's trainers add
it: when the model's config sets ``output_router_logits``, weighted by its ``router_aux_loss_coef``
(:func:`aux_loss_coef`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

import posttrain.functional as F
from posttrain.models.architecture import unwrapped


def is_router(module: nn.Module) -> bool:
    """Whether ``module`` is one of transformers' top-k routers (``Qwen3MoeTopKRouter``, ``DeepseekV3TopkRouter``...)."""
    return type(module).__name__.lower().endswith("topkrouter")


def routers(model: nn.Module) -> list[nn.Module]:
    """``model``'s routers, one per mixture-of-experts layer, in layer order."""
    return [m for m in model.modules() if is_router(m)]


def experts_per_token(model: nn.Module) -> int:
    """How many experts each token goes to (the config's ``num_experts_per_tok``)."""
    return int(unwrapped(model).config.get_text_config().num_experts_per_tok)


def aux_loss_coef(model: nn.Module) -> float:
    """The weight of the load-balancing loss in the training loss: the config's ``router_aux_loss_coef`` when it
    sets ``output_router_logits`` (as transformers and TRL add it), else 0."""
    config = unwrapped(model).config.get_text_config()
    if not getattr(config, "output_router_logits", False):
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


@dataclass
class RouterStats:
    """One training pass's routing: ``aux_loss`` (0-dim, with gradient) and metrics (floats)."""

    aux_loss: Tensor
    metrics: dict[str, float]


class RouterTrace:
    """While active, the outputs of every router of ``model`` and the real-token mask of the pass they came from.

    ``calls``: per router call, (router index, logits [T, E], chosen experts [T, k], real [T] bool)."""

    def __init__(self, model: nn.Module):
        self.routers = routers(model)
        self.body = unwrapped(model).base_model
        self.calls: list[tuple[int, Tensor, Tensor, Tensor]] = []
        self._real: Tensor | None = None
        self._handles: list = []

    def __enter__(self) -> RouterTrace:
        self._handles.append(self.body.register_forward_pre_hook(self._pass_begins, with_kwargs=True))
        for index, router in enumerate(self.routers):
            self._handles.append(router.register_forward_hook(
                lambda module, args, out, index=index: self._routed(index, out)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _pass_begins(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids")
        mask = kwargs.get("attention_mask")
        width = ids.shape[1] if ids is not None else kwargs["inputs_embeds"].shape[1]
        self._real = None if mask is None or mask.dim() != 2 else mask[:, -width:].reshape(-1).bool()

    def _routed(self, index: int, out: tuple[Tensor, Tensor, Tensor]) -> None:
        logits, _, chosen = out
        real = self._real if self._real is not None and len(self._real) == len(logits) else \
            torch.ones(len(logits), dtype=torch.bool, device=logits.device)
        self.calls.append((index, logits, chosen, real))

    def stats(self, top_k: int) -> RouterStats | None:
        """The load-balancing loss over the traced passes' real tokens (every layer pooled, as transformers
        computes it) and the expert load: ``moe/expert_load_max`` (the most loaded expert's share times E,
        averaged over layers: 1 when balanced), ``moe/dead_experts`` (the share of experts no real token
        chose). None when nothing was routed."""
        if not self.calls:
            return None
        layers = len(self.routers)
        logits = [torch.cat([c[1][c[3]] for c in self.calls if c[0] == i]) for i in range(layers)]
        chosen = [torch.cat([c[2][c[3]] for c in self.calls if c[0] == i]) for i in range(layers)]
        if any(len(x) != len(logits[0]) for x in logits):  # a layer that routed other tokens: none pooled
            return None
        aux = F.load_balancing_loss(torch.stack(logits), top_k)
        experts = logits[0].shape[-1]
        loads = torch.stack([F.expert_load(c, experts) for c in chosen])  # [L, E]
        metrics = {"moe/aux_loss": float(aux.detach()),
                   "moe/expert_load_max": float((loads.amax(-1) * experts).mean()),
                   "moe/dead_experts": float((loads == 0).float().mean())}
        return RouterStats(aux, metrics)
