"""Token log-probabilities and entropies from logits, chunked to bound memory.

`selective_log_softmax(logits, tokens)` equals
`torch.log_softmax(logits.float(), -1).gather(-1, tokens[..., None])[..., 0]` in
value and gradient, without materialising a float32 `[N, T, V]` tensor: the
forward gathers the token logit and subtracts a logsumexp computed in float32
one block of at most `chunk_size` rows at a time; a custom backward rebuilds
each block's softmax from the saved logsumexp (d/dx_j (x_k - lse) = 1[j=k] - p_j).
Plain autograd over chunks would save a float32 copy of every bfloat16 chunk
and allocate a full-size gradient per chunk.

`entropy_from_logits` is the token entropy of softmax(logits), a diagnostic
(no gradient), chunked the same way. `linear_log_softmax`'s entropies are differentiable (an
entropy bonus trains on them): dH/dz_j = -p_j (log p_j + H), built in the same block loop.

Blocks are views over (N, T), so a non-contiguous input such as
`logits[:, :-1]` is never copied whole. The chunk loops are over memory
blocks, not over examples: every block is vectorised.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ._checks import check_ndim, check_positive, compute_dtype

DEFAULT_CHUNK_SIZE = 256  # rows (tokens) per block: 256 x 152k vocab x 4 bytes ~ 150 MB
LINEAR_CHUNK_SIZE = 4096  # vocabulary entries per block of linear_log_softmax: see benchmarks/logprobs.py
KEEP_LOGITS_BYTES = 2**30
"""linear_log_softmax keeps the logits for its backward up to this size (1 GiB), else recomputes them. Keeping
saves one ``M x V x D`` product, a third of the head's products: SmolLM2's head over 1,850 scored tokens,
forward and backward, 1.8-2.2 s kept against 2.3-3.1 s recomputed (AMD EPYC, AVX2, float32), about 1 s of the
SmolLM2 recipe's float32 step, whose micro-batches keep 364 MB of logits. A 1,024-token block at a 152k
vocabulary is 0.6 GiB; beyond 1 GiB the memory is worth more than the product."""
EXP_FLOOR = -60.0
"""linear_log_softmax raises shifted logits (``z - max`` or ``z - logsumexp``, all <= 0) to this before
``exp``: on CPU, ``exp`` of inputs far below zero (whose results are subnormal or underflow) takes a
slow path (about 3x; benchmarks/RESULTS.md, the SmolLM2 step), and a large vocabulary puts most of its
logits there. Each probability changes by under exp(-60) = 8.8e-27, under 1e-21 summed over 100k
entries: far below float32's resolution of a log-prob."""


