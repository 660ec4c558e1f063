"""Partial rollouts: a generation interrupted when newer weights arrive, its unfinished rows continued with them.

The rollout process of asynchronous rollouts (:mod:`posttrain.rollout.worker`) samples one request at a time.
With partial rollouts, a request still being sampled when a later request brings newer weights stops between
two decode steps; the weights are loaded, and the rows that have not ended go on under them, each token
tagged with the policy version that sampled it (``Completions.token_versions``). As AReaL (Fu et al. 2025,
arXiv:2505.24298, "interruptible rollout workers"), with these choices:

1. **The keys and values are recomputed.** A continued row is prompted with its prompt and its tokens so far,
   and the new weights prefill them: every token after the switch is drawn from the new policy's
   distribution given the whole prefix, not from a mix of old keys and new weights.
2. **The switch happens between decode steps.** The generator asks ``interrupted()`` once per step
   (:func:`posttrain.rollout.generation.decode`); the rows still running then all hold the same number of
   tokens, so they continue as one batch of one sample each, within what is left of the budget.
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
    """A generator whose ``capabilities.resumes`` is True (:class:`posttrain.rollout.generators.FastGenerator`)."""

    capabilities: Capabilities
    params: SamplingParams
    pad_id: int

    def generate(self, prompt_ids: list[Tensor], *, num_samples: int, greedy: bool = False, rows: Any = None,
                 interrupted: Callable[[], bool] | None = None, max_new_tokens: int | None = None) -> Completions: ...


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
        width = completions.completion_ids.shape[1]
        continued = generator.generate(
            [torch.cat([prompts[i], completions.completion_ids[i]]) for i in unfinished.tolist()], num_samples=1,
            greedy=greedy, interrupted=interrupted, max_new_tokens=budget - width)
        continued.token_versions = versions_of(continued, version)
        completions = stitched(completions, unfinished, continued, generator.pad_id)
    return completions


def versions_of(completions: Completions, version: int) -> Tensor:
    """[N, T] long: ``version`` on every token of the completions, 0 on padding."""
    return torch.full_like(completions.completion_ids, version) * completions.mask.long()


def unfinished_rows(completions: Completions, budget: int) -> Tensor:
    """[n] the rows an interruption left running: no EOS yet, fewer tokens than ``budget``. A generation that
    ran to its end has none (every row ended, or the budget is spent), and the rows an interruption left
    running hold all ``T`` columns (rows advance in lockstep)."""
    return (completions.truncated & (completions.completion_ids.shape[1] < budget)).nonzero().squeeze(1)


def stitched(head: Completions, rows: Tensor, tail: Completions, pad_id: int) -> Completions:
    """``head`` [N, T] with ``tail`` [n, T'] appended to its rows ``rows`` [n]: the tokens, mask, sampler
    log-probs and token versions of [N, T + T'] completions, each row ended where its tail ended (the others,
    which had ended, padded)."""
    width = head.completion_ids.shape[1]

    def extended(head_NT: Tensor | None, tail_nT: Tensor | None, fill: float) -> Tensor | None:
        if head_NT is None:  # greedy: no sampler log-probs
            return None
        out_NT = torch.nn.functional.pad(head_NT, (0, tail_nT.shape[1]), value=fill)
        out_NT[rows, width:] = tail_nT
        return out_NT

    truncated = head.truncated.clone()
    truncated[rows] = tail.truncated
    return Completions(extended(head.completion_ids, tail.completion_ids, pad_id),
                       extended(head.mask, tail.mask, 0.0), truncated,
                       extended(head.sampling_logprobs, tail.sampling_logprobs, 0.0),
                       token_versions=extended(head.token_versions, tail.token_versions, 0))
