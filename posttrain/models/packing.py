"""Packed training passes: a micro-batch's rows concatenated into one row without padding, each group's
prompt placed once, attention kept inside each group by posttrain's attention function.

Layout. The rows of a micro-batch form groups: the rows that share a prompt (a GRPO group's samples, when
prompts are shared) or each row alone. A group is one contiguous span of the packed row: its prompt, then
each member's completion inputs (the completion tokens but the last, which predicts nothing). Positions
restart at every group: the prompt's run ``0..P-1`` and every completion continues from ``P``, exactly
the positions the padded path gives its real tokens. SFT's examples and a reward model's texts are
whole sequences one after another (:func:`sequences_layout`): a group of one member each.

Attention. Within a group, a prompt token sees the prompt's earlier tokens, and a completion token sees
the whole prompt and its own completion's earlier tokens, never a sibling's. That is the padded path's
attention, restricted to real tokens, so the hidden states are the same up to float rounding (tested).
A single sequence is one causal SDPA call (``is_causal`` lets the CPU kernel skip the blocks above the
diagonal); a shared prompt's group is one causal call for the prompt and one per completion, over the
prompt's keys and values and its own (an explicit ``[m, P + m]`` mask): a sibling's tokens are never
computed against, where one masked call over the whole group would compute every pair of its tokens.
No CPU kernel takes variable-length batches (FlashAttention's varlen has no CPU path, FlexAttention no
CPU backward), so the groups run one call each: a few per layer at the recipe's shape, against one GEMM
pass over every real token instead of the padded rectangle. On a CUDA GPU in float16 or bfloat16 the
whole layout is one call of PyTorch's FlashAttention ``varlen_attn`` instead (:class:`VarlenIndex`: a
completion's segment holds the prompt's keys and its own, causal from the bottom right).

Sliding windows, soft-capping, sinks. A layer that slides passes its window to its attention, and each piece
keeps only the keys within it (:func:`visible`: by position, as transformers' mask keeps them by index, which
is the same for a sequence's real tokens). A model on eager attention runs its own modeling file's eager
function once per piece, with that piece's mask: whatever the family computes per query (Gemma 2's
soft-capped scores, gpt-oss's sinks) comes with it. A model on SDPA runs SDPA per piece; an argument SDPA
would not honour either is an error naming it, never dropped. Layers that are not attention (recurrent,
linear attention, convolutions) would carry state from one sequence into the next: such a model is not
packed (:func:`posttrain.models.architecture.packing_unsupported_reason`).

The attention functions are registered with transformers under :data:`PACKED`'s names, one per
implementation a model may run (SDPA, SDPA in float32 for CPU mixed precision, eager), and dispatch on
their keyword argument: a forward without a layout runs the model's implementation as before, so
generation, evaluation and the reference pass are unchanged, and a recomputed (gradient-checkpointed) layer
gets its layout again from the saved arguments.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

FLOAT32 = "posttrain_sdpa_float32"
"""transformers' SDPA attention computed in float32 with autocast off: what a CPU model under mixed precision
runs (:func:`posttrain.models.compute.use_mixed_precision`)."""
PACKED = {"sdpa": "posttrain_packed_sdpa", FLOAT32: "posttrain_packed_sdpa_float32", "eager": "posttrain_packed_eager"}
"""The attention implementation a model runs -> the packed form of it: the same implementation for a pass
without a layout, the packed attention with one (SDPA per piece for the two SDPA forms, the model's own
eager function per piece for ``eager``)."""
PACKED_SDPA, PACKED_SDPA_FLOAT32, PACKED_EAGER = PACKED.values()


@dataclass
class Span:
    """One group in the packed row: ``[start, start + prompt)`` its prompt, then its members' completion inputs at
    ``blocks`` (offset from ``start``, length). ``shared``: the members share the prompt, and each completion
    attends to it and to itself only; otherwise the span is one sequence (a single member)."""

    start: int
    prompt: int
    blocks: list[tuple[int, int]]
    shared: bool = False

    @property
    def pieces(self) -> list[int]:
        """The lengths the attention splits this span into: the whole (one sequence), or the prompt and
        each completion."""
        if not self.shared:
            at, m = self.blocks[-1]
            return [at + m]
        return [self.prompt] + [m for _, m in self.blocks]


@dataclass
class PackedLayout:
    """Where each group lies in the packed row, and where each row's predicting hidden states are.

    index_NT: [n, T] the packed position whose hidden state predicts completion token t of row n (0 where
    there is none); valid_NT: [n, T] bool, those that exist."""

    spans: list[Span]
    index_NT: Tensor
    valid_NT: Tensor
    rows_S: Tensor | None = None
    """[S] the batch row each packed position's token comes from (a shared prompt's: its group's first row)."""
    varlen: VarlenIndex | None = None  # built by the first layer that runs the variable-length kernel
    masks: dict[tuple[int, int, int, int | None], Tensor] = field(default_factory=dict)
    """:func:`visible` masks by (query start, queries, keys, window), made once per forward by the first layer."""

    def to(self, device: torch.device) -> PackedLayout:
        return PackedLayout(self.spans, self.index_NT.to(device), self.valid_NT.to(device), self.rows_S)

    def mask(self, start: int, queries: int, keys: int, window: int | None, device: torch.device) -> Tensor:
        """[queries, keys] bool (cached): :func:`visible` for queries at positions ``start..`` over keys at
        positions ``0..keys - 1``."""
        key = (start, queries, keys, window)
        if key not in self.masks:
            self.masks[key] = visible(torch.arange(start, start + queries, device=device),
                                      torch.arange(keys, device=device), window)
        return self.masks[key]