def _blocks(n: int, t: int, chunk_size: int) -> Iterator[tuple[slice, slice]]:
    """(rows, columns) slices over an [n, t] grid, each block at most chunk_size cells."""
    t_step = max(1, min(t, chunk_size))
    n_step = max(1, chunk_size // t_step)
    for i in range(0, n, n_step):
        for j in range(0, t, t_step):
            yield slice(i, i + n_step), slice(j, j + t_step)


class _SelectiveLogSoftmax(torch.autograd.Function):
    """logits [N, T, V], tokens [N, T] -> [N, T]; `ctx` is `Any` as it carries chunk_size."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, tokens: Tensor, chunk_size: int) -> Tensor:
        dtype = compute_dtype(logits)
        lse_NT = torch.empty(tokens.shape, dtype=dtype, device=logits.device)
        for rows, cols in _blocks(tokens.shape[0], tokens.shape[1], chunk_size):
            lse_NT[rows, cols] = logits[rows, cols].to(dtype).logsumexp(dim=-1)
        token_logits_NT = logits.gather(-1, tokens[..., None])[..., 0].to(dtype)
        ctx.save_for_backward(logits, tokens, lse_NT)
        ctx.chunk_size = chunk_size
        return token_logits_NT - lse_NT  # log softmax(x)_k = x_k - logsumexp(x)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_NT: Tensor) -> tuple[Tensor, None, None]:
        logits, tokens, lse_NT = ctx.saved_tensors
        grad_logits = torch.empty_like(logits, memory_format=torch.contiguous_format)
        for rows, cols in _blocks(tokens.shape[0], tokens.shape[1], ctx.chunk_size):
            probs = torch.exp(logits[rows, cols].to(lse_NT.dtype) - lse_NT[rows, cols, None])
            grad = grad_NT[rows, cols, None]
            block = (-grad * probs).scatter_add_(-1, tokens[rows, cols, None], grad)  # g * (1[j=k] - p_j)
            grad_logits[rows, cols] = block.to(logits.dtype)
        return grad_logits, None, None


def selective_log_softmax(logits: Tensor, tokens: Tensor, *, chunk_size: int = DEFAULT_CHUNK_SIZE) -> Tensor:
    """Log-probability of each given token under softmax(logits), memory-bounded.

    Args:
        logits: [N, T, V] any float dtype (bfloat16 included), with or without grad.
        tokens: [N, T] long, token ids in [0, V).
        chunk_size: rows (tokens) per float32 block, > 0.

    Returns:
        [N, T] log-probs in float32 (float64 for float64 logits). Differentiable
        once with respect to `logits`.
    """
    check_ndim("logits", logits, 3, "[N, T, V]")
    if tokens.shape != logits.shape[:2]:
        raise ValueError(
            f"tokens has shape {list(tokens.shape)} but logits has shape {list(logits.shape)}; "
            "tokens must be [N, T], the first two dims of logits"
        )
    if tokens.dtype != torch.long:
        raise ValueError(f"tokens must be a long tensor of token ids, got dtype {tokens.dtype}")
    check_positive("chunk_size", chunk_size)
    log_probs: Tensor = _SelectiveLogSoftmax.apply(logits, tokens, chunk_size)  # type: ignore[no-untyped-call]
    return log_probs


@torch.no_grad()
def entropy_from_logits(logits: Tensor, *, chunk_size: int = DEFAULT_CHUNK_SIZE) -> Tensor:
    """Entropy of softmax(logits) at each position, -sum_v p_v log p_v (no gradient).

    Args:
        logits: [N, T, V] any float dtype.
        chunk_size: rows (tokens) per float32 block, > 0.

    Returns:
        [N, T] entropies in nats, float32 (float64 for float64 logits).
    """
    check_ndim("logits", logits, 3, "[N, T, V]")
    check_positive("chunk_size", chunk_size)
    dtype = compute_dtype(logits)
    entropy_NT = torch.empty(logits.shape[:2], dtype=dtype, device=logits.device)
    for rows, cols in _blocks(logits.shape[0], logits.shape[1], chunk_size):
        probs = torch.softmax(logits[rows, cols].to(dtype), dim=-1)
        entropy_NT[rows, cols] = torch.special.entr(probs).sum(dim=-1)  # entr(0) = 0: -inf logits are fine
    return entropy_NT


def linear_log_softmax(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int = LINEAR_CHUNK_SIZE,
    recompute: bool | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probability (and entropy) of each given token under softmax((hidden @ weight.T + bias) / temperature),
    without ever holding more than ``chunk_size`` vocabulary columns of logits.

    Args:
        hidden: [M, D] final hidden states, one row per scored token (padding already left out).
        weight: [V, D] the output embedding (LM head); bias: [V] or None.
        tokens: [M] long, token ids in [0, V).
        temperature: > 0, divides the logits (the sampling temperature).
        with_entropy: also return the entropy of each row's distribution, differentiable like the log-probs
            (a backward that does not use it costs nothing extra).
        chunk_size: vocabulary entries per block, > 0.
        recompute: whether the backward recomputes each block's logits (True) or keeps them from the
            forward (False); None recomputes only when the ``[M, V]`` logits would exceed
            :data:`KEEP_LOGITS_BYTES`.

    Returns:
        ([M] log-probs, [M] entropies or None), float32 (float64 for float64 inputs). The log-probs
        are differentiable once with respect to ``hidden``, ``weight`` and ``bias``.

    With ``recompute`` the backward recomputes each block's logits (one extra ``M x V x D`` product)
    instead of keeping them, so no ``[M, V]`` tensor exists; either way the logits' gradient is built
    one block at a time, and each block's softmax is computed while the block is in cache. It equals
    the unfused
    ``selective_log_softmax(F.linear(hidden, weight, bias)[None] / temperature, tokens[None])`` in
    value and gradient up to float32 rounding.
    """
    check_ndim("hidden", hidden, 2, "[M, D]")
    check_ndim("weight", weight, 2, "[V, D]")
    if tokens.shape != hidden.shape[:1] or tokens.dtype != torch.long:
        raise ValueError(f"tokens must be a long tensor of shape [{hidden.shape[0]}] (one id per hidden row), "
                         f"got {tokens.dtype} of shape {list(tokens.shape)}")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden has {hidden.shape[1]} features but weight [V, D] has {weight.shape[1]}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    check_positive("chunk_size", chunk_size)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    if not needs_grad:
        recompute = True  # no backward will run: keep nothing
    elif recompute is None:
        recompute = hidden.shape[0] * weight.shape[0] * 4 > KEEP_LOGITS_BYTES
    logprobs, entropy = _LinearLogSoftmax.apply(hidden, weight, bias, tokens, temperature, with_entropy, chunk_size,
                                                recompute)
    return logprobs, entropy


def _block_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, columns: slice, temperature: float,
                  dtype: torch.dtype) -> Tensor:
    """[M, c] logits of vocabulary entries ``columns``, divided by the temperature, in ``dtype``."""
    logits = torch.nn.functional.linear(hidden, weight[columns], None if bias is None else bias[columns]).to(dtype)
    return logits.div_(temperature) if temperature != 1.0 else logits


