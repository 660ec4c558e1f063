"""Models: loading, the training-time batch layout, and per-token log-probs.

Training batches are laid out as ``[prompt (left-padded) | completion (right-padded)]``
so that completion token ``t`` of every row sits at the same column ``P + t``;
the logits that predict it are at column ``P + t - 1``. Padding is trimmed to the
longest sequence of each micro-batch.

The passes themselves (:func:`completion_outputs`) are the same for every model: one packed row where the
model allows it (:mod:`posttrain.models.packing`), else rows grouped by length or a shared prompt's cache,
else the padded batch. What is read from them depends on the head. For the families whose logits are
exactly their LM head's output (:func:`split_head`; LoRA-wrapped or not), the head is folded into the
log-softmax (:func:`posttrain.functional.linear_log_softmax`): only the completion's real tokens go through
it, a block of vocabulary at a time, and no ``[n, T, V]`` logits tensor exists (on SmolLM2 that is 100 MB of
logits and as much of their gradient per 16 x 32 tokens). Other models (soft-capped or scaled logits) run
their own forward, head included, with ``logits_to_keep`` at the predicting positions only.
:func:`posttrain.models.architecture` says which model takes which path, and why.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any
from dataclasses import dataclass

import torch
from torch import Tensor, nn

import posttrain.functional as F
from posttrain.models.architecture import (cache_unsupported_reason, head_unsupported_reason,
                                           unwrapped)
from posttrain.models.experts import RouterStats, RouterTrace, RoutingReplay, experts_per_token, routers
from posttrain.models.compute import is_checkpointed
from posttrain.models.packing import has_packed_attention, pack
from posttrain.models.vision import batch_image_inputs, generated_token_type, is_vision_model, vision_outputs

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda but no CUDA GPU is available; use --device cpu")
    return torch.device(device)


def left_pad(sequences: list[Tensor], pad_id: int) -> tuple[Tensor, Tensor]:
    """Left-pad 1-D token tensors: ([n, L] ids, [n, L] attention mask)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        if len(seq):
            ids[row, width - len(seq):] = seq
            attention[row, width - len(seq):] = 1
    return ids, attention


def right_pad(sequences: list[Tensor], pad_id: int) -> tuple[Tensor, Tensor]:
    """Right-pad 1-D token tensors: ([n, L] ids, [n, L] attention mask of 1 for real tokens), L the longest."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, :len(seq)] = seq
        attention[row, :len(seq)] = 1
    return ids, attention


def frozen_copy(model: nn.Module) -> nn.Module:
    """A reference model: an independent copy with no gradients, in eval mode."""
    import copy

    ref = copy.deepcopy(model).eval()
    ref.requires_grad_(False)
    return ref


class ValueHead(nn.Module):
    """PPO's critic: a linear head on the policy's last hidden state (shared backbone)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.linear(hidden).squeeze(-1)


@dataclass
class TokenBatch:
    """A micro-batch ready for the model.

    input_ids, attention_mask, position_ids: [n, P + T]
    completion_ids, mask: [n, T] (T trimmed to this micro-batch's longest completion)
    first_U: [U] the first row of each distinct prompt, owner_n: [n] each row's index into first_U;
    both None unless rows share prompts enough to be worth it (:func:`worth_sharing`).
    trim_padding: run rows grouped by completion length, each group trimmed to its longest
    (:func:`completion_hidden`); False: one pass over the whole padded micro-batch.
    """

    input_ids: Tensor
    attention_mask: Tensor
    position_ids: Tensor
    completion_ids: Tensor
    mask: Tensor
    first_U: Tensor | None = None
    owner_n: Tensor | None = None
    trim_padding: bool = True
    routing: Tensor | None = None
    """[n, L, S, k] a mixture of experts' routing of each row as it was sampled, to replay (routing replay):
    row n's token at sequence position s (prompt then completion, as position_ids count) went to experts
    ``routing[n, l, s]`` in layer l. None: the routers choose."""
    images: list[dict[str, Tensor]] | None = None
    """Each row's image inputs for a vision-language model, as its processor gave them for the row's prompt
    (:func:`posttrain.data.images.encode_image_prompt`); None: no images."""

    @property
    def prompt_width(self) -> int:
        return self.input_ids.shape[1] - self.completion_ids.shape[1]


