"""One decode step of a Llama-architecture model, written against its weights: the ``fused`` step.

:func:`posttrain.rollout.generation.decode` runs the model's own forward pass for the prefill and, for
models this module does not hold, for every decode step. For Llama, Mistral and Qwen2 (the
decoder-only models whose layers are RMSNorm, rotary grouped-query attention and a SiLU-gated MLP,
which SmolLM2 and the embedded tiny model are) a decode step is instead :meth:`FusedDecoder.step`:

1. **Fused projections.** Each layer's query, key and value projections are one matrix
   ``[(H + 2 * KV) * D, hidden]``, the gate and up projections another ``[2 * I, hidden]``: four
   GEMMs per layer instead of seven.
2. **Weights laid out for few rows, on CPU.** At batch 16 a decode step is GEMMs with 16 rows, where
   MKL's ``linear`` on the weight as stored is slow, the LM head included. Each weight is prepared
   once per :func:`posttrain.rollout.generation.decode` call for the kernel :func:`choose_kernel` picks:
   oneDNN with the weight reordered (faster at these row counts) for large weights, MKL on a
   transposed copy (``x @ W.T`` with ``W.T`` contiguous) for small float32 ones (how small depends on
   the CPU's vendor: MKL's tuned kernels run on Intel CPUs only).
   ``benchmarks/generation.py`` has the step times, benchmarks/RESULTS.md the kernels' throughput.
   Elsewhere (a GPU, a dtype neither takes) it is ``F.linear`` on the fused weights.
3. **LoRA folded in.** Under ``peft`` LoRA adapters each projection runs ``W + (alpha / r) B A``,
   summed once per ``decode`` call (:func:`effective_weight`), instead of the adapter's two extra
   skinny GEMMs per projection through PEFT's module forward at every step.
4. **No module tree.** One function per step: no hooks, no mask construction per layer, no
   per-layer cache bookkeeping beyond writing one position.

The math is the model's: the same RMSNorm (computed in float32, as transformers does), the model's
own rotary module (so every RoPE scaling type it supports; its angles for every position of a
``decode`` call are computed once where they depend on the position alone), SDPA with the padding
mask, and the tied or untied LM head. Logits equal the module forward's to float32 rounding (oneDNN
sums in another order; ``tests/test_decode_step.py`` checks 1e-5 on every step,
``tests/test_rollout.py`` that greedy tokens equal ``generate``'s).

The prepared copies cost one copy of the weights while a ``decode`` call runs (540 MB for SmolLM2);
they are dropped when it returns, so the training phase's peak memory does not include them.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from posttrain.models.architecture import SUPPORTED, is_supported_class
from posttrain.models.modeling import unwrapped
from posttrain.models.compute import autocast_dtype


def unsupported_reason(model) -> str | None:
    """Why the fused step cannot run ``model`` (None: it can); the decode loop then runs the model's forward.

    Only the exact classes in :data:`SUPPORTED` qualify, alone or under LoRA adapters that
    :func:`effective_weight` folds in: an FSDP-sharded model, a subclass or another PEFT method may
    compute something else in its forward.
    """
    if os.environ.get("POSTTRAIN_DECODE_STEP", "fused") == "forward":
        return "POSTTRAIN_DECODE_STEP=forward"
    if is_lora(model):
        reason = lora_unsupported_reason(model)
        if reason:
            return reason
        model = unwrapped(model)
    if not is_supported_class(model):
        return f"{type(model).__name__} is not one of {', '.join(SUPPORTED)}"
    config = model.config
    if getattr(config, "hidden_act", None) != "silu":
        return f"hidden_act is {config.hidden_act!r}, not 'silu'"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp != 1"
    if model.training and getattr(config, "attention_dropout", 0.0):
        return "attention dropout is active"
    if any(not isinstance(p, Tensor) or type(p).__name__ == "DTensor" for p in model.parameters()):
        return "its parameters are sharded"
    return None


def is_lora(model) -> bool:
    """Whether ``model`` is a PEFT wrapper (it names a base model under it)."""
    return unwrapped(model) is not model


def lora_unsupported_reason(model) -> str | None:
    """Why a LoRA-wrapped model's adapters cannot be folded into the fused step's weights (None: they can).

    Folding computes ``W + get_delta_weight()`` per active adapter, which is the adapter's forward
    for plain LoRA; DoRA's magnitude vector, LoRA biases and other PEFT methods are not in that sum."""
    methods = {getattr(c.peft_type, "value", c.peft_type) for c in getattr(model, "peft_config", {}).values()}
    if methods != {"LORA"}:
        return f"its PEFT method is {', '.join(sorted(map(str, methods))) or 'unknown'}, not LoRA"
    for module in model.modules():
        if not hasattr(module, "lora_A"):
            continue
        for name in _active_adapters(module):
            if getattr(module, "use_dora", {}).get(name):
                return "its LoRA adapters use DoRA"
            if getattr(module, "lora_bias", {}).get(name):
                return "its LoRA adapters have biases"
            if name not in getattr(module, "lora_B", {}) or not hasattr(module.lora_B[name], "weight"):
                return f"{type(module).__name__} is not a LoRA linear layer"
    return None


