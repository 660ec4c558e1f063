"""LoRA through ``peft``: adapters on the policy, the base model as the reference, merged saving.

1. :func:`apply_lora` wraps a ``transformers`` model in a ``peft`` LoRA model (Hu et al. 2021,
   arXiv:2106.09685): ``h = W x + (lora_alpha / r) * B A x`` with ``A`` Kaiming-initialised and
   ``B = 0``, so the wrapped model starts exactly equal to the base model. Base weights are frozen;
   only ``A`` and ``B`` train. Default targets: every ``nn.Linear`` of the network except the output
   head and a router, i.e. each attention and MLP projection (Llama: q, k, v, o, gate, up, down) and the
   projections around linear-attention, convolution and Mamba layers; and, in a mixture of experts, every
   expert's projections, which transformers stores as one 3-D parameter per projection
   (:func:`default_target_parameters`, through ``peft``'s ``target_parameters``).
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
import functools
import importlib.util
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.config import ConfigError, ModelConfig
from posttrain.models.architecture import decoder_body
from posttrain.models.modeling import AdaptersDisabled, frozen_copy
from posttrain.models.compute import autocast_dtype
from posttrain.models.vision import is_vision_model, language_only, vision_parts
from posttrain.parallel.offload import offload

LORA_INSTALL = "pip install 'posttrain[lora]'  (or: pip install 'peft>=0.13,<1')"


ROUTERS = ("gate", "router")
"""What a mixture of experts calls its router when it is a plain ``nn.Linear`` (older families): never adapted,
so LoRA does not change which experts a token goes to."""


def default_target_modules(model: nn.Module, outside: tuple[str, ...] = ()) -> list[str]:
    """Names (last component) of every ``nn.Linear`` (or transformers' ``Conv1D``, GPT-2's) except the output head
    and a mixture of experts' router:
    the attention and MLP projections of a decoder, and the projections around its linear-attention,
    convolution and Mamba mixers, whatever the architecture calls them. Modules under the ``outside`` paths (a
    vision-language model's tower and projector) add no names: a projector's ``nn.Sequential`` would add ``0``,
    which names whole decoder layers too."""
    from transformers.pytorch_utils import Conv1D  # GPT-2's and OpenAI GPT's projections: a linear layer, transposed

    head = model.get_output_embeddings()
    experts = _routed_experts(model)
    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
             if isinstance(module, (nn.Linear, Conv1D)) and module is not head
             and not any(name.startswith(prefix + ".") for prefix in outside)
             and not (experts and name.rsplit(".", 1)[-1] in ROUTERS and module.out_features == experts)}
    return sorted(names)


def default_target_parameters(model: nn.Module) -> list[str]:
    """The experts of a mixture of experts as transformers stores them, one 3-D parameter per projection for
    all experts (``mlp.experts.gate_up_proj [E, ...]``): ``peft``'s ``target_parameters`` give each of them an
    adapter, where ``target_modules`` (``nn.Linear`` only) would leave every expert frozen."""
    return sorted({f"{name.rsplit('.', 1)[-1]}.{param}" for name, module in model.named_modules()
                   if type(module).__name__.endswith("Experts")
                   for param, value in module.named_parameters(recurse=False) if value.dim() == 3})


def _routed_experts(model: nn.Module) -> int:
    """The number of routed experts in ``model``'s config (0 without a mixture of experts)."""
    config = model.config.get_text_config()
    return next((getattr(config, key) for key in ("num_experts", "num_local_experts", "n_routed_experts")
                 if getattr(config, key, None)), 0)


def apply_lora(model: nn.Module, model_config: ModelConfig) -> nn.Module:
    """``model`` with LoRA adapters of rank ``model_config.lora_r``; only the adapters require grad."""
    if importlib.util.find_spec("peft") is None:
        raise ConfigError(f"lora_r: LoRA needs the peft package, which is not installed; install it with: {LORA_INSTALL}")
    from peft import LoraConfig, get_peft_model

    towers, projectors = vision_parts(model) if is_vision_model(model) else ([], [])
    targets = list(model_config.lora_target_modules) or default_target_modules(model, tuple(towers + projectors))
    parameters = [] if model_config.lora_target_modules else default_target_parameters(model)
    whole = None
    if is_vision_model(model):  # adapters on the language model; the vision parts train whole or not at all
        targets = language_only(model, targets)
        whole = {"none": None, "projector": projectors, "tower": towers + projectors}[model_config.train_vision]
    config = LoraConfig(r=model_config.lora_r, lora_alpha=model_config.lora_alpha,
                        lora_dropout=model_config.lora_dropout, target_modules=targets, bias="none",
                        task_type="CAUSAL_LM", target_parameters=parameters or None, modules_to_save=whole)
    wrapped = get_peft_model(model, config)
    if autocast_dtype(model) is not None:
        keep_autocast_inputs(wrapped)
        cast_frozen_weights_once(wrapped)
    fuse_adapter_products(wrapped)
    return wrapped


def fuse_adapter_products(model: nn.Module) -> None:
    """Give each LoRA linear layer :func:`fused_lora_forward`: the adapter's product added to the base
    layer's output in one ``addmm``, scaling included, with a backward of four small products.

    peft computes ``base(x) + B(A(dropout(x))) * scaling``: two passes over the ``[tokens, out]`` output
    besides the products (the scaling, the sum), and as many in the backward. At the SmolLM2 recipe's
    shape (1,400 tokens, 576 -> 1536, bf16 autocast) a projection's forward and backward took 8.2 ms that
    way against 6.3 ms fused, and the base product alone 4.3 ms (benchmarks/RESULTS.md)."""
    from peft.tuners.lora.layer import Linear

    for module in model.modules():
        if type(module) is Linear:
            module.forward = functools.partial(fused_lora_forward, module)


def fused_lora_forward(module: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """A peft LoRA ``Linear``'s forward, with the adapter product fused (:class:`_AdapterProduct`) where it
    is plain LoRA: one active adapter, unmerged, no dropout, no variant (DoRA), no per-row adapters.
    Anything else is peft's own forward (named, not ``type(module).forward``: a subclass that takes this
    function as its forward, as ``benchmarks/recipe_step.py --compile`` makes, would call itself)."""
    from peft.tuners.lora.layer import Linear

    adapters = [name for name in module.active_adapters if name in module.lora_A]
    if (module.disable_adapters or module.merged or args or kwargs or len(adapters) != 1
            or adapters[0] in module.lora_variant or not isinstance(module.lora_dropout[adapters[0]], nn.Identity)):
        return Linear.forward(module, x, *args, **kwargs)
    name = adapters[0]
    if torch.is_autocast_enabled(x.device.type):  # one cast of the input, for the base product and the adapter's
        x = x.to(torch.get_autocast_dtype(x.device.type))
    base = module.base_layer(x)
    return _AdapterProduct.apply(base, x, module.lora_A[name].weight, module.lora_B[name].weight,
                                 float(module.scaling[name]))


class _AdapterProduct(torch.autograd.Function):
    """``base + scaling * (x A^T) B^T`` in the base output's dtype: base [..., out], x [..., in], A [r, in],
    B [out, r]. The backward: ``g`` to the base, ``scaling * (g B) A`` to x, ``scaling * (g B)^T x`` to A,
    ``scaling * g^T (x A^T)`` to B, each in its input's dtype."""

    @staticmethod
    def forward(ctx: Any, base: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                scaling: float) -> torch.Tensor:
        dtype = base.dtype
        x_TI = x.reshape(-1, x.shape[-1]).to(dtype)
        a, b = lora_a.to(dtype), lora_b.to(dtype)
        u_TR = x_TI @ a.t()
        out = torch.addmm(base.reshape(-1, base.shape[-1]), u_TR, b.t(), alpha=scaling)
        ctx.save_for_backward(x_TI, a, b, u_TR)
        ctx.scaling, ctx.x_meta = scaling, (x.shape, x.dtype, lora_a.dtype, lora_b.dtype)
        return out.view(base.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_TI, a, b, u_TR = ctx.saved_tensors
        x_shape, x_dtype, a_dtype, b_dtype = ctx.x_meta
        g_TO = grad.reshape(-1, grad.shape[-1]).to(a.dtype)
        gu_TR = (g_TO @ b) * ctx.scaling
        grad_x = (gu_TR @ a).view(x_shape).to(x_dtype) if ctx.needs_input_grad[1] else None
        grad_a = (gu_TR.t() @ x_TI).to(a_dtype) if ctx.needs_input_grad[2] else None
        grad_b = torch.mm(g_TO.t(), u_TR).mul_(ctx.scaling).to(b_dtype) if ctx.needs_input_grad[3] else None
        return grad, grad_x, grad_a, grad_b, None


def keep_autocast_inputs(model: nn.Module) -> None:
    """Under mixed precision, stop each LoRA layer from casting its bfloat16 input to its float32 adapter
    weights' dtype before the adapter product: the decoder stack runs under autocast, which casts both
    operands back to bfloat16 for the product, so the cast is two copies of the activation for nothing.
    Layers outside the autocast region see float32 inputs already."""
    for module in decoder_body(model).modules():
        if hasattr(module, "cast_input_dtype_enabled"):
            module.cast_input_dtype_enabled = False


def cast_frozen_weights_once(model: nn.Module) -> None:
    """Under mixed precision, let each LoRA layer's frozen base linear keep its weight's autocast cast
    between forward passes instead of casting it again in every one.

    Autocast caches the casts of trainable leaf weights only within one autocast region, and frozen
    weights not at all, so otherwise every forward of a LoRA model (each micro-batch, the prompt and
    completion passes, the reference) copies the whole base model to bfloat16. The base weights never change
    during LoRA training, so the cast is made once and reused. It is remade when the weight is replaced
    or changes in place through autograd's view of it (its version counter moves, as on
    ``load_state_dict``). PEFT's merge writes through ``weight.data``, which the counter does not see, so
    while the adapters are merged the layer casts as autocast does and forgets its kept cast, and code
    that merges and unmerges calls :func:`forget_kept_casts`. The products are autocast's own, bit for
    bit; the cost is one bfloat16 copy of the base weights in memory.
    """
    for module in decoder_body(model).modules():
        base = getattr(module, "base_layer", None)
        if type(base) is nn.Linear and "forward" not in vars(base):
            base.forward = functools.partial(_linear_with_kept_cast, base, module)


def forget_kept_casts(model: nn.Module) -> None:
    """Drop the casts :func:`cast_frozen_weights_once` kept (the next forward makes them again): after
    code that changed base weights behind the version counter, such as PEFT's merge and unmerge."""
    for module in model.modules():
        module.__dict__.pop("_posttrain_kept_cast", None)


def _linear_with_kept_cast(self: nn.Linear, lora_layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` with the weight's autocast cast kept on the module (see
    :func:`cast_frozen_weights_once`); trainable or sharded weights, merged adapters and calls outside
    autocast go the plain way."""
    device_type = x.device.type
    weight = self.weight
    if (weight.requires_grad or getattr(lora_layer, "merged", False) or not torch.is_autocast_enabled(device_type)
            or type(weight) is not nn.Parameter and type(weight) is not torch.Tensor):
        self.__dict__.pop("_posttrain_kept_cast", None)
        return F.linear(x, weight, self.bias)
    dtype = torch.get_autocast_dtype(device_type)
    if weight.dtype == dtype:
        return F.linear(x, weight, self.bias)
    key = (weight.data_ptr(), weight._version, dtype)
    kept = self.__dict__.get("_posttrain_kept_cast")
    if kept is None or kept[0] != key:
        with torch.inference_mode(False):  # made during generation, it must still serve a training forward
            kept = (key, weight.detach().to(dtype))
        self.__dict__["_posttrain_kept_cast"] = kept
    return F.linear(x, kept[1], self.bias)


def is_lora(model: Any) -> bool:
    """Whether ``model`` is a ``peft`` model (peft not yet imported: it cannot be)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


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