def collate(prompt_ids: list[Tensor], completion_ids: Tensor, mask: Tensor, pad_id: int, device: torch.device,
            present: Tensor | None = None, *, share_prompts: bool = True, trim_padding: bool = True,
            routing: Tensor | None = None, images: list[dict[str, Tensor]] | None = None) -> TokenBatch:
    """Concatenate left-padded prompts with right-padded completions (trimmed to the longest), and
    note which rows share a prompt (a GRPO group's samples, a preference pair's two answers).

    ``mask`` [n, T] marks the tokens scored (the policy's); ``present`` [n, T] every token attention sees,
    inserted ones included (multi-turn episodes; default: ``mask``). ``share_prompts`` and ``trim_padding``
    False give the padded reference path (the ``share_prompts`` and ``trim_padding`` settings). ``images``: each
    row's image inputs (a vision-language model's)."""
    present = mask if present is None else present
    width = max(int(present.sum(-1).max()), 1)
    completion_ids, mask, present = completion_ids[:, :width], mask[:, :width], present[:, :width]
    prompts, prompt_attention = left_pad(prompt_ids, pad_id)
    input_ids = torch.cat([prompts, completion_ids], 1)
    attention = torch.cat([prompt_attention, present.long()], 1)
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    index: dict[tuple[int, ...], int] = {}
    owner = [index.setdefault(tuple(p.tolist()), len(index)) for p in prompt_ids]
    shared = None, None
    if share_prompts and len(index) < len(prompt_ids) and worth_sharing(len(prompt_ids), len(index),
                                                                         prompts.shape[1], width):
        first_row: dict[int, int] = {}
        for row, o in enumerate(owner):
            first_row.setdefault(o, row)
        shared = torch.tensor([first_row[o] for o in range(len(index))]), torch.tensor(owner)
    tensors = (input_ids, attention, position_ids, completion_ids, mask, *shared)
    return TokenBatch(*(None if t is None else t.to(device) for t in tensors), trim_padding=trim_padding,
                      routing=routing, images=images)


def worth_sharing(rows: int, prompts: int, prompt_width: int, completion_width: int) -> bool:
    """Whether running ``prompts`` distinct prompts once beats running all ``rows`` whole.

    Sharing saves ``(rows - prompts) * prompt_width`` token positions but costs a second pass through
    the layers, gathering the cached keys and values, and GEMMs with fewer rows. It pays when it saves
    many positions (long prompts, many rows per prompt) and costs time when it saves few (a DPO step's
    two rows per short prompt), so it is done only when it saves at least 128 positions and a tenth
    of the micro-batch's. Measurements: benchmarks/RESULTS.md.
    """
    saved = (rows - prompts) * prompt_width
    return saved >= max(128, 0.1 * rows * (prompt_width + completion_width))


BUCKET_COST = 32
"""What one more pass through the layers costs, in token positions, when :func:`length_buckets` weighs
splitting a micro-batch by completion length: a pass's fixed cost (kernel launches for every layer,
forward and backward) is a few positions' worth on a 135M model, and smaller GEMMs run slower, so a
split must save more than this. Measurements: benchmarks/RESULTS.md, "The step's padding"."""


def length_buckets(lengths: list[int], cost: int = BUCKET_COST) -> list[list[int]]:
    """Rows grouped by length so that each group pads only to its own longest row.

    Minimises ``sum over groups of (rows x longest) + cost x groups`` over contiguous runs of the rows
    sorted by length (dynamic programming, O(n^2)). Returns the row indices of each group, shortest
    rows first; one group holding every row (in order) when splitting saves nothing.
    """
    order = sorted(range(len(lengths)), key=lambda r: lengths[r])
    sorted_lengths = [lengths[r] for r in order]
    n = len(order)
    best = [0] + [None] * n  # best[j]: the cheapest split of the j shortest rows
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):  # the last group is rows i..j-1, padded to sorted_lengths[j - 1]
            total = best[i] + (j - i) * sorted_lengths[j - 1] + cost
            if best[j] is None or total < best[j]:
                best[j], cut[j] = total, i
    groups, j = [], n
    while j > 0:
        groups.append(order[cut[j]:j])
        j = cut[j]
    if len(groups) == 1:
        return [list(range(n))]
    return groups[::-1]


