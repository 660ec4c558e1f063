"""Which rows of a batch go through the model together: micro-batches of so many rows, or of at most so
many tokens (``max_tokens_per_micro_batch``), the rows of a group that shares its prompt kept together."""

from __future__ import annotations

import torch
from torch import Tensor


def token_budget_micro_batches(items: list[tuple[list[int], int]], budget: int) -> list[list[int]]:
    """Rows placed into micro-batches of at most ``budget`` tokens each, best-fit decreasing.

    ``items``: ``(rows, tokens)``, the rows that go together (a group sharing its prompt) and what they
    cost. An item over the budget runs alone. Largest items first, each into the micro-batch it fills
    most closely, or a new one: a few micro-batches, each near the budget. Returns each micro-batch's
    rows in ascending order, the micro-batches in the order of their first row; every row exactly once.
    """
    bins: list[tuple[int, list[int]]] = []  # (tokens left, rows)
    for rows, tokens in sorted(items, key=lambda item: -item[1]):
        fitting = [k for k, (left, _) in enumerate(bins) if left >= tokens]
        if fitting:
            k = min(fitting, key=lambda k: bins[k][0])
            bins[k] = (bins[k][0] - tokens, bins[k][1] + list(rows))
        else:
            bins.append((budget - tokens, list(rows)))
    return sorted((sorted(rows) for _, rows in bins), key=lambda rows: rows[0])


def micro_batch_rows(prompt_ids: list[Tensor], lengths: Tensor, *, rows: int | None, tokens: int | None,
                     share_prompts: bool = True) -> list[Tensor]:
    """The row indices of each micro-batch of a batch: ``rows`` at a time in order, or (``tokens``) by
    :func:`token_budget_micro_batches`, a run of rows with the same prompt (a group) kept together
    while it fits, its prompt counted once when ``share_prompts``. ``lengths`` [n]: completion tokens."""
    n = len(prompt_ids)
    if tokens is None:
        return [torch.arange(start, min(start + rows, n)) for start in range(0, n, rows)]
    items: list[tuple[list[int], int]] = []
    start = 0
    while start < n:  # runs of consecutive rows with the same prompt
        end = start + 1
        while end < n and torch.equal(prompt_ids[end], prompt_ids[start]):
            end += 1
        prompt, completions = len(prompt_ids[start]), [int(x) for x in lengths[start:end]]
        whole = (prompt if share_prompts else prompt * (end - start)) + sum(completions)
        if whole <= tokens:
            items.append((list(range(start, end)), whole))
        else:
            items += [([start + k], prompt + c) for k, c in enumerate(completions)]
        start = end
    return [torch.tensor(batch) for batch in token_budget_micro_batches(items, tokens)]
