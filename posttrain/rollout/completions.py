"""What a rollout produces: sampling settings, the completions of a batch, and the generator protocol.

Row ``i*G + j`` of :class:`Completions` is sample ``j`` of prompt ``i`` everywhere in posttrain.
Every generator (:mod:`.generators`, :mod:`.vllm`) returns this type, so a trainer never depends
on which one sampled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


@dataclass
class Completions:
    """``N = len(prompts) * num_samples`` completions, right-padded.

    completion_ids: [N, T] token ids, ``pad`` after the end.
    mask:           [N, T] 1.0 for the tokens the policy generated (the EOS token included), 0.0 for
                    padding and inserted tokens: what the loss, the KL and every token count see.
    truncated:      [N] bool, True when the budget ran out before EOS.
    sampling_logprobs: [N, T] the sampler's log-probs of the policy's tokens (0 elsewhere), as it drew them
                    (posttrain's decode loop and vLLM; None when greedy or from transformers' generate).
                    The trainer recomputes the log-probs it trains with and compares the two: the
                    rollout correction (``F.rollout_correction``) and the ``mismatch/`` metrics.
    inserted:       [N, T] bool, the tokens a tool or an environment inserted between the policy's turns
                    (multi-turn episodes): context the policy reads and never trains on. None: one turn.
    rewards:        [N] the environment's reward of each episode (the sum of its steps'); None without one.
    versions:       [N] long, the policy version (the trainer's step count) whose weights sampled each row;
                    the trainer sets it (a generator does not know which version it holds). Step ``t``'s
                    rows are ``t - version`` versions stale: 0 in a synchronous run, at most
                    ``max_staleness`` with asynchronous rollouts.
    routing:        [N, L, S, k] int16, a mixture of experts' chosen experts for each token the training pass
                    computes, as the sampler routed it (``routing_replay``; :mod:`.routing`); None otherwise.
    prompt_ids:     [N] each row's own prompt, where the sampler chose it (a user's agent renders its own
                    first request: :mod:`.agents`); None: the prompts the generator was given, row ``i*G + j``
                    reading prompt ``i``.
    dropped:        [N] bool, an episode that could not be recorded (its agent raised, never called the model,
                    or its calls were not one token sequence): its group leaves the update. None: none.
    images:         [N] each row's image inputs for a vision-language model (its prompt's, as the processor gave
                    them: ``pixel_values``, ...), which every training pass takes with it. None: no images.
    token_versions: [N, T] long, the policy version whose weights sampled each token (0 on padding; read it
                    under ``mask``): partial rollouts (:mod:`.partial`) continue a row under newer weights, so
                    its tokens may span versions, and ``versions`` is then each row's oldest. None: every token
                    of a row is its ``versions``.
    """

    completion_ids: Tensor
    mask: Tensor
    truncated: Tensor
    sampling_logprobs: Tensor | None = None
    inserted: Tensor | None = None
    rewards: Tensor | None = None
    versions: Tensor | None = None
    routing: Tensor | None = None
    prompt_ids: list[Tensor] | None = None
    dropped: Tensor | None = None
    images: list[dict[str, Tensor]] | None = None
    token_versions: Tensor | None = None

    @property
    def lengths(self) -> Tensor:
        """[N] the tokens the policy generated."""
        return self.mask.sum(-1).long()

    @property
    def present(self) -> Tensor:
        """[N, T] 1.0 on every token of the completion, the policy's and the inserted ones (what attention
        sees), 0.0 on padding."""
        return self.mask if self.inserted is None else torch.maximum(self.mask, self.inserted.to(self.mask.dtype))

    def rows(self, index: Tensor) -> "Completions":
        """The completions of rows ``index`` (a [n] long tensor)."""
        return Completions(*(None if t is None else t[index] for t in (
            self.completion_ids, self.mask, self.truncated, self.sampling_logprobs, self.inserted, self.rewards,
            self.versions, self.routing)), None if self.prompt_ids is None else [self.prompt_ids[int(i)] for i in index],
            None if self.dropped is None else self.dropped[index],
            None if self.images is None else [self.images[int(i)] for i in index],
            None if self.token_versions is None else self.token_versions[index])

    def prompts(self, given: list[Tensor], num_samples: int) -> list[Tensor]:
        """[N] each row's prompt: its own where the sampler chose one, else ``given[i]`` for rows ``i*G .. i*G+G-1``."""
        return self.prompt_ids if self.prompt_ids is not None else [p for p in given for _ in range(num_samples)]

    @staticmethod
    def cat(parts: list["Completions"]) -> "Completions":
        """The rows of every part, right-padded to the widest (inserted: False where a part has none)."""
        inserted = None
        if any(p.inserted is not None for p in parts):
            inserted = cat_rows([p.inserted if p.inserted is not None else torch.zeros_like(p.mask, dtype=torch.bool)
                                 for p in parts])
        logprobs, token_versions = (cat_rows([getattr(p, name) for p in parts])
                                    if all(getattr(p, name) is not None for p in parts) else None
                                    for name in ("sampling_logprobs", "token_versions"))
        rewards, versions = (torch.cat([getattr(p, name) for p in parts])
                             if all(getattr(p, name) is not None for p in parts) else None
                             for name in ("rewards", "versions"))
        routing = None
        if all(p.routing is not None for p in parts):  # [n, L, S, k]: padded along the positions
            width = max(p.routing.shape[2] for p in parts)
            routing = torch.cat([torch.nn.functional.pad(p.routing, (0, 0, 0, width - p.routing.shape[2]))
                                 for p in parts])
        prompt_ids = sum((p.prompt_ids for p in parts), []) if all(p.prompt_ids is not None for p in parts) else None
        if prompt_ids is None and any(p.prompt_ids is not None for p in parts):
            raise ValueError("completions with their own prompts and completions without cannot be joined")
        dropped = None
        if any(p.dropped is not None for p in parts):
            dropped = torch.cat([p.dropped if p.dropped is not None else torch.zeros(len(p.mask), dtype=torch.bool)
                                 for p in parts])
        images = sum((p.images or [{}] * len(p.mask) for p in parts), []) if any(p.images for p in parts) else None
        return Completions(cat_rows([p.completion_ids for p in parts]), cat_rows([p.mask for p in parts]),
                           cat_rows([p.truncated for p in parts]), logprobs, inserted, rewards, versions, routing,
                           prompt_ids, dropped, images, token_versions)