@dataclass(frozen=True)
class Reader:
    """What a pass reads of the module it runs: a decoder stack's final hidden states (``logits`` False), or a
    causal LM's logits, its own head applied only at the positions asked for; with ``hidden`` also the final
    hidden states there (a value head's input)."""

    logits: bool = False
    hidden: bool = False
    replay: RoutingReplay | None = None
    """Routing replay: each pass's routers take the experts ``replay_routing`` [n, L, S, k] holds for its tokens."""
    replay_routing: Tensor | None = None

    def __call__(self, module: nn.Module, keep: int | Tensor, *, rows: Tensor, **inputs) -> tuple[Tensor, Tensor | None, object]:
        """(outputs [B, K, X] at ``keep``: the last ``keep`` positions or those indexed; hidden states there or
        None; the pass's cache when it made one). ``rows``: the batch row of each input (``[B]``, or ``[1, S]``
        for a packed row), for routing replay."""
        if self.replay is not None:
            self.replay.set_pass(*replayed(self.replay_routing, rows, inputs["position_ids"], inputs["attention_mask"]))
        pick = slice(-keep, None) if isinstance(keep, int) else keep
        if not self.logits:
            out = module(**inputs)
            return out.last_hidden_state[:, pick], None, out.get("cache")
        out = module(**inputs, logits_to_keep=keep, output_hidden_states=self.hidden)
        return out.logits, out.hidden_states[-1][:, pick] if self.hidden else None, out.get("cache")


def replayed(routing_NLSK: Tensor, rows: Tensor, positions_BS: Tensor, attention_BX: Tensor) -> tuple[Tensor, Tensor]:
    """A pass's replayed routing: (chosen [L, B*S, k] for its tokens in order, replaced [B*S] bool: the real ones).
    ``rows`` [B] (each input row's batch row) or [B, S] (a packed row's); ``positions_BS`` the inputs' position
    ids, which count a row's sequence as its routing does; ``attention_BX`` their mask (its last S columns)."""
    rows_BS = rows[:, None].expand(positions_BS.shape) if rows.dim() == 1 else rows
    at = positions_BS.clamp(0, routing_NLSK.shape[2] - 1).flatten().cpu()
    chosen_TLK = routing_NLSK[rows_BS.flatten().cpu(), :, at]
    return chosen_TLK.transpose(0, 1), attention_BX[:, -positions_BS.shape[1]:].flatten().bool()


