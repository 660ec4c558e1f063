"""How a model computes while it trains: its attention (the packed form of its own), its precision (bfloat16
autocast around the decoder stack) and its memory (activation checkpointing of every decoder layer).

Each is set on the model as loaded, before training, and changes no number the model computes beyond the
dtype's rounding: the packed attention is measured against the model's own forward when it is set
(:func:`use_packed_attention`), mixed precision keeps the LM head and everything after it in float32, and a
checkpointed layer recomputes exactly its forward in the backward.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.utils.checkpoint
from torch import Tensor, nn

from posttrain.config import ConfigError
from posttrain.models.architecture import decoder_body, packing_unsupported_reason, unwrapped
from posttrain.models.packing import FLOAT32, PACKED, register_packed_attention
from posttrain.parallel.allocator import bound_kernel_caches


def checkpoint_layers(model: nn.Module) -> int:
    """Gradient checkpointing: every decoder layer of ``model`` keeps only its inputs when it runs with
    gradient and recomputes its forward in the backward (non-reentrant ``torch.utils.checkpoint``, RNG
    state restored, so the gradients are the ones without it). Returns the number of layers.

    transformers' own switch (``gradient_checkpointing_enable``) acts only in training mode; the
    preference trainer runs its policy in eval mode (no dropout), so the layers are wrapped here
    whatever the mode. Raises ConfigError when the model has no decoder layers to wrap.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ConfigError(f"gradient_checkpointing: {type(model).__name__} has no decoder layers that "
                          "transformers marks as checkpointable (GradientCheckpointingLayer)")
    for layer in layers:
        if not getattr(layer, "posttrain_checkpointed", False):
            layer.forward = functools.partial(_recomputed_in_backward, layer.forward)
            layer.posttrain_checkpointed = True
    return len(layers)


def _recomputed_in_backward(forward, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)


def is_checkpointed(module: nn.Module) -> bool:
    """Whether :func:`checkpoint_layers` wrapped a layer of ``module``."""
    return any(getattr(m, "posttrain_checkpointed", False) for m in module.modules())


FLOAT32_SDPA = FLOAT32
"""The attention implementation :func:`use_mixed_precision` gives a CPU model that used ``"sdpa"``:
transformers' SDPA attention with autocast off, on float32 inputs: on a CPU a training batch's
forward+backward runs faster than with the attention in bfloat16, for the same log-prob error against
float32 (benchmarks/RESULTS.md). transformers does not save it in the model's config."""