def cat_rows(parts: list[Tensor | None]) -> Tensor | None:
    """Concatenate along rows, right-padding [n, T] tensors with 0 to the widest; None stays None."""
    if parts[0] is None:
        return None
    if parts[0].dim() == 1:
        return torch.cat(parts)
    width = max(p.shape[1] for p in parts)
    return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])


@dataclass(frozen=True)
class Capabilities:
    """What a generator can do, declared by its class (a trainer reads these, never probes for methods)."""

    own_weights: bool = False
    """It samples with a copy of the weights of its own (an engine, servers), which must be sent to it."""
    syncs_weights: bool = False
    """It brings that copy up to the policy itself before sampling (``sync_weights()``), and checks each sync with
    the ``sync_check`` the trainer gives it."""
    sampler_logprobs: bool = True
    """It returns each sampled token's log-prob under the distribution it drew from (``sampling_logprobs``)."""
    samples_elsewhere: bool = False
    """Its compute runs in other processes: asynchronous rollouts drive it from a thread, not a process."""
    pauses: bool = False
    """It can pause requests in flight and resume them (servers)."""
    resumes: bool = False
    """Its ``generate`` takes ``interrupted`` (asked while it samples; True stops it, returning every row's tokens
    so far) and ``max_new_tokens`` (a smaller budget, one or one per prompt, to continue a row from its prompt
    plus its tokens): what partial rollouts need (:mod:`posttrain.rollout.partial`)."""


POLICY_SAMPLER = Capabilities()
"""A generator that samples with the model it is given, in this process (posttrain's decode loop, transformers'
generate, the episodes around them)."""


class Generator(Protocol):
    capabilities: Capabilities

    def generate(self, prompt_ids: list[Tensor], *, num_samples: int, greedy: bool = False,
                 rows: Sequence[Mapping[str, Any]] | None = None) -> Completions:
        """``num_samples`` completions of each prompt; ``rows`` are the dataset rows the prompts came from
        (an environment starts its episodes from them; single-turn generators do not look)."""
        ...


def completion_mask(tokens: Tensor, eos_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Mask up to and including the first EOS: ([N, T] float mask, [N] truncated)."""
    is_eos = torch.isin(tokens, eos_ids)
    # Position of the first EOS, or T when there is none.
    first_eos = torch.where(is_eos.any(-1), is_eos.float().argmax(-1), torch.tensor(tokens.shape[1]))
    positions = torch.arange(tokens.shape[1]).unsqueeze(0)
    mask = (positions <= first_eos.unsqueeze(1)).float()
    return mask, ~is_eos.any(-1)


def per_prompt_budgets(max_new_tokens: int | list[int] | None, default: int, prompts: int) -> list[int]:
    """Each prompt's budget from a generator's ``max_new_tokens``: one for all (None: ``default``), or one each."""
    if max_new_tokens is None or isinstance(max_new_tokens, int):
        return [default if max_new_tokens is None else max_new_tokens] * prompts
    if len(max_new_tokens) != prompts:
        raise ValueError(f"max_new_tokens: {len(max_new_tokens)} budgets for {prompts} prompts")
    return list(max_new_tokens)


def within_budgets(completions: Completions, budgets: Tensor, pad_id: int) -> Completions:
    """[N, T] completions cut at each row's budget [N]: what a row sampled past it becomes padding, and a row
    without an EOS within it is truncated. For a sampler that runs every row to the longest budget."""
    keep = torch.arange(completions.completion_ids.shape[1]).unsqueeze(0) < budgets.unsqueeze(1)
    mask = completions.mask * keep
    cut_off = (completions.mask * ~keep).sum(1) > 0  # the row had tokens past its budget
    return dataclasses.replace(
        completions, completion_ids=completions.completion_ids.masked_fill(mask == 0, pad_id), mask=mask,
        truncated=completions.truncated | cut_off,
        sampling_logprobs=None if completions.sampling_logprobs is None else completions.sampling_logprobs * mask)


def to_completions(tokens: Tensor, eos_ids: Tensor, pad_id: int) -> Completions:
    """Generated tokens [N, T] as :class:`Completions`: masked through the first EOS, pad after it."""
    if tokens.shape[1] == 0:  # nothing generated (budget of 0 is rejected by config)
        raise RuntimeError("generate returned no new tokens")
    mask, truncated = completion_mask(tokens, eos_ids)
    return Completions(tokens.masked_fill(mask == 0, pad_id), mask, truncated)
