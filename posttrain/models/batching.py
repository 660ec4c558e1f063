"""Which rows of a batch go through the model together: micro-batches of so many rows, or of at most so
many tokens (``max_tokens_per_micro_batch``), the rows of a group that shares its prompt kept together;
for the offline trainers, which items (examples, pairs) go together."""

from __future__ import annotations

import torch
from torch import Tensor

from posttrain.data.sft import pack


def token_budget_micro_batches(items: list[tuple[list[int], int]], budget: int) -> list[list[int]]:
    """Rows placed into micro-batches of at most ``budget`` tokens each, best-fit decreasing.

    ``items``: ``(rows, tokens)``, the rows that go together (a group sharing its prompt) and what they
    cost. An item over the budget runs alone. Largest items first, each into the micro-batch it fills
    most closely, or a new one: a few micro-batches, each near the budget. Returns each micro-batch's
    rows in ascending order, the micro-batches in the order of their first row; every row exactly once.
    """
    bins = pack([tokens for _, tokens in items], budget)
    return sorted((sorted(row for k in bin_ for row in items[k][0]) for bin_ in bins), key=lambda rows: rows[0])


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


def item_micro_batches(costs: list[int], *, per_pass: int, budget: int | None) -> list[list[int]]:
    """The positions of items (examples, pairs) of each micro-batch: ``per_pass`` at a time in order, or
    (``budget``) by :func:`token_budget_micro_batches` of their token ``costs``."""
    if budget is None:
        return [list(range(start, min(start + per_pass, len(costs)))) for start in range(0, len(costs), per_pass)]
    return token_budget_micro_batches([([k], cost) for k, cost in enumerate(costs)], budget)


def in_item_order(micro_batches: list[list[int]]) -> Tensor:
    """[n] the index that puts rows concatenated micro-batch by micro-batch back in item order."""
    return torch.tensor([k for rows in micro_batches for k in rows]).argsort()
