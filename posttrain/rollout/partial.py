"""Partial rollouts: a generation interrupted when newer weights arrive, its unfinished rows continued with them.

The rollout process of asynchronous rollouts (:mod:`posttrain.rollout.worker`) samples one request at a time.
With partial rollouts, a request still being sampled when a later request brings newer weights stops; the
weights are loaded, and the rows that have not ended go on under them, each token tagged with the policy
version that sampled it (``Completions.token_versions``). As AReaL (Fu et al. 2025, arXiv:2505.24298,
"interruptible rollout workers"), with these choices:

1. **The keys and values are recomputed.** A continued row is prompted with its prompt and its tokens so far,
   and the new weights prefill them: every token after the switch is drawn from the new policy's
   distribution given the whole prefix, not from a mix of old keys and new weights.
2. **Where the sampler stops.** posttrain's decode loop asks ``interrupted()`` once per decode step
   (:func:`posttrain.rollout.generation.decode`), so the rows still running then all hold the same number of
   tokens. Rollout servers (:mod:`posttrain.rollout.remote`) are asked to abort their requests, and each row
   comes back with the tokens it had: rows may hold different numbers. Either way each unfinished row goes on
   from its own tokens, within what is left of its own budget.
3. **Each token keeps its own sampler log-prob** (``sampling_logprobs``), the exact behaviour log-prob of the
   version that drew it, so the rollout correction applies per token as it does to any stale token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor

from posttrain.rollout.completions import Capabilities, Completions, SamplingParams


class ResumableGenerator(Protocol):
    """A generator whose ``capabilities.resumes`` is True: posttrain's decode loop
    (:class:`posttrain.rollout.generators.FastGenerator`) and rollout servers
    (:class:`posttrain.rollout.remote.RemoteGenerator`)."""

    capabilities: Capabilities
    params: SamplingParams
    pad_id: int

    def generate(self, prompt_ids: list[Tensor], *, num_samples: int, greedy: bool = False, rows: Any = None,
                 interrupted: Callable[[], bool] | None = None,
                 max_new_tokens: int | list[int] | None = None) -> Completions:
        """``max_new_tokens``: one budget for every prompt, or one per prompt."""
        ...


def generate(generator: ResumableGenerator, prompt_ids: list[Tensor], *, num_samples: int, greedy: bool,
             version: int, interrupted: Callable[[], bool], load_newer: Callable[[], int]) -> Completions:
    """``num_samples`` completions of each prompt, sampled from the weights of ``version`` until ``interrupted()``
    says newer ones wait; then ``load_newer()`` loads them and returns their version, and the unfinished rows
    go on under them (again, until the next interruption or their end). Returns [N, T] completions as the
    generator's, with ``token_versions`` set.
    """
    budget = generator.params.max_new_tokens
    completions = generator.generate(prompt_ids, num_samples=num_samples, greedy=greedy, interrupted=interrupted)
    completions.token_versions = versions_of(completions, version)
    prompts = [p for p in prompt_ids for _ in range(num_samples)]  # row i*G + j reads prompt i
    while len(unfinished := unfinished_rows(completions, budget)):
        version = load_newer()
        lengths = completions.lengths[unfinished].tolist()
        continued = generator.generate(
            [torch.cat([prompts[i], completions.completion_ids[i, :n]]) for i, n in zip(unfinished.tolist(), lengths)],
            num_samples=1, greedy=greedy, interrupted=interrupted, max_new_tokens=[budget - n for n in lengths])
        continued.token_versions = versions_of(continued, version)
        completions = stitched(completions, unfinished, continued, generator.pad_id)
    return completions


def versions_of(completions: Completions, version: int) -> Tensor:
    """[N, T] long: ``version`` on every token of the completions, 0 on padding."""
    return torch.full_like(completions.completion_ids, version) * completions.mask.long()


def unfinished_rows(completions: Completions, budget: int) -> Tensor:
    """[n] the rows an interruption left running: no EOS yet, fewer tokens than ``budget``. A generation that
    ran to its end has none (every row ended, or spent its budget)."""
    return (completions.truncated & (completions.lengths < budget)).nonzero().squeeze(1)


def stitched(head: Completions, rows: Tensor, tail: Completions, pad_id: int) -> Completions:
    """``head`` [N, T] with each row of ``tail`` [n, T'] appended after the tokens of its row ``rows[k]`` of
    ``head``: the tokens, mask, sampler log-probs and token versions of [N, T''] completions (T'' the longest
    row), each continued row ended where its tail ended (the others, which had ended, as they were)."""
    starts, tail_lengths = head.lengths[rows], tail.lengths
    width = max(head.completion_ids.shape[1], int((starts + tail_lengths).max()) if len(rows) else 0)
    # where each continued row's tail tokens go: [n, T'] columns, valid under the tail's mask
    columns = starts.unsqueeze(1) + torch.arange(tail.completion_ids.shape[1]).unsqueeze(0)
    within = tail.mask.bool()

    def extended(head_NT: Tensor | None, tail_nT: Tensor | None, fill: float) -> Tensor | None:
        if head_NT is None:  # greedy: no sampler log-probs
            return None
        out_NT = torch.nn.functional.pad(head_NT, (0, width - head_NT.shape[1]), value=fill)
        row_index = rows.unsqueeze(1).expand_as(columns)
        out_NT[row_index[within], columns[within]] = tail_nT[within].to(out_NT.dtype)
        return out_NT

    truncated = head.truncated.clone()
    truncated[rows] = tail.truncated
    return Completions(extended(head.completion_ids, tail.completion_ids, pad_id),
                       extended(head.mask, tail.mask, 0.0), truncated,
                       extended(head.sampling_logprobs, tail.sampling_logprobs, 0.0),
                       token_versions=extended(head.token_versions, tail.token_versions, 0))