def _active_adapters(module) -> list[str]:
    """The adapters a peft LoRA layer applies in its forward now: none when disabled or already merged."""
    if getattr(module, "disable_adapters", False) or getattr(module, "merged", False):
        return []
    return [name for name in module.active_adapters if name in module.lora_A]


def effective_weight(linear) -> tuple[Tensor, Tensor | None]:
    """``(weight, bias)`` that ``linear`` applies: for a peft LoRA layer, its base weight plus the delta
    ``(alpha / r) B A`` of each active adapter (none when the adapters are disabled, as for the
    reference, or already merged into the base weight)."""
    base = getattr(linear, "base_layer", None)
    if base is None:
        return linear.weight, linear.bias
    weight = base.weight
    for name in _active_adapters(linear):
        weight = weight + linear.get_delta_weight(name).to(weight.dtype)
    return weight, base.bias


ONEDNN_MIN_ELEMENTS = 2**18
"""Smaller weights computed in bfloat16 do not go to oneDNN: at a decode step's few rows its call
costs more than it saves on small weights. Float32 weights do not use it: they run transposed below
``TRANSPOSED_MAX_ELEMENTS`` and on oneDNN from there. Measurements: benchmarks/RESULTS.md (the
decode-kernel sections)."""

TRANSPOSED_MAX_ELEMENTS = {"GenuineIntel": 2**19, "AuthenticAMD": 2**17}
"""Float32 weights under this size (by CPU vendor; other vendors take Intel's) use MKL on a transposed
copy, the larger ones oneDNN on a reordered copy. ``F.linear`` hands MKL the weight as ``[out, in]``;
``x @ W.T`` with ``W.T`` stored contiguous as ``[in, out]`` runs faster on small weights at
16 rows on Intel, while above the threshold oneDNN stays ahead. MKL runs its tuned kernels on Intel
CPUs only, so on AMD oneDNN wins from a smaller size. Measurements per vendor, kernel and whole
decode call: benchmarks/RESULTS.md ("the decode kernel by CPU vendor")."""


@functools.cache
def cpu_vendor() -> str:
    """``vendor_id`` of /proc/cpuinfo ("GenuineIntel", "AuthenticAMD", ...); "" where there is none."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("vendor_id")), "")


def choose_kernel(weight: Tensor, dtype: torch.dtype) -> str:
    """The GEMM a decode step runs ``weight`` (computed in ``dtype``) with: "onednn" (reordered once),
    "mm" (on a contiguous transposed copy) or "linear" (``F.linear`` on the weight as it is)."""
    if not weight.is_cpu:
        return "linear"
    onednn = "onednn" if torch.backends.mkldnn.is_available() else "linear"
    if dtype == torch.float32:
        transposed_max = TRANSPOSED_MAX_ELEMENTS.get(cpu_vendor(), TRANSPOSED_MAX_ELEMENTS["GenuineIntel"])
        return "mm" if weight.numel() < transposed_max else onednn
    if dtype == torch.bfloat16 and weight.numel() >= ONEDNN_MIN_ELEMENTS:
        return onednn
    return "linear"


class Linear:
    """``x @ weight.T + bias`` with the weight prepared once for many calls with ``rows`` rows."""

    def __init__(self, weight: Tensor, bias: Tensor | None, rows: int, dtype: torch.dtype | None = None):
        """``dtype``: compute in it (a cast of the weight made once here, of the input at each call);
        None: in the weight's own dtype."""
        self.dtype = dtype or weight.dtype
        weight, self.bias = weight.to(self.dtype), None if bias is None else bias.to(self.dtype)
        self.kernel = choose_kernel(weight, self.dtype)
        if self.kernel == "onednn":
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
        elif self.kernel == "mm":
            self.weight = weight.t().contiguous()  # [in, out]
        else:
            self.weight = weight

    def __call__(self, x: Tensor) -> Tensor:
        x = x.to(self.dtype)
        if self.kernel == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        if self.kernel == "mm":
            return x @ self.weight if self.bias is None else torch.addmm(self.bias, x, self.weight)
        return F.linear(x, self.weight, self.bias)


def fused(*linears) -> tuple[Tensor, Tensor | None]:
    """The weights (and biases, if any has one) of ``linears`` stacked along the output dimension."""
    pairs = [effective_weight(m) for m in linears]
    weight = torch.cat([w for w, _ in pairs]) if len(pairs) > 1 else pairs[0][0].contiguous()
    if all(b is None for _, b in pairs):
        return weight, None
    return weight, torch.cat([b if b is not None else w.new_zeros(len(w)) for w, b in pairs])


@dataclass
class Layer:
    input_norm: Tensor
    qkv: Linear
    out: Linear
    post_attention_norm: Tensor
    gate_up: Linear
    down: Linear


