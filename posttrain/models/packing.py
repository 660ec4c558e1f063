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

The attention function is registered with transformers under :data:`PACKED_SDPA` (and its float32 form
for CPU mixed precision) and dispatches on its keyword argument: a forward without a layout runs
transformers' SDPA as before, so generation, evaluation and the reference pass are unchanged, and a
recomputed (gradient-checkpointed) layer gets its layout again from the saved arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

PACKED_SDPA = "posttrain_packed_sdpa"
PACKED_SDPA_FLOAT32 = "posttrain_packed_sdpa_float32"
"""transformers' SDPA attention, or with a layout the packed attention; the ``_float32`` one computes
attention in float32 with autocast off (what :data:`posttrain.models.modeling.FLOAT32_SDPA` does on a CPU
under mixed precision)."""


@dataclass
class Span:
    """One group in the packed row: ``[start, start + prompt)`` its prompt, then its members' completion
    inputs at ``blocks`` (offset from ``start``, length); a single sequence when it has one member."""

    start: int
    prompt: int
    blocks: list[tuple[int, int]]
    masks: list[Tensor] | None = None  # per block [m, prompt + m] bool: the whole prompt, then causal

    @property
    def pieces(self) -> list[int]:
        """The lengths the attention splits this span into: the whole (one sequence), or the prompt and
        each completion."""
        if self.masks is None:
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
    varlen: VarlenIndex | None = None  # built by the first layer that runs the variable-length kernel

    def to(self, device: torch.device) -> PackedLayout:
        spans = [Span(s.start, s.prompt, s.blocks, None if s.masks is None else [m.to(device) for m in s.masks])
                 for s in self.spans]
        return PackedLayout(spans, self.index_NT.to(device), self.valid_NT.to(device))


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
            if span.masks is None:
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
        shared = any(span.masks is not None for span in layout.spans)
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
    ids, positions, spans = [], [], []
    index = torch.zeros(n, width, dtype=torch.long)
    start = 0
    for rows in members.values():
        first = rows[0]
        prompt = input_ids[first, :prompt_width][attention_mask[first, :prompt_width].bool()]
        p = len(prompt)
        ids.append(prompt)
        positions.append(torch.arange(p))
        blocks = []  # each member's completion inputs: (offset in the group, length)
        offset = p
        for row in rows:
            m = int(lengths[row]) - 1  # the last completion token predicts nothing
            ids.append(input_ids[row, prompt_width:prompt_width + m])
            positions.append(torch.arange(p, p + m))
            index[row, 0] = start + p - 1  # completion token 0 is predicted by the prompt's last position
            index[row, 1:m + 1] = torch.arange(start + offset, start + offset + m)
            blocks.append((offset, m))
            offset += m
        masks = None
        if len(rows) > 1:  # a completion sees the whole prompt and its own earlier tokens
            masks = [torch.cat([torch.ones(m, p, dtype=torch.bool), torch.ones(m, m, dtype=torch.bool).tril()], 1)
                     for _, m in blocks]
        spans.append(Span(start, p, blocks, masks))
        start += offset
    valid = torch.arange(width)[None, :] < lengths[:, None]
    packed_ids = torch.cat(ids)[None]
    packed_positions = torch.cat(positions)[None]
    return packed_ids, packed_positions, PackedLayout(spans, index, valid)


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


def packed_hidden(body: nn.Module, input_ids: Tensor, attention_mask: Tensor, prompt_width: int, lengths: Tensor,
                  owner_n: Tensor | None, width: int) -> Tensor:
    """[n, width, D] the final hidden states predicting each completion token, from one packed pass of
    ``body`` (a decoder stack whose attention is :data:`PACKED_SDPA`); zero past a row's last token."""
    device = input_ids.device
    ids, positions, layout = pack(input_ids.cpu(), attention_mask.cpu(), prompt_width, lengths.cpu(),
                                  None if owner_n is None else owner_n.cpu())
    hidden_SD = packed_forward(body, ids.to(device), positions.to(device), layout.to(device)).last_hidden_state[0]
    index, valid = layout.index_NT.to(device), layout.valid_NT.to(device)
    out = hidden_SD.index_select(0, index.view(-1)).view(*index.shape, -1) * valid[..., None]
    return torch.nn.functional.pad(out, (0, 0, 0, width - out.shape[1]))