def visible(query_positions: Tensor, key_positions: Tensor, window: int | None) -> Tensor:
    """[q, k] bool: which keys each query attends to, by position: causal (a key at or before the query), and
    within ``window`` tokens of it when the layer slides (transformers' ``kv_idx > q_idx - sliding_window``).
    A shared prompt's completion sees the prompt's positions and then its own, so the same rule serves it."""
    seen = key_positions[None, :] <= query_positions[:, None]
    if window is not None:
        seen &= key_positions[None, :] > query_positions[:, None] - window
    return seen


@dataclass
class VarlenIndex:
    """The layout as one variable-length attention call's segments, in the packed row's order: a single
    sequence is a causal segment over itself; a shared prompt's group is the prompt's segment, then one
    per completion whose keys are the prompt's and its own.

    key_index: [K] the packed position of each key, segment by segment (a prompt's once per completion);
    None where no prompt is shared (the keys are the packed row as it is); cu_q, cu_k: [segments + 1] int32 offsets of each segment's queries (into the packed row) and keys (into
    ``key_index``); max_q, max_k: the longest segment's queries and keys."""

    key_index: Tensor | None
    cu_q: Tensor
    cu_k: Tensor
    max_q: int
    max_k: int

    @classmethod
    def of(cls, layout: PackedLayout, device: torch.device) -> VarlenIndex:
        keys, queries = [], []  # per segment: key positions; query count
        for span in layout.spans:
            if not span.shared:
                length = span.pieces[0]
                keys.append(torch.arange(span.start, span.start + length))
                queries.append(length)
                continue
            prompt = torch.arange(span.start, span.start + span.prompt)
            keys.append(prompt)
            queries.append(span.prompt)
            for offset, m in span.blocks:
                keys.append(torch.cat([prompt, torch.arange(span.start + offset, span.start + offset + m)]))
                queries.append(m)
        lengths = [len(k) for k in keys]
        cu_q = torch.tensor([0] + queries).cumsum(0).to(torch.int32)
        cu_k = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
        shared = any(span.shared for span in layout.spans)
        key_index = torch.cat(keys).to(device) if shared else None
        return cls(key_index, cu_q.to(device), cu_k.to(device), max(queries), max(lengths))


