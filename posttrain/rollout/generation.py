"""A fast decode loop for Hugging Face causal LMs: the default ``hf`` generator.

It calls the model's own forward pass (any decoder whose layers all use full
attention, a LoRA-wrapped one included) and replaces what ``model.generate``
does around it. Where it departs from ``generate``:

1. **One prefill per prompt.** ``generate`` runs ``B*G`` prefills of ``B``
   distinct prompts; here the ``B`` prompts are prefilled once and each
   prompt's keys and values are broadcast into the cache rows of its ``G``
   samples.
2. **A preallocated KV cache** (:class:`PreallocatedLayer`): one buffer per
   layer sized for prompt + budget, written in place. ``DynamicCache`` copies
   the whole cache at every step (``torch.cat``), and each copy is a fresh
   allocation.
3. **Finished rows leave the batch.** A row that samples an EOS token is
   dropped from the decode batch, so later steps run on the unfinished rows
   only (``generate`` keeps decoding them and throws the tokens away). The
   last running rows move into the places the finished ones left
   (:func:`fill_order`), so a step copies the cache of as many rows as
   finished, not of every row that goes on; the batch's row order changes, and
   ``rows`` keeps each one's output row.
4. **Sampling on the last position's logits with a few tensor ops**
   (:func:`sampling_distribution`, :func:`draw`): temperature, then top-k,
   then top-p (nucleus), then one uniform number per row through the inverse
   CDF (accumulated in float64, so tokens with probability below float32's
   resolution keep their mass). ``generate``'s ``multinomial`` draws one
   exponential variate per vocabulary entry, which on CPU costs more than the
   rest of the sampling together. Top-k keeps exactly ``k`` tokens (``generate``
   also keeps tokens tied with the ``k``-th); the random stream differs from
   ``generate``'s, so sampled completions are equal in distribution, not token
   for token. Greedy decoding is the argmax, as in ``generate``.

5. **A fused decode step** for Llama, Mistral and Qwen2 (:mod:`posttrain.rollout.decode_step`): after the
   prefill, each step runs against the model's weights directly (fused QKV and gate-up products on
   prepacked weights) instead of the module tree; other models run their forward.

Position ids follow ``generate``: the running count of real tokens, so
left-padded prompts of different lengths see the same positions as alone.
Greedy outputs equal ``generate``'s token for token (tested).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from posttrain.models.architecture import cache_unsupported_reason
from posttrain.models.experts import routers
from posttrain.rollout import decode_step


def sampling_distribution(
    logits_NV: Tensor, temperature: float, top_k: int, top_p: float
) -> tuple[Tensor, Tensor | None]:
    """The distribution to sample from: ``(probs_NK, token_ids_NK)``.

    logits_NV: [N, V] next-token logits.
    probs_NK:  [N, K] float32, not renormalised after top-p (zeros mark removed tokens; :func:`draw` rescales).
    token_ids_NK: [N, K] vocabulary ids of the K columns, sorted by decreasing logit; None when no
    filter is active (K = V, the columns are the vocabulary in order).

    Temperature divides the logits; top-k keeps the ``k`` largest; top-p keeps the smallest prefix
    of the remaining tokens, by decreasing probability, whose mass reaches ``top_p`` (Holtzman et
    al. 2020, eq. 2: a token stays when the mass ranked strictly above it is below ``top_p``).
    """
    logits = logits_NV.float()
    if temperature != 1.0:
        logits = logits / temperature
    if top_k == 0 and top_p >= 1.0:
        return torch.softmax(logits, -1), None
    k = min(top_k, logits.shape[-1]) if top_k else logits.shape[-1]
    values, token_ids = logits.topk(k, dim=-1)  # sorted, largest first
    probs = torch.softmax(values, -1)
    if top_p < 1.0:
        mass_above = probs.cumsum(-1) - probs
        probs = probs.masked_fill(mass_above >= top_p, 0.0)
    return probs, token_ids


def draw(probs_NK: Tensor, token_ids_NK: Tensor | None, uniform_N: Tensor) -> Tensor:
    """Inverse-CDF sampling: column ``j`` with probability ``probs[j] / probs.sum()``, as token ids [N].

    uniform_N: [N] numbers in [0, 1). The CDF is accumulated in float64; ``right=True`` makes a
    zero-probability column unreachable (its CDF step is empty).
    """
    column = _draw_columns(probs_NK, uniform_N)
    chosen = column if token_ids_NK is None else token_ids_NK.gather(1, column)
    return chosen.squeeze(1)


def _draw_columns(probs_NK: Tensor, uniform_N: Tensor) -> Tensor:
    cdf = probs_NK.double().cumsum(-1)
    target = uniform_N.double().unsqueeze(1) * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).clamp_(max=probs_NK.shape[1] - 1)  # [N, 1]


def next_tokens(logits_NV: Tensor, *, greedy: bool, temperature: float, top_k: int, top_p: float) -> Tensor:
    """One token per row [N]: the argmax when greedy, else a draw from :func:`sampling_distribution`."""
    return sample_tokens(logits_NV, greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p)[0]


def sample_tokens(logits_NV: Tensor, *, greedy: bool, temperature: float, top_k: int,
                  top_p: float) -> tuple[Tensor, Tensor | None]:
    """:func:`next_tokens` and, when sampling, the sampler's log-probability of each drawn token [N]:
    of the distribution it was drawn from (after temperature, top-k and top-p); None when greedy."""
    if greedy:
        return logits_NV.argmax(-1), None
    probs, token_ids = sampling_distribution(logits_NV, temperature, top_k, top_p)
    column = _draw_columns(probs, torch.rand(logits_NV.shape[0], device=logits_NV.device, dtype=torch.float64))
    chosen = column if token_ids is None else token_ids.gather(1, column)
    logprob = probs.gather(1, column).log() - probs.sum(-1, keepdim=True).log()
    return chosen.squeeze(1), logprob.squeeze(1)


class PreallocatedLayer(DynamicLayer):
    """One attention layer's keys and values in buffers ``[rows, heads, capacity, head_dim]``.

    The prefill arrives with one row per prompt and is broadcast to the ``repeats`` rows of its
    samples; each decode step writes one position in place. ``keys``/``values`` are views of the
    first ``active`` rows and ``length`` positions, which is what the attention reads.
    """

    def __init__(self, repeats: int, capacity: int):
        super().__init__()
        self.repeats, self.capacity, self.length, self.active = repeats, capacity, 0, 0

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        prompts, heads, _, dim = key_states.shape
        self.device = key_states.device
        # Under autocast the rotated keys are float32 and the values bfloat16: both kept in float32, so the
        # fused decode step's attention reads one dtype and casts nothing
        dtype = torch.promote_types(key_states.dtype, value_states.dtype)
        self.key_buffer = key_states.new_empty(prompts * self.repeats, heads, self.capacity, dim, dtype=dtype)
        self.value_buffer = value_states.new_empty(prompts * self.repeats, heads, self.capacity, value_states.shape[-1],
                                                   dtype=dtype)
        self.active = prompts * self.repeats
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        start, new = self.length, key_states.shape[-2]
        if not self.is_initialized:  # the prefill: attention runs on the prompts' own rows
            self.lazy_initialization(key_states, value_states)
            self.key_buffer.unflatten(0, (-1, self.repeats))[:, :, :, :new] = key_states.unsqueeze(1)
            self.value_buffer.unflatten(0, (-1, self.repeats))[:, :, :, :new] = value_states.unsqueeze(1)
            self._set_length(new)
            return key_states, value_states
        self.key_buffer[: self.active, :, start : start + new] = key_states
        self.value_buffer[: self.active, :, start : start + new] = value_states
        self._set_length(start + new)
        return self.keys, self.values

    def move_rows(self, destinations: Tensor, sources: Tensor, active: int) -> None:
        """Copy rows ``sources`` into rows ``destinations`` (disjoint), then keep the first ``active`` rows."""
        self.active = active
        self.key_buffer[destinations, :, : self.length] = self.key_buffer[sources, :, : self.length]
        self.value_buffer[destinations, :, : self.length] = self.value_buffer[sources, :, : self.length]
        self._set_length(self.length)

    def batch_select_indices(self, indices: Tensor) -> None:
        """Keep rows ``indices`` (in that order), moved to the front of the buffers."""
        self.active = len(indices)
        self.key_buffer[: self.active, :, : self.length] = self.key_buffer[indices, :, : self.length]
        self.value_buffer[: self.active, :, : self.length] = self.value_buffer[indices, :, : self.length]
        self._set_length(self.length)

    def _set_length(self, length: int) -> None:
        self.length = length
        self.keys = self.key_buffer[: self.active, :, :length]
        self.values = self.value_buffer[: self.active, :, :length]


def fill_order(running_N: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """How the batch closes up when the rows where ``running_N`` is False leave it: the ``M`` running rows
    stay, the ones at or past ``M`` moving into the first ``M`` places the finished rows left.

    running_N: [N] bool.
    Returns ``order_M`` (the batch's new row ``i`` is the old row ``order_M[i]``), ``holes_K`` (the places
    below ``M`` that finished rows leave) and ``movers_K`` (the running rows at or past ``M`` that fill them,
    in order). For ``[T, F, T, F, T, T]``: M = 4, holes [1, 3], movers [4, 5], order [0, 4, 2, 5].
    """
    m = int(running_N.sum())
    holes_K = (~running_N[:m]).nonzero().squeeze(1)
    movers_K = running_N[m:].nonzero().squeeze(1) + m
    order_M = torch.arange(m, device=running_N.device)
    order_M[holes_K] = movers_K
    return order_M, holes_K, movers_K


def unsupported_reason(model) -> str | None:
    """Why :func:`decode` cannot run ``model`` (None: it can): it decodes on a cache passed to the model's
    forward (:func:`posttrain.models.architecture.cache_unsupported_reason`)."""
    return cache_unsupported_reason(model)


def preallocated_cache(config, repeats: int, capacity: int) -> Cache:
    """A cache of :class:`PreallocatedLayer`, one per layer of the model (see :func:`unsupported_reason`)."""
    return Cache(layers=[PreallocatedLayer(repeats, capacity) for _ in DynamicCache(config=config).layers])


@torch.inference_mode()  # no autograd bookkeeping at all (what that saves: benchmarks/RESULTS.md)
def decode(
    model,
    cache: Cache,
    ids_PL: Tensor,
    attention_PL: Tensor,
    *,
    num_samples: int,
    max_new_tokens: int,
    eos_ids: Tensor,
    pad_id: int,
    greedy: bool,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    step_rows: list[Tensor] | None = None,
    interrupted: Callable[[], bool] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``num_samples`` completions of each left-padded prompt: tokens [P*G, T], ``pad_id`` after a row's
    first EOS; T is the number of steps run (all rows finished, or ``max_new_tokens``). Also, when
    sampling, the sampler's log-prob of each token [P*G, T] (:func:`sample_tokens`; 0 after a row's
    end), which the trainer compares with its own; None when greedy.

    ids_PL, attention_PL: [P, L] left-padded prompts and their attention mask, on the model's device.
    cache: an empty :func:`preallocated_cache` with ``repeats=num_samples`` and capacity >= L + T.
    step_rows: when given, each step's running rows (output row indices) before its pass, in order: what a
    routing recorder needs to place each pass's routing (:mod:`posttrain.rollout.routing`).
    interrupted: asked once per step, after its tokens are written, while rows are still running; True stops
    the loop there and returns the ``t + 1`` tokens of every row so far. The rows still running then are
    those without an EOS, all with ``t + 1`` tokens (rows advance in lockstep): partial rollouts continue
    them under newer weights (:mod:`posttrain.rollout.partial`).
    """
    device, g = ids_PL.device, num_samples
    width = ids_PL.shape[1]
    positions_PL = (attention_PL.cumsum(-1) - 1).masked_fill(attention_PL == 0, 1)  # as generate does
    fused = None if decode_step.unsupported_reason(model) else decode_step.FusedDecoder(
        model, rows=len(ids_PL) * g, positions=int(positions_PL.max()) + max_new_tokens + 1)
    # a mixture of experts whose config asks for router logits would compute its load-balancing loss at every
    # step, against a mask of another shape than a cached step's tokens: sampling needs neither
    no_router_loss = {"output_router_logits": False} if routers(model) else {}
    out = model(input_ids=ids_PL, attention_mask=attention_PL, position_ids=positions_PL, cache=cache,
                use_cache=True, logits_to_keep=1, **no_router_loss)
    logits = out.logits[:, -1].repeat_interleave(g, 0)  # [N, V]
    position_N1 = positions_PL[:, -1:].repeat_interleave(g, 0) + 1
    attention_NS = torch.zeros(len(logits), width + max_new_tokens, dtype=attention_PL.dtype, device=device)
    attention_NS[:, :width] = attention_PL.repeat_interleave(g, 0)
    tokens_NT = torch.full((len(logits), max_new_tokens), pad_id, dtype=torch.long, device=device)
    logprobs_NT = None if greedy else torch.zeros(len(logits), max_new_tokens, device=device)
    rows = torch.arange(len(logits), device=device)  # output row of each active row
    for t in range(max_new_tokens):
        token_n, logprob_n = sample_tokens(logits, greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p)
        tokens_NT[rows, t] = token_n
        if logprobs_NT is not None:
            logprobs_NT[rows, t] = logprob_n
        running = ~torch.isin(token_n, eos_ids)
        if t + 1 == max_new_tokens or not running.any():
            break
        if interrupted is not None and interrupted():
            break
        if not running.all():  # finished rows leave the batch and the cache; the last rows take their places
            order, holes, movers = fill_order(running)
            rows, token_n, position_N1 = rows[order], token_n[order], position_N1[order]
            attention_NS[holes] = attention_NS[movers]
            for layer in cache.layers:
                layer.move_rows(holes, movers, len(order))
        n = len(rows)
        attention_NS[:n, width + t] = 1
        if step_rows is not None:
            step_rows.append(rows.clone())
        if fused is not None:
            logits = fused.step(token_n, position_N1, attention_NS[:n, : width + t + 1], cache)
        else:
            logits = model(input_ids=token_n.unsqueeze(1), attention_mask=attention_NS[:n, : width + t + 1],
                           position_ids=position_N1, cache=cache, use_cache=True, **no_router_loss).logits[:, -1]
        position_N1 = position_N1 + 1
    with torch.inference_mode(False):  # a normal tensor: the training forward saves its ids for the backward
        return tokens_NT[:, : t + 1].clone(), None if logprobs_NT is None else logprobs_NT[:, : t + 1].clone()