def completion_outputs(module: nn.Module, batch: TokenBatch, read: Reader = Reader()) -> tuple[Tensor, Tensor | None]:
    """[n, T, X] what ``read`` reads at the positions that predict each completion token (position P + t - 1 for
    token t), zero past a row's last completion token; with it, the hidden states there when ``read`` asks.

    The last column (position P + T - 1) predicts nothing, so it never enters the layers: under causal
    attention no other position depends on it. With the packed attention the micro-batch is one row with no
    padding at all (:mod:`posttrain.models.packing`). Otherwise rows are grouped by completion length
    (:func:`length_buckets`) and each group runs trimmed to its own longest row: a completion's positions
    attend only to earlier ones, so trimming another row's padding changes no real position.

    When rows share a prompt and the packed attention is not there, the distinct prompts run once (keeping
    their keys and values, with gradient) and each row's completion runs on its prompt's cache: the prompt's
    share of the work is done once per prompt instead of once per row. The result is the same computation
    (equal to float32 rounding, tested); for a GRPO group of G samples the prompt tokens cost 1/G.
    """
    n, width = batch.completion_ids.shape
    p = batch.prompt_width
    present = batch.attention_mask[:, p:]
    lengths = (present * torch.arange(1, width + 1, device=present.device)).amax(-1).clamp(min=1)  # last present + 1
    if batch.trim_padding and has_packed_attention(unwrapped(module)) and bool((present.sum(-1) == lengths).all()):
        return _packed_outputs(module, batch, lengths, read)
    groups = length_buckets(lengths.tolist(), BUCKET_COST) if batch.trim_padding else [list(range(n))]
    # a row's last token predicts nothing: masked, so that no path computes it for anything (a mixture of
    # experts' routing counts the tokens a pass computes; nothing real comes after it, so no log-prob changes)
    computed = batch.attention_mask.clone()
    computed[torch.arange(n, device=computed.device), p + lengths - 1] = 0
    recomputed = torch.is_grad_enabled() and is_checkpointed(module)  # a prompt pass would write its cache twice
    shared = not (batch.first_U is None or batch.owner_n is None or recomputed
                  or cache_unsupported_reason(module) is not None)  # full-attention layers only
    if shared:
        first = batch.first_U
        prompt = read(module, 1, rows=first, input_ids=batch.input_ids[first, :p],
                      attention_mask=batch.attention_mask[first, :p], position_ids=batch.position_ids[first, :p],
                      use_cache=True)
    parts, hidden_parts = [], []
    for group in groups:
        rows = torch.tensor(group, device=batch.input_ids.device)
        w = int(lengths[rows].max()) if batch.trim_padding else width
        if shared:
            out, hidden = _completion_on_prompt_cache(module, batch, computed, prompt, rows, w, read)
        else:
            out, hidden, _ = read(module, w, rows=rows, input_ids=batch.input_ids[rows, :p + w - 1],
                                  attention_mask=computed[rows, :p + w - 1],
                                  position_ids=batch.position_ids[rows, :p + w - 1], use_cache=False)
        parts.append(out)
        hidden_parts.append(hidden)
    return _in_row_order(parts, groups, width), None if not read.hidden else _in_row_order(hidden_parts, groups, width)


def _in_row_order(parts: list[Tensor], groups: list[list[int]], width: int) -> Tensor:
    """The groups' outputs [rows of the group, w, X] as one [n, width, X] tensor in row order, zero-padded."""
    if len(parts) == 1:
        return torch.nn.functional.pad(parts[0], (0, 0, 0, width - parts[0].shape[1]))
    order = torch.tensor([r for group in groups for r in group], device=parts[0].device)
    padded = torch.cat([torch.nn.functional.pad(part, (0, 0, 0, width - part.shape[1])) for part in parts])
    return padded.index_select(0, torch.argsort(order))


def _packed_outputs(module: nn.Module, batch: TokenBatch, lengths: Tensor, read: Reader) -> tuple[Tensor, Tensor | None]:
    """:func:`completion_outputs` from one packed pass of ``module`` (its attention :data:`PACKED`)."""
    device = batch.input_ids.device
    ids, positions, layout = pack(batch.input_ids.cpu(), batch.attention_mask.cpu(), batch.prompt_width,
                                  lengths.cpu(), None if batch.owner_n is None else batch.owner_n.cpu())
    valid_NT = layout.valid_NT.to(device)
    keep_K = layout.index_NT.to(device)[valid_NT]  # the predicting positions, row by row
    ids = ids.to(device)
    out_1KX, hidden_1KD, _ = read(module, keep_K, rows=layout.rows_S[None], input_ids=ids,
                                  position_ids=positions.to(device), attention_mask=torch.ones_like(ids), use_cache=False,
                                  posttrain_layout=layout.to(device))

    def scattered(values_1KX: Tensor) -> Tensor:  # [n, T, X], zero where no token is predicted
        rows = valid_NT.view(-1).nonzero()[:, 0]
        flat = values_1KX.new_zeros(valid_NT.numel(), values_1KX.shape[-1]).index_copy(0, rows, values_1KX[0])
        return flat.view(*valid_NT.shape, -1)

    width = batch.completion_ids.shape[1]
    out = torch.nn.functional.pad(scattered(out_1KX), (0, 0, 0, width - valid_NT.shape[1]))
    if hidden_1KD is None:
        return out, None
    return out, torch.nn.functional.pad(scattered(hidden_1KD), (0, 0, 0, width - valid_NT.shape[1]))