def pack(input_ids: Tensor, attention_mask: Tensor, prompt_width: int, lengths: Tensor,
         owner_n: Tensor | None) -> tuple[Tensor, Tensor, PackedLayout]:
    """A collated micro-batch (left-padded prompts, then completions; ``lengths`` [n] each row's completion
    tokens attention sees) as one packed row: (input_ids [1, S], position_ids [1, S], layout).
    ``owner_n`` [n]: the index of each row's distinct prompt, rows with the same one sharing it; None:
    every row its own prompt."""
    n, width = len(lengths), int(lengths.max())
    owners = owner_n.tolist() if owner_n is not None else list(range(n))
    members: dict[int, list[int]] = {}
    for row, owner in enumerate(owners):
        members.setdefault(owner, []).append(row)
    ids, positions, spans, sources = [], [], [], []
    index = torch.zeros(n, width, dtype=torch.long)
    start = 0
    for rows in members.values():
        first = rows[0]
        prompt = input_ids[first, :prompt_width][attention_mask[first, :prompt_width].bool()]
        p = len(prompt)
        ids.append(prompt)
        positions.append(torch.arange(p))
        sources.append(torch.full((p,), first))
        blocks = []  # each member's completion inputs: (offset in the group, length)
        offset = p
        for row in rows:
            m = int(lengths[row]) - 1  # the last completion token predicts nothing
            ids.append(input_ids[row, prompt_width:prompt_width + m])
            positions.append(torch.arange(p, p + m))
            sources.append(torch.full((m,), row))
            index[row, 0] = start + p - 1  # completion token 0 is predicted by the prompt's last position
            index[row, 1:m + 1] = torch.arange(start + offset, start + offset + m)
            blocks.append((offset, m))
            offset += m
        spans.append(Span(start, p, blocks, shared=len(rows) > 1))
        start += offset
    valid = torch.arange(width)[None, :] < lengths[:, None]
    packed_ids = torch.cat(ids)[None]
    packed_positions = torch.cat(positions)[None]
    return packed_ids, packed_positions, PackedLayout(spans, index, valid, torch.cat(sources))


def sequences_layout(lengths: list[int]) -> PackedLayout:
    """The layout of whole sequences placed one after another (SFT's examples, a reward model's texts): one
    causal span each. It maps no completion tokens (``index_NT`` and ``valid_NT`` are empty)."""
    spans, start = [], 0
    for n in lengths:
        if n:
            spans.append(Span(start, 0, [(0, n)]))
            start += n
    empty = torch.zeros(0, 0, dtype=torch.long)
    return PackedLayout(spans, empty, empty.bool())


def packed_forward(model: nn.Module, input_ids_1S: Tensor, position_ids_1S: Tensor, layout: PackedLayout, **kwargs):
    """``model``'s forward over one packed row [1, S] with the layout its attention follows.

    The attention mask given is all ones: with none, transformers would read the restarting position ids
    as packed sequences and build an ``[S, S]`` mask every forward (a gigabyte at 32K tokens) that the
    packed attention never reads; with no padding in it, the SDPA mask function builds nothing."""
    return model(input_ids=input_ids_1S, position_ids=position_ids_1S, attention_mask=torch.ones_like(input_ids_1S),
                 use_cache=False, posttrain_layout=layout, **kwargs)