def register_attention_implementations() -> None:
    """Register posttrain's attention implementations with transformers (idempotent). A process that
    unpickles a model set to one of them (asynchronous rollouts' process) must call this first."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(FLOAT32_SDPA, _sdpa_in_float32)
    AttentionMaskInterface.register(FLOAT32_SDPA, sdpa_mask)  # the masks "sdpa" gets
    register_packed_attention()


def _sdpa_in_float32(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                     **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    with torch.autocast(query.device.type, enabled=False):
        return sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask, **kwargs)


def use_mixed_precision(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> None:
    """Mixed precision: ``model``'s decoder stack runs under ``torch.autocast(dtype)`` in every forward
    pass, whoever calls it; the weights, their gradients and the optimizer stay in their own dtype.

    The LM head, the value head and everything after them (log-softmax, losses) are outside the decoder
    stack and run in float32: the log-probs that enter the ratio and the KL are exactly the float32 head
    of the hidden states (MiniMax-M1, arXiv:2506.13585, traced training/inference probability mismatch to
    the head's precision). A model with no separate decoder stack (:func:`decoder_body` is the model) has
    its head under autocast too.

    Each forward pass is its own autocast region, so the weight casts autocast caches never outlive an
    optimizer step. The change is a ``functools.partial`` of a module-level function on the instance: a
    copy of the model (the reference) keeps it, bound to the copy, and it pickles (a bound method stored
    under another name than its own does not), so asynchronous rollouts can send the model to their
    process. :class:`posttrain.rollout.decode_step.FusedDecoder` reads the dtype and casts its
    prepared weights once per ``decode`` call. Calling it again is a no-op.

    On a CPU, attention stays float32 (:data:`FLOAT32_SDPA`: PyTorch's SDPA kernel runs slower in
    bfloat16, on a training batch and more so at one query row), and oneDNN's caches of compiled kernels are
    capped (:func:`posttrain.parallel.allocator.bound_kernel_caches`).
    """
    body = decoder_body(model)
    if getattr(body, "posttrain_autocast_dtype", None) is not None:
        return
    if "forward" in vars(body):  # the wrapper calls the class's forward: it would drop this one
        raise RuntimeError(f"use_mixed_precision: {type(body).__name__}.forward is already replaced on this "
                           "instance; apply mixed precision to the model as loaded, before other wrappers")
    body.posttrain_autocast_dtype = dtype
    body.forward = functools.partial(_autocast_forward, body)
    if next(body.parameters()).device.type == "cpu":
        bound_kernel_caches()
        base = unwrapped(model)
        if getattr(base.config, "_attn_implementation", None) == "sdpa":
            register_attention_implementations()
            base.set_attn_implementation(FLOAT32_SDPA)


def use_packed_attention(model: nn.Module) -> bool:
    """Give ``model`` the packed attention where a packed pass is its own forward
    (:func:`posttrain.models.architecture.packing_unsupported_reason`); whether it has it. Others keep their
    attention and train through length groups or padded rows (:func:`completion_outputs`)."""
    if packing_unsupported_reason(model) is not None:
        return False
    base = unwrapped(model)
    current = getattr(base.config, "_attn_implementation", None)
    target = PACKED.get(current, current)
    if target != current:
        register_packed_attention()
        base.set_attn_implementation(target)
    gap = packed_pass_gap(base)
    tolerance = 1e-4 if (autocast_dtype(model) or next(base.parameters()).dtype) == torch.float32 else 5e-2
    if not gap <= tolerance:  # the layout is lost on its way (layers that do not hand it to their attention)
        base.set_attn_implementation(current)
        base.posttrain_packing_declined = (f"a packed pass of two sequences is {gap:.0%} from its own forward over "
                                           "each, in its outputs or their gradients (its layers may not hand the "
                                           "layout to their attention, or add to it what the packed one leaves out)")
        return False
    return True


def packed_pass_gap(model: nn.Module) -> float:
    """How far a packed pass of two short sequences is from ``model``'s decoder stack over each alone: the larger of
    the final hidden states' mean absolute difference, relative to their mean size, and their gradients'
    (:func:`gradient_gap`, through a fixed random projection of those states, with respect to the stack's trainable
    parameters). What proves the packed attention reaches every layer of a family not checked before
    (transformers' layers normally hand their keyword arguments to their attention; a family whose layers do not
    would attend across the sequences), and computes everything the layer does: Doge's attention adds a bias
    learned from the values, equal to nothing at initialisation but not in its gradient."""
    from posttrain.models.packing import packed_forward, sequences_layout

    body = decoder_body(model)
    vocab = model.config.get_text_config().vocab_size
    lengths = [5, 4]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(vocab, (sum(lengths),), generator=generator)
    device = next(model.parameters()).device
    params = [p for p in body.parameters() if p.requires_grad]
    was_training = model.training
    model.eval()
    try:
        with torch.enable_grad():
            positions = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
            packed_SD = packed_forward(body, ids[None].to(device), positions,
                                       sequences_layout(lengths).to(device)).last_hidden_state[0].float()
            alone_SD = torch.cat([body(input_ids=part[None].to(device)).last_hidden_state[0]
                                  for part in ids.split(lengths)]).float()
            gap = float((packed_SD - alone_SD).abs().mean() / alone_SD.abs().mean().clamp(min=1e-12))
            if params:
                projection_SD = torch.randn(alone_SD.shape, generator=generator).to(device)
                grads = [torch.autograd.grad((states_SD * projection_SD).sum(), params, allow_unused=True)
                         for states_SD in (packed_SD, alone_SD)]
                gap = max(gap, gradient_gap(*grads))
    finally:
        model.train(was_training)
    return gap


def gradient_gap(mine: Sequence[Tensor | None], theirs: Sequence[Tensor | None]) -> float:
    """How far two passes' gradients of the same parameters are apart: the largest absolute difference of any
    parameter's, relative to that parameter's largest absolute gradient in ``theirs`` (the model's own forward),
    or to a hundredth of the largest anywhere where its own are smaller (their rounding is no gap). A parameter
    that only ``theirs`` reaches counts whole: 1 (a pass that skips part of the model)."""
    scale = max((float(b.abs().max()) for b in theirs if b is not None and b.numel()), default=0.0)
    worst = 0.0
    for a, b in zip(mine, theirs, strict=True):
        if a is None and b is None:
            continue
        a, b = (torch.zeros_like(b) if a is None else a.float()), (torch.zeros_like(a) if b is None else b.float())
        if not b.numel():
            continue
        size = max(float(b.abs().max()), 1e-2 * scale)
        difference = float((a - b).abs().max())
        worst = max(worst, difference / size if size > 0 else difference)
    return worst


def autocast_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype :func:`use_mixed_precision` set for ``model``'s decoder stack (None: its own dtype)."""
    return getattr(decoder_body(model), "posttrain_autocast_dtype", None)


def _autocast_forward(self: nn.Module, *args, **kwargs):
    device_type = next(self.parameters()).device.type
    with torch.autocast(device_type, dtype=self.posttrain_autocast_dtype):
        return type(self).forward(self, *args, **kwargs)