def _completion_on_prompt_cache(module: nn.Module, batch: TokenBatch, computed: Tensor, prompt, rows: Tensor,
                                width: int, read: Reader) -> tuple[Tensor, Tensor | None]:
    """[len(rows), width, X]: what ``read`` reads at the positions predicting the first ``width`` completion
    tokens of ``rows``, each row's completion run on its prompt's keys and values (``prompt``: the distinct
    prompts' pass, as ``read`` returned it; ``computed``: the batch's attention mask without each row's last
    token)."""
    from transformers.cache_utils import DynamicCache

    first_out, first_hidden, prompt_cache = prompt
    owner = batch.owner_n.index_select(0, rows)
    cache = DynamicCache()
    for i, layer in enumerate(prompt_cache.layers):
        # index_select, not indexing: its backward is index_add_, far cheaper than indexing's
        # (index_put_ with accumulate) on a training step (benchmarks/RESULTS.md)
        cache.update(layer.keys.index_select(0, owner), layer.values.index_select(0, owner), i)
    first_token = first_out.index_select(0, owner)  # the prompt's last position predicts completion token 0
    first_hidden = None if first_hidden is None else first_hidden.index_select(0, owner)
    if width == 1:
        return first_token, first_hidden
    p = batch.prompt_width
    out, hidden, _ = read(module, width - 1, rows=rows, input_ids=batch.input_ids[rows, p:p + width - 1],
                          attention_mask=computed[rows, :p + width - 1],
                          position_ids=batch.position_ids[rows, p:p + width - 1], cache=cache, use_cache=True)
    return torch.cat([first_token, out], 1), None if hidden is None else torch.cat([first_hidden, hidden], 1)


def completion_hidden(body: nn.Module, batch: TokenBatch, read: Reader = Reader()) -> Tensor:
    """[n, T, D] the decoder stack ``body``'s final hidden states at the positions predicting each completion
    token (:func:`completion_outputs`)."""
    return completion_outputs(body, batch, read)[0]


@dataclass
class ForwardOutput:
    logprobs: Tensor  # [n, T]
    entropy: Tensor | None  # [n, T]; differentiable from the fused head, or with entropy_grad
    values: Tensor | None  # [n, T]
    router: RouterStats | None = None  # a mixture of experts' routing, in a pass with gradient


class AdaptersDisabled:
    """The base model under a LoRA policy, as a reference model: the shared network with the adapters off, in
    eval mode (no dropout) and without gradient. :func:`forward` runs the policy's own passes inside
    :meth:`off` (packed rows, the folded head: a reference pass costs what a policy pass costs, and holds no
    [n, T, V] logits); ``ref(**inputs)`` calls the network's forward the same way.

    Not an ``nn.Module`` on purpose: ``ref.eval()``, ``ref.requires_grad_(False)`` or an optimizer
    over ``ref.parameters()`` must not reach the policy's weights through it.
    """

    def __init__(self, model: nn.Module):
        self.model = model

    @contextmanager
    def off(self) -> Iterator[nn.Module]:
        """The policy's network, its adapters off, in eval mode and without gradient, for the block's span."""
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), self.model.disable_adapter():
                yield self.model
        finally:
            self.model.train(was_training)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.off() as model:
            return model(*args, **kwargs)

    def parameters(self) -> Iterator[nn.Parameter]:
        """The shared network's parameters (read for the device only)."""
        return self.model.parameters()

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def config(self) -> Any:
        """The shared network's config: what the training passes read of the model (its attention, its layers)."""
        return self.model.config


def split_head(model: nn.Module) -> tuple[nn.Module, nn.Linear] | None:
    """``(body, lm_head)`` of a model whose logits are exactly ``lm_head(body(...).last_hidden_state)``
    (:func:`posttrain.models.architecture.head_unsupported_reason`); None for any other."""
    if head_unsupported_reason(model) is not None:
        return None
    base = unwrapped(model)
    return base.model, base.lm_head