class _LinearLogSoftmax(torch.autograd.Function):
    """hidden [M, D], weight [V, D], bias [V] | None, tokens [M] -> ([M] log-probs, [M] entropy | None).

    Blocks run over the vocabulary: every row's logsumexp is accumulated online (a running maximum
    ``peak``, ``total`` = sum exp(z - peak) and, for the entropy, ``moment`` = sum exp(z - peak) (z - peak),
    all rescaled when the maximum moves), so each block of ``weight`` is read once per pass and its
    gradient written once.
    """

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, tokens: Tensor, temperature: float,
                with_entropy: bool, chunk_size: int, recompute: bool) -> tuple[Tensor, Tensor | None]:
        dtype = compute_dtype(hidden)
        vocab = weight.shape[0]
        token_logit_M = torch.zeros(hidden.shape[0], dtype=dtype, device=hidden.device)
        peak = total = moment = None
        kept: list[tuple[Tensor, Tensor]] = []  # (logits - peak, peak) of each block, unless recomputed
        for start in range(0, vocab, chunk_size):
            columns = slice(start, start + chunk_size)
            logits = _block_logits(hidden, weight, bias, columns, temperature, dtype)  # [M, c]
            inside = (tokens >= start) & (tokens < start + logits.shape[1])
            picked = logits.gather(-1, (tokens - start).clamp(0, logits.shape[1] - 1)[:, None])[:, 0]
            token_logit_M = torch.where(inside, picked, token_logit_M)
            block_peak = logits.amax(-1)
            if peak is None:
                new_peak = block_peak
            else:  # rescale the running sums to the new maximum
                new_peak = torch.maximum(peak, block_peak)
                shift = peak - new_peak  # <= 0
                scale = shift.exp()
                if with_entropy:  # sum e_j (z_j - new) = scale * (sum e_j (z_j - old) + (old - new) * sum e_j)
                    moment = scale * (moment + shift * total)
                total = total * scale
            shifted = logits.sub_(new_peak[:, None])
            if not recompute:
                kept.append((shifted, new_peak))
            exp = shifted.clamp(min=EXP_FLOOR).exp_()
            total = exp.sum(-1) if total is None else total + exp.sum(-1)
            if with_entropy:
                block_moment = (exp * shifted).sum(-1)
                moment = block_moment if moment is None else moment + block_moment
            peak = new_peak
        log_total = total.log()
        lse_M = peak + log_total
        entropy_M = log_total - moment / total if with_entropy else None  # H = log Z - E_p[z - peak]
        ctx.save_for_backward(hidden, weight, bias, tokens, lse_M, entropy_M)
        ctx.temperature, ctx.chunk_size, ctx.kept = temperature, chunk_size, kept
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, not as zeros
        return token_logit_M - lse_M, entropy_M

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_M: Tensor | None, grad_entropy_M: Tensor | None) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, tokens, lse_M, entropy_M = ctx.saved_tensors
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros_like(hidden, dtype=lse_M.dtype) if need_hidden else None
        grad_weight = torch.empty_like(weight) if need_weight else None
        grad_bias = torch.empty_like(bias) if bias is not None and need_bias else None
        grad = (grad_M if grad_M is not None else torch.zeros_like(lse_M))[:, None].to(lse_M.dtype)
        for start in range(0, weight.shape[0], chunk_size):
            columns = slice(start, start + chunk_size)
            if ctx.kept:  # log p = z - lse = (z - peak) + (peak - lse)
                shifted, peak = ctx.kept[start // chunk_size]
                log_probs = shifted.add_((peak - lse_M)[:, None])
            else:
                log_probs = _block_logits(hidden, weight, bias, columns, temperature, lse_M.dtype).sub_(lse_M[:, None])
            if grad_entropy_M is None:
                probs = log_probs.clamp_(min=EXP_FLOOR).exp_()
                grad_logits = probs.mul_(-grad)  # d(z_k - lse)/dz_j = 1[j=k] - p_j, and z = (h W^T + b) / temperature
            else:  # dH/dz_j = -p_j (log p_j + H)
                probs = log_probs.clamp(min=EXP_FLOOR).exp_()
                grad_logits = -probs * (grad + grad_entropy_M[:, None] * (log_probs + entropy_M[:, None]))
            inside = ((tokens >= start) & (tokens < start + probs.shape[1])).nonzero()[:, 0]
            grad_logits[inside, tokens[inside] - start] += grad[inside, 0]
            if temperature != 1.0:
                grad_logits.div_(temperature)
            if grad_hidden is not None:
                grad_hidden.addmm_(grad_logits, weight[columns].to(grad_logits.dtype))
            grad_logits = grad_logits.to(hidden.dtype)
            if grad_weight is not None:
                grad_weight[columns] = (grad_logits.T @ hidden).to(weight.dtype)
            if grad_bias is not None:
                grad_bias[columns] = grad_logits.sum(0).to(bias.dtype)
        ctx.kept = None
        if grad_hidden is not None:
            grad_hidden = grad_hidden.to(hidden.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None