def rms_norm(hidden_ND: Tensor, weight_D: Tensor, eps: float) -> Tensor:
    """transformers' RMSNorm: normalised in float32, cast back, then scaled."""
    if hidden_ND.dtype == torch.float32:  # the same products in the same order, in one call
        return F.rms_norm(hidden_ND, weight_D.shape, weight_D, eps)
    h = hidden_ND.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight_D * h.to(hidden_ND.dtype)


def signed_sin(sin: Tensor) -> Tensor:
    """``sin`` with its first half negated, for :func:`rotate`."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), -1)


def rotate(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """Rotary embedding on the last dimension, Llama's half-split convention: ``x * cos +
    rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``, computed as ``roll(x) * cat(-s1, s2)``
    (the same products: a sign moves from one factor to the other), two operations fewer."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""Rotary types whose angles depend on the position alone; "dynamic" and "longrope" also depend on
the longest position in the batch, so they run the model's rotary module at every step."""


class FusedDecoder:
    """A supported model's weights prepared for decode steps with up to ``rows`` rows."""

    def __init__(self, model, rows: int, positions: int | None = None):
        """``positions``: one more than the largest position the steps will see; with it the rotary
        angles of every position are computed once here instead of at every step."""
        model = unwrapped(model)  # LoRA adapters are folded into the weights below (effective_weight)
        config, body = model.config, model.model
        self.body = body
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        # a bool made here, not compared in the step: under torch.compile with dynamic shapes the step's ints
        # are traced as symbols, and SDPA's enable_gqa takes no symbolic bool
        self.grouped = self.kv_heads != self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.intermediate = config.intermediate_size
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim**-0.5  # transformers' attention scaling, to the same bits
        # Mixed precision (posttrain.models.compute.use_mixed_precision): the layers' products in its dtype, as
        # the decoder stack's forward runs them under autocast; the LM head in the weights' dtype.
        self.autocast_dtype = autocast_dtype(model)
        self.layers = []
        for block in body.layers:
            attention, mlp = block.self_attn, block.mlp
            self.layers.append(Layer(
                input_norm=block.input_layernorm.weight,
                qkv=Linear(*fused(attention.q_proj, attention.k_proj, attention.v_proj), rows, self.autocast_dtype),
                out=Linear(*fused(attention.o_proj), rows, self.autocast_dtype),
                post_attention_norm=block.post_attention_layernorm.weight,
                gate_up=Linear(*fused(mlp.gate_proj, mlp.up_proj), rows, self.autocast_dtype),
                down=Linear(*fused(mlp.down_proj), rows, self.autocast_dtype),
            ))
        self.final_norm = body.norm.weight
        self.lm_head = Linear(*fused(model.lm_head), rows)
        self.cos_PD = self.sin_signed_PD = None
        if positions is not None and getattr(body.rotary_emb, "rope_type", None) in STATIC_ROPE_TYPES:
            weight = body.embed_tokens.weight
            cos, sin = body.rotary_emb(weight[:1], torch.arange(positions, device=weight.device)[None])
            self.cos_PD, self.sin_signed_PD = cos[0], signed_sin(sin[0])

    def step(self, token_N: Tensor, position_N1: Tensor, attention_NS: Tensor, cache) -> Tensor:
        """Next-token logits [N, V] after appending ``token_N`` at ``position_N1`` to every row.

        attention_NS: [N, S] 1 for real tokens, 0 for left padding, S = cached length + 1.
        cache: the :class:`posttrain.rollout.generation.PreallocatedLayer` cache the prefill filled; each layer
        gets the new position's keys and values written in place.
        """
        n, h, kv, d = len(token_N), self.heads, self.kv_heads, self.head_dim
        hidden = self.body.embed_tokens(token_N)  # [N, hidden]
        if self.cos_PD is not None:
            cos, sin = self.cos_PD[position_N1], self.sin_signed_PD[position_N1]  # [N, 1, D]
        else:
            cos, sin = self.body.rotary_emb(hidden, position_N1)
            sin = signed_sin(sin)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [N, 1, 1, D], against [N, heads, 1, D]
        mask_N11S = attention_NS.bool()[:, None, None, :]
        for layer, kv_cache in zip(self.layers, cache.layers):
            qkv = layer.qkv(rms_norm(hidden, layer.input_norm, self.eps))
            query_key = rotate(qkv[:, : (h + kv) * d].view(n, h + kv, 1, d), cos, sin)  # one rotation for both
            query, key = query_key[:, :h], query_key[:, h:]
            value = qkv[:, (h + kv) * d :].view(n, kv, 1, d)
            keys, values = kv_cache.update(key, value)
            # Under mixed precision the query and the cache are float32 (the rotation promotes; the cache
            # keeps the wider dtype): SDPA's CPU kernel at one query row runs slower in bfloat16.
            attended = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask_N11S,
                                                      scale=self.scale, enable_gqa=self.grouped)
            hidden = hidden + layer.out(attended.reshape(n, h * d))
            gate_up = layer.gate_up(rms_norm(hidden, layer.post_attention_norm, self.eps))
            hidden = hidden + layer.down(F.silu(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate :])
        return self.lm_head(rms_norm(hidden, self.final_norm, self.eps))
