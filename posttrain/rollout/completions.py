"""What a rollout produces: sampling settings, the completions of a batch, and the generator protocol.

Row ``i*G + j`` of :class:`Completions` is sample ``j`` of prompt ``i`` everywhere in posttrain.
Every generator (:mod:`.generators`, :mod:`.vllm`) returns this type, so a trainer never depends
on which one sampled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

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
    mask:           [N, T] 1.0 for completion tokens (the EOS token included), 0.0 for padding.
    truncated:      [N] bool, True when the budget ran out before EOS.
    sampling_logprobs: [N, T] the sampling engine's log-probs of the tokens (vLLM only; a
                    diagnostic, the trainer recomputes the log-probs it trains with), else None.
    """

    completion_ids: Tensor
    mask: Tensor
    truncated: Tensor
    sampling_logprobs: Tensor | None = None

    @property
    def lengths(self) -> Tensor:
        return self.mask.sum(-1).long()


class Generator(Protocol):
    def generate(self, prompt_ids: list[Tensor], *, num_samples: int, greedy: bool = False) -> Completions: ...


def completion_mask(tokens: Tensor, eos_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Mask up to and including the first EOS: ([N, T] float mask, [N] truncated)."""
    is_eos = torch.isin(tokens, eos_ids)
    # Position of the first EOS, or T when there is none.
    first_eos = torch.where(is_eos.any(-1), is_eos.float().argmax(-1), torch.tensor(tokens.shape[1]))
    positions = torch.arange(tokens.shape[1]).unsqueeze(0)
    mask = (positions <= first_eos.unsqueeze(1)).float()
    return mask, ~is_eos.any(-1)


def to_completions(tokens: Tensor, eos_ids: Tensor, pad_id: int) -> Completions:
    """Generated tokens [N, T] as :class:`Completions`: masked through the first EOS, pad after it."""
    if tokens.shape[1] == 0:  # nothing generated (budget of 0 is rejected by config)
        raise RuntimeError("generate returned no new tokens")
    mask, truncated = completion_mask(tokens, eos_ids)
    return Completions(tokens.masked_fill(mask == 0, pad_id), mask, truncated)