def forward(
    model: nn.Module,
    batch: TokenBatch,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    value_head: ValueHead | None = None,
    entropy_grad: bool = False,
) -> ForwardOutput:
    """Per-token log-probs of the completion under ``model`` (sampling temperature applied); 0 at padding.
    ``entropy_grad``: the entropies carry a gradient on every path (an entropy bonus trains on them; the
    unfused path then holds the [n, T, V] log-softmax for the backward). A mixture of experts' routing comes
    with it in a pass with gradient (:mod:`posttrain.models.experts`)."""
    if isinstance(model, AdaptersDisabled):  # a LoRA policy's base model: the policy's passes, adapters off
        with model.off() as network:
            return forward(network, batch, temperature=temperature, with_entropy=with_entropy, value_head=value_head,
                           entropy_grad=entropy_grad)
    traced = torch.is_grad_enabled() and bool(routers(model))
    with RoutingReplay(model) if batch.routing is not None else nullcontext() as replay:
        if not traced:
            return _forward(model, batch, temperature, with_entropy, value_head, entropy_grad, replay)
        with RouterTrace(model) as trace:
            out = _forward(model, batch, temperature, with_entropy, value_head, entropy_grad, replay)
    out.router = trace.stats(experts_per_token(model))
    return out


def _forward(model: nn.Module, batch: TokenBatch, temperature: float, with_entropy: bool,
             value_head: ValueHead | None, entropy_grad: bool, replay: RoutingReplay | None) -> ForwardOutput:
    replaying = dict(replay=replay, replay_routing=batch.routing)
    if is_vision_model(model):  # its own forward, the rows' images batched as its processor batches them
        logits, hidden = _vision_outputs(model, batch, hidden=value_head is not None)
        return _from_logits(logits, hidden, batch, temperature, with_entropy, value_head, entropy_grad)
    parts = split_head(model)
    if parts is not None:
        body, head = parts
        hidden_NTD = completion_hidden(body, batch, Reader(**replaying))
        scored_NT = batch.mask.bool()
        logprobs_M, entropy_M = F.linear_log_softmax(
            hidden_NTD[scored_NT].to(head.weight.dtype), head.weight, batch.completion_ids[scored_NT], bias=head.bias,
            temperature=temperature, with_entropy=with_entropy)
        zeros_NT = logprobs_M.new_zeros(scored_NT.shape)
        entropy = zeros_NT.masked_scatter(scored_NT, entropy_M) if with_entropy else None
        values = value_head(hidden_NTD.to(value_head.linear.weight.dtype)) if value_head is not None else None
        return ForwardOutput(zeros_NT.masked_scatter(scored_NT, logprobs_M), entropy, values)
    logits, hidden = completion_outputs(model, batch, Reader(logits=True, hidden=value_head is not None, **replaying))
    return _from_logits(logits, hidden, batch, temperature, with_entropy, value_head, entropy_grad)


def _vision_outputs(model: nn.Module, batch: TokenBatch, hidden: bool) -> tuple[Tensor, Tensor | None]:
    p, (n, width) = batch.prompt_width, batch.input_ids.shape
    images = batch_image_inputs(batch.images or [{}] * n, batch.attention_mask[:, :p].sum(-1).tolist(), p, width,
                                completion_type=generated_token_type(model))
    return vision_outputs(model, batch.input_ids, batch.attention_mask, batch.completion_ids.shape[1], images, hidden)


def _from_logits(logits: Tensor, hidden: Tensor | None, batch: TokenBatch, temperature: float, with_entropy: bool,
                 value_head: ValueHead | None, entropy_grad: bool) -> ForwardOutput:
    """The completion tokens' log-probs (entropies, values) from the logits [n, T, V] that predict them."""
    if temperature != 1.0:
        logits = logits / temperature
    padding = batch.mask == 0
    logprobs = F.selective_log_softmax(logits, batch.completion_ids).masked_fill(padding, 0.0)
    entropy = None
    if with_entropy and entropy_grad:
        log_probs = logits.float().log_softmax(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1).masked_fill(padding, 0.0)
    elif with_entropy:
        entropy = F.entropy_from_logits(logits.detach()).masked_fill(padding, 0.0)
    values = value_head(hidden.to(value_head.linear.weight.dtype)) if value_head is not None else None
    return ForwardOutput(logprobs, entropy, values)
