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


# ---------------------------------------------------------------------------------------
# Routing replay: the experts chosen while sampling, used in the training pass
# ---------------------------------------------------------------------------------------


def _softmax_then_top(module: nn.Module, logits: Tensor, chosen: Tensor) -> Tensor:
    """Qwen3-MoE, Qwen3-Next, OLMoE, Mixtral: each chosen expert's softmax probability over all experts,
    renormalised over the chosen ones where the router does (Mixtral always)."""
    weights = logits.float().softmax(-1).gather(1, chosen)
    if getattr(module, "norm_topk_prob", True):
        weights = weights / weights.sum(-1, keepdim=True)
    return weights if type(module).__name__ == "MixtralTopKRouter" else weights.to(logits.dtype)


def _top_then_softmax(module: nn.Module, logits: Tensor, chosen: Tensor) -> Tensor:
    """gpt-oss, Granite 4: a softmax over the chosen experts' logits only."""
    return logits.gather(1, chosen).softmax(-1, dtype=logits.dtype)


def _sigmoid_scores(module: nn.Module, logits: Tensor, chosen: Tensor) -> Tensor:
    """DeepSeek-V3, GLM-4.5: the chosen experts' sigmoid scores (without the bias that steers the choice),
    renormalised where the router does, times its scaling factor."""
    weights = logits.sigmoid().gather(1, chosen)
    if module.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * module.routed_scaling_factor


REPLAYED_WEIGHTS = {
    **dict.fromkeys(["Qwen3MoeTopKRouter", "Qwen3NextTopKRouter", "OlmoeTopKRouter", "MixtralTopKRouter"],
                    _softmax_then_top),
    **dict.fromkeys(["GptOssTopKRouter", "GraniteMoeHybridTopKRouter"], _top_then_softmax),
    **dict.fromkeys(["DeepseekV3TopkRouter", "Glm4MoeTopkRouter"], _sigmoid_scores),
}
"""Router class -> the weights it gives experts it did not choose itself: the same function of its logits it
applies to its own choice (checked per family: replaying a router's own choice gives its own output)."""


def replay_unsupported_reason(model: nn.Module) -> str | None:
    """Why routing replay cannot run ``model`` (None: it can): a mixture of experts whose routers posttrain
    knows how to weight a given choice with."""
    found = routers(model)
    if not found:
        return f"{type(unwrapped(model)).__name__} has no mixture of experts to replay the routing of"
    unknown = sorted({type(r).__name__ for r in found} - set(REPLAYED_WEIGHTS))
    if unknown:
        return f"posttrain does not know how {', '.join(unknown)} weights a given choice of experts"
    return None


class RoutingReplay:
    """While active, every router of ``model`` takes the experts it is given instead of choosing: for a pass,
    ``chosen_LTK`` [L, T, k] (one layer's choice per router, in layer order) for the tokens where
    ``replaced_T`` [T] is True; elsewhere (padding) its own choice. The weights are recomputed from the
    router's current logits (:data:`REPLAYED_WEIGHTS`), so the router still trains."""

    def __init__(self, model: nn.Module):
        self.routers = routers(model)
        self._layer = {id(r): i for i, r in enumerate(self.routers)}
        self.chosen_LTK: Tensor | None = None
        self.replaced_T: Tensor | None = None
        self._handles: list = []

    def __enter__(self) -> RoutingReplay:
        self._handles = [r.register_forward_hook(self._replay) for r in self.routers]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def set_pass(self, chosen_LTK: Tensor | None, replaced_T: Tensor | None) -> None:
        self.chosen_LTK, self.replaced_T = chosen_LTK, replaced_T

    def _replay(self, module: nn.Module, args: tuple, out: tuple[Tensor, Tensor, Tensor]):
        if self.chosen_LTK is None:
            return out
        logits, weights, chosen = out
        given = self.chosen_LTK[self._layer[id(module)]].to(chosen)
        if given.shape != chosen.shape:
            raise RuntimeError(f"routing replay: {type(module).__name__} routed {tuple(chosen.shape)} token choices, "
                               f"the replayed pass holds {tuple(given.shape)}")
        chosen = torch.where(self.replaced_T.to(chosen.device)[:, None], given, chosen)
        return logits, REPLAYED_WEIGHTS[type(module).__name__](module, logits, chosen).to(weights.dtype), chosen