def _packed_attention(query: Tensor, key: Tensor, value: Tensor, layout: PackedLayout,
                      scaling: float | None) -> tuple[Tensor, None]:
    """[1, H, S, d] query, [1, H_kv, S, d] key and value -> [1, S, H, d]: SDPA per group of the layout."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    # one split into every prompt and completion piece: its backward is one concatenation, where a slice per
    # piece would each allocate and fill a gradient of the whole row
    sizes = [size for span in layout.spans for size in span.pieces]
    pieces = zip(query.split(sizes, 2), key.split(sizes, 2), value.split(sizes, 2))
    outputs = []
    for span in layout.spans:
        q, k, v = next(pieces)
        if span.masks is None:  # one sequence: causal, and the kernel skips the blocks above the diagonal
            outputs.append(sdpa(q, k, v, is_causal=True, scale=scaling))
            continue
        prompt_keys, prompt_values = k, v
        outputs.append(sdpa(q, k, v, is_causal=True, scale=scaling))
        for mask in span.masks:  # each completion: the prompt, then its own tokens
            q, k, v = next(pieces)
            outputs.append(sdpa(q, torch.cat([prompt_keys, k], 2), torch.cat([prompt_values, v], 2), attn_mask=mask,
                                scale=scaling))
    return torch.cat(outputs, 2).transpose(1, 2).contiguous(), None


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
    return varlen_attn


def _varlen_attention(query: Tensor, key: Tensor, value: Tensor, layout: PackedLayout, scaling: float | None,
                      kernel) -> tuple[Tensor, None]:
    """[1, H, S, d] query, [1, H_kv, S, d] key and value -> [1, S, H, d]: the layout's attention in one
    variable-length call (:class:`VarlenIndex`). Causality is FlashAttention's bottom-right alignment
    (``window_size=(-1, 0)``): a completion's query ``i`` of ``m`` sees its ``P + m`` keys up to ``P + i``,
    the whole prompt and its own earlier tokens."""
    if layout.varlen is None:
        layout.varlen = VarlenIndex.of(layout, query.device)
    v = layout.varlen
    q, k, val = (t[0].transpose(0, 1) for t in (query, key, value))  # [S, H, d], [S, H_kv, d]
    if v.key_index is not None:  # a shared prompt's keys again for each of its completions: [K, H_kv, d]
        k, val = k[v.key_index], val[v.key_index]
    out = kernel(q, k, val, v.cu_q, v.cu_k, v.max_q, v.max_k, scale=scaling, window_size=(-1, 0),
                 enable_gqa=query.shape[1] != key.shape[1])
    return out[None], None


def _packed_or_varlen(query: Tensor, key: Tensor, value: Tensor, layout: PackedLayout,
                      scaling: float | None) -> tuple[Tensor, None]:
    kernel = varlen_kernel(query)
    if kernel is not None:
        return _varlen_attention(query, key, value, layout, scaling, kernel)
    return _packed_attention(query, key, value, layout, scaling)


def _attention(in_float32: bool):
    def attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                  **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        layout = kwargs.pop("posttrain_layout", None)
        if not in_float32:
            if layout is not None:
                return _packed_or_varlen(query, key, value, layout, kwargs.get("scaling"))
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        with torch.autocast(query.device.type, enabled=False):
            query, key, value = query.float(), key.float(), value.float()
            if layout is not None:
                return _packed_attention(query, key, value, layout, kwargs.get("scaling"))
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    return attention


def register_packed_attention() -> None:
    """Register :data:`PACKED_SDPA` and :data:`PACKED_SDPA_FLOAT32` with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PACKED_SDPA, _attention(in_float32=False))
    AttentionInterface.register(PACKED_SDPA_FLOAT32, _attention(in_float32=True))
    for name in (PACKED_SDPA, PACKED_SDPA_FLOAT32):
        AttentionMaskInterface.register(name, sdpa_mask)  # the masks "sdpa" gets, for unpacked passes


def has_packed_attention(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) in (PACKED_SDPA, PACKED_SDPA_FLOAT32)
