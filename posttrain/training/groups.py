"""The batch of an online step: ``B`` groups of ``G`` completions with their rewards, and the ways the
loop splits, filters and joins them (dynamic sampling's refills, best-of-N, processes' shares)."""

from __future__ import annotations

from dataclasses import dataclass

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