def _packed_attention(query: Tensor, key: Tensor, value: Tensor, layout: PackedLayout, scaling: float | None,
                      window: int | None = None, dropout: float = 0.0) -> tuple[Tensor, None]:
    """[1, H, S, d] query, [1, H_kv, S, d] key and value -> [1, S, H, d]: SDPA per piece of the layout, each
    within ``window`` tokens when the layer slides."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    sdpa = functools.partial(torch.nn.functional.scaled_dot_product_attention, scale=scaling, dropout_p=dropout)
    device = query.device
    # one split into every prompt and completion piece: its backward is one concatenation, where a slice per
    # piece would each allocate and fill a gradient of the whole row
    sizes = [size for span in layout.spans for size in span.pieces]
    pieces = zip(query.split(sizes, 2), key.split(sizes, 2), value.split(sizes, 2))
    outputs = []
    for span in layout.spans:
        q, k, v = next(pieces)
        n = q.shape[2]
        if window is None or window >= n:  # causal, and the kernel skips the blocks above the diagonal
            outputs.append(sdpa(q, k, v, is_causal=True))
        else:
            outputs.append(sdpa(q, k, v, attn_mask=layout.mask(0, n, n, window, device)))
        if not span.shared:
            continue
        prompt_keys, prompt_values = k, v
        for _, m in span.blocks:  # each completion: the prompt, then its own tokens
            q, k, v = next(pieces)
            outputs.append(sdpa(q, torch.cat([prompt_keys, k], 2), torch.cat([prompt_values, v], 2),
                                attn_mask=layout.mask(span.prompt, m, span.prompt + m, window, device)))
    return torch.cat(outputs, 2).transpose(1, 2).contiguous(), None


def _packed_eager(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, layout: PackedLayout,
                  **kwargs) -> tuple[Tensor, None]:
    """The model's own eager attention (its module's ``eager_attention_forward``: soft-capping, sinks, whatever
    it computes per query) called once per piece of the layout with that piece's mask, additive as eager
    attention takes it: [1, H, S, d] query, [1, H_kv, S, d] key and value -> [1, S, H, d]."""
    eager = eager_attention_of(module)
    window = kwargs.get("sliding_window")
    device, lowest = query.device, torch.finfo(query.dtype).min
    sizes = [size for span in layout.spans for size in span.pieces]
    pieces = zip(query.split(sizes, 2), key.split(sizes, 2), value.split(sizes, 2))

    def attend(q: Tensor, k: Tensor, v: Tensor, start: int) -> Tensor:
        seen = layout.mask(start, q.shape[2], k.shape[2], window, device)
        additive = torch.zeros(seen.shape, dtype=query.dtype, device=device).masked_fill_(~seen, lowest)
        return eager(module, q, k, v, additive[None, None], **kwargs)[0]

    outputs = []
    for span in layout.spans:
        q, k, v = next(pieces)
        outputs.append(attend(q, k, v, 0))
        if not span.shared:
            continue
        prompt_keys, prompt_values = k, v
        for _ in span.blocks:
            q, k, v = next(pieces)
            outputs.append(attend(q, torch.cat([prompt_keys, k], 2), torch.cat([prompt_values, v], 2), span.prompt))
    return torch.cat(outputs, 1), None


def eager_attention_of(module: nn.Module):
    """The eager attention function of ``module``'s own modeling file: transformers writes one per family, with
    what the family computes besides dot products (Gemma 2's soft-capping, gpt-oss's sinks)."""
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise RuntimeError(f"packed attention: {type(module).__module__} defines no eager_attention_forward for "
                           f"{type(module).__name__}; train with --no-trim-padding")
    return eager


def varlen_kernel(query: Tensor):
    """The variable-length attention kernel for ``query``'s device and dtype: PyTorch's FlashAttention
    ``varlen_attn`` on a CUDA GPU in float16 or bfloat16 (FlashAttention's dtypes), else None (the per-group
    SDPA calls of :func:`_packed_attention`; no CPU kernel takes variable-length batches)."""
    if not query.is_cuda or query.dtype not in (torch.float16, torch.bfloat16):
        return None
    if torch.cuda.get_device_capability(query.device)[0] < 8:  # FlashAttention 2 needs Ampere or newer
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # before PyTorch 2.10
        return None
    return varlen_attn if _varlen_signature_reason(varlen_attn) is None else None


@functools.cache
def _varlen_signature_reason(kernel) -> str | None:
    """Why ``kernel`` (this PyTorch's ``varlen_attn``) is not called (None: it is): the packed attention passes
    ``scale``, ``window_size`` and ``enable_gqa``, as PyTorch 2.13's takes them; another signature is said once
    and the per-sequence SDPA calls run instead."""
    import inspect
    import logging

    missing = {"scale", "window_size", "enable_gqa"} - set(inspect.signature(kernel).parameters)
    if not missing:
        return None
    reason = (f"torch {torch.__version__}'s varlen_attn takes no {', '.join(sorted(missing))} (PyTorch 2.13's does); "
              "packed passes run one SDPA call per sequence instead")
    logging.getLogger(__name__).warning("packed attention: %s", reason)
    return reason


def _varlen_attention(query: Tensor, key: Tensor, value: Tensor, layout: PackedLayout, scaling: float | None,
                      kernel, window: int | None = None) -> tuple[Tensor, None]:
    """[1, H, S, d] query, [1, H_kv, S, d] key and value -> [1, S, H, d]: the layout's attention in one
    variable-length call (:class:`VarlenIndex`). Causality is FlashAttention's bottom-right alignment
    (``window_size=(left, 0)``): a completion's query ``i`` of ``m`` sees its ``P + m`` keys up to ``P + i``,
    the whole prompt and its own earlier tokens; a sliding layer's ``left`` is ``window - 1``, the keys
    before the query's own that transformers' window keeps."""
    if layout.varlen is None:
        layout.varlen = VarlenIndex.of(layout, query.device)
    v = layout.varlen
    q, k, val = (t[0].transpose(0, 1) for t in (query, key, value))  # [S, H, d], [S, H_kv, d]
    if v.key_index is not None:  # a shared prompt's keys again for each of its completions: [K, H_kv, d]
        k, val = k[v.key_index], val[v.key_index]
    left = -1 if window is None else window - 1
    out = kernel(q, k, val, v.cu_q, v.cu_k, v.max_q, v.max_k, scale=scaling, window_size=(left, 0),
                 enable_gqa=query.shape[1] != key.shape[1])
    return out[None], None


SDPA_KWARGS = frozenset({"dropout", "scaling", "sliding_window", "position_ids", "use_cache", "output_attentions",
                         "output_hidden_states", "output_router_logits", "is_causal"})
"""What the packed SDPA attention reads or may ignore of the keyword arguments a layer passes its attention:
anything else would change what SDPA computes (:func:`_sdpa_arguments`)."""


def _sdpa_arguments(module: nn.Module, kwargs: dict) -> tuple[float | None, int | None, float]:
    """(scaling, window, dropout) of a layer's call; an error naming an argument the packed SDPA attention
    cannot honour (a relative position bias, a non-causal layer), so that nothing is silently dropped."""
    extra = {k for k, v in kwargs.items() if k not in SDPA_KWARGS and v is not None and v is not False}
    if extra or kwargs.get("is_causal") is False or not getattr(module, "is_causal", True):
        what = ", ".join(sorted(extra)) or "a non-causal layer"
        raise RuntimeError(f"packed attention: {type(module).__name__} passes its attention {what}, which the "
                           "packed attention does not compute; train with --no-trim-padding")
    return kwargs.get("scaling"), kwargs.get("sliding_window"), kwargs.get("dropout") or 0.0


def _attention(unpacked: str):
    """An attention function for transformers: with a layout (``posttrain_layout``) the packed attention,
    otherwise the implementation ``unpacked`` names (``sdpa``, ``sdpa_float32`` or ``eager``), as the model
    would run it."""

    def attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                  **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        layout = kwargs.pop("posttrain_layout", None)
        if unpacked == "eager":
            if layout is not None:
                return _packed_eager(module, query, key, value, layout, **kwargs)
            return eager_attention_of(module)(module, query, key, value, attention_mask, **kwargs)
        if unpacked == "sdpa_float32":
            with torch.autocast(query.device.type, enabled=False):
                query, key, value = query.float(), key.float(), value.float()
                if layout is not None:
                    return _packed_attention(query, key, value, layout, *_sdpa_arguments(module, kwargs))
                return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        if layout is None:
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        scaling, window, dropout = _sdpa_arguments(module, kwargs)
        kernel = None if dropout else varlen_kernel(query)
        if kernel is not None:
            return _varlen_attention(query, key, value, layout, scaling, kernel, window)
        return _packed_attention(query, key, value, layout, scaling, window, dropout)

    return attention


def register_packed_attention() -> None:
    """Register :data:`PACKED` implementations with transformers (idempotent), each with the masks its unpacked
    form gets."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    for unpacked, name in PACKED.items():
        AttentionInterface.register(name, _attention("sdpa_float32" if unpacked == FLOAT32 else unpacked))
        AttentionMaskInterface.register(name, eager_mask if unpacked == "eager" else sdpa_mask)


def has_packed_attention(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) in PACKED.values()
