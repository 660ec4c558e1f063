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
(no gradient), chunked the same way.

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
