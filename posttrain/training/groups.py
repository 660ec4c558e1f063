"""The batch of an online step: ``B`` groups of ``G`` completions with their rewards, the ways the
loop splits, filters and joins them (dynamic sampling's refills, best-of-N, processes' shares), and the
tokens where a process reward's steps end."""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from posttrain.parallel import distributed
from posttrain.rollout.completions import Completions, cat_rows


@dataclass
class Groups:
    """``B`` groups of ``G`` completions; row ``i*G + j`` is sample ``j`` of prompt ``i``."""

    indices: list[int]  # [B] dataset row of each prompt
    prompt_ids: list[Tensor]  # [N] prompt token ids
    completions: Completions  # [N, T]
    texts: list[str]  # [N]
    rewards: Tensor  # [B, G] the shaped reward that enters the estimator
    terms: dict[str, Tensor]  # reward function name -> [N] its raw value (nan = not applicable)
    correct: Tensor | None  # [N] bool, when the task can check answers
    old_logprobs: Tensor | None = None  # [N, T] under the policy that sampled them
    old_values: Tensor | None = None  # [N, T] PPO's value head at sampling time
    step_rewards: Tensor | None = None  # [N, T] a process reward's step rewards at the tokens where steps end
    step_ends: Tensor | None = None  # [N, T] 1.0 where a step ends; both None when no reward gave steps

    @property
    def group_size(self) -> int:
        return self.rewards.shape[1]

    def select(self, keep: Tensor) -> "Groups":
        """The groups where ``keep`` [B] is True."""
        g = self.group_size
        rows = torch.nonzero(keep.repeat_interleave(g)).flatten()
        comp = self.completions
        return Groups(
            [i for i, k in zip(self.indices, keep.tolist()) if k],
            [self.prompt_ids[int(r)] for r in rows],
            comp.rows(rows),
            [self.texts[int(r)] for r in rows],
            self.rewards[keep],
            {k: v[rows] for k, v in self.terms.items()},
            None if self.correct is None else self.correct[rows],
            None if self.old_logprobs is None else self.old_logprobs[rows],
            None if self.old_values is None else self.old_values[rows],
            None if self.step_rewards is None else self.step_rewards[rows],
            None if self.step_ends is None else self.step_ends[rows],
        )

    @staticmethod
    def cat(parts: list["Groups"]) -> "Groups":
        return Groups(
            sum((p.indices for p in parts), []),
            sum((p.prompt_ids for p in parts), []),
            Completions.cat([p.completions for p in parts]),
            sum((p.texts for p in parts), []),
            cat_rows([p.rewards for p in parts]),
            {k: cat_rows([p.terms[k] for p in parts]) for k in parts[0].terms},
            cat_rows([p.correct for p in parts]),
            cat_rows([p.old_logprobs for p in parts]),
            cat_rows([p.old_values for p in parts]),
            cat_rows(steps_or_zeros(parts, "step_rewards")),
            cat_rows(steps_or_zeros(parts, "step_ends")),
        )

    def pick(self, sample: Tensor) -> "Groups":
        """One sample per group, ``sample`` [B] its index within the group: a batch with G = 1."""
        rows = torch.arange(len(sample)) * self.group_size + sample
        comp = self.completions
        return Groups(
            list(self.indices),
            [self.prompt_ids[int(r)] for r in rows],
            comp.rows(rows),
            [self.texts[int(r)] for r in rows],
            self.rewards.gather(1, sample.unsqueeze(1)),
            {k: v[rows] for k, v in self.terms.items()},
            None if self.correct is None else self.correct[rows],
            None if self.old_logprobs is None else self.old_logprobs[rows],
            None if self.old_values is None else self.old_values[rows],
            None if self.step_rewards is None else self.step_rewards[rows],
            None if self.step_ends is None else self.step_ends[rows],
        )

    def split(self, count: int) -> tuple["Groups", "Groups | None"]:
        """The first ``count`` groups and the rest (None when nothing is left)."""
        b = self.rewards.shape[0]
        head = torch.arange(b) < count
        return self.select(head), (self.select(~head) if count < b else None)

    def shard(self) -> "Groups | None":
        """This process's contiguous share of the groups (None when it is empty)."""
        keep = torch.zeros(len(self.indices), dtype=torch.bool)
        keep[distributed.shard(range(len(self.indices)))] = True
        return self.select(keep) if keep.any() else None


def steps_or_zeros(parts: list[Groups], name: str) -> list[Tensor | None]:
    """Each part's ``step_rewards`` or ``step_ends``, zeros for a part without (a round in which no reward gave
    steps) when another part has them; all None when none has."""
    if all(getattr(p, name) is None for p in parts):
        return [None] * len(parts)
    return [getattr(p, name) if getattr(p, name) is not None else torch.zeros(p.completions.mask.shape)
            for p in parts]


def token_char_ends(tokenizer: Any, ids: list[int]) -> list[int]:
    """For each token of ``ids``, the length of the decoded text up to and including it (special tokens
    decode to nothing). Tokens are decoded one by one when their pieces join into the whole text; otherwise
    (a character split over byte-level tokens) each prefix is decoded."""
    pieces = [tokenizer.decode([i], skip_special_tokens=True) for i in ids]
    if "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True):
        return list(itertools.accumulate(len(piece) for piece in pieces))
    return [len(tokenizer.decode(ids[:k + 1], skip_special_tokens=True)) for k in range(len(ids))]


def step_tensors(tokenizer: Any, completion_ids: Tensor, mask: Tensor,
                 steps: list[list[tuple[int, float]]]) -> tuple[Tensor, Tensor]:
    """([N, T] step rewards, [N, T] 1.0 where a step ends): each ``(end, reward)`` of ``steps`` (a character
    offset into row i's decoded completion) placed on the token holding character ``end - 1``, or, when that
    token is not the policy's (a tool's output in a multi-turn episode), on the policy's last token before it.
    Two steps ending on one token add up; a step with no policy token at or before it is dropped."""
    rewards = torch.zeros(mask.shape)
    ends = torch.zeros(mask.shape)
    for i, row in enumerate(steps):
        if not row:
            continue
        char_ends = token_char_ends(tokenizer, completion_ids[i].tolist())
        scored = mask[i].bool().tolist()
        for end, reward in row:
            t = bisect.bisect_left(char_ends, end)  # the first token whose text reaches character end - 1
            while t >= 0 and (t >= len(scored) or not scored[t]):
                t -= 1
            if t >= 0:
                rewards[i, t] += reward
                ends[i, t] = 1.0
    return rewards, ends
