"""The passes of frozen models over a step's samples: the reference's, and distillation's teachers'.

On-policy distillation scores the student's samples under a teacher: one ``--teacher`` model after the
student's prompt, each row's own task's teacher (``multi_teacher_distill``), or the policy's moving-average
copy after the row's prompt with its privileged context (``sdft``). This module holds those passes, the
reverse KL they log, and sdft's teacher update, so that :mod:`posttrain.training.online`'s step reads
``teacher_logprobs`` where it needs them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

import posttrain.functional as F
from posttrain.config import OptimConfig
from posttrain.models.logprobs import batched_logprobs
from posttrain.parallel import distributed, fsdp, offload
from posttrain.training.groups import Groups

if TYPE_CHECKING:
    from posttrain.training.session import OnlineSession


def passes(optim: OptimConfig) -> dict[str, Any]:
    """How the forward passes are cut and run (micro-batches, prompt sharing, padding): the settings."""
    return dict(micro_batch_size=optim.micro_batch_size, max_tokens_per_micro_batch=optim.max_tokens_per_micro_batch,
                share_prompts=optim.share_prompts, trim_padding=optim.trim_padding)


def frozen_logprobs(s: OnlineSession, groups: Groups, model: Any, prompt_ids: list[Tensor] | None = None) -> Tensor:
    """[N, T] a frozen model's (the reference's, a teacher's) log-probs of the groups' tokens, after their prompts
    (or the given ``prompt_ids`` [N]: a self-distilling teacher's)."""
    comp = groups.completions
    prompts = groups.prompt_ids if prompt_ids is None else prompt_ids
    with offload.resident(model):
        logprobs, _ = batched_logprobs(model, prompts, comp.completion_ids, comp.mask, pad_id=s.pad_id,
                                       temperature=s.config.rollout.temperature, present=comp.present,
                                       images=comp.images, **passes(s.config.optim))
    return logprobs


def teacher_logprobs(s: OnlineSession, groups: Groups) -> Tensor:
    """[N, T] the teacher's log-probs of the groups' tokens: a --teacher model after the student's prompt,
    each row's own task's teacher (multi-teacher distillation), or (sdft) the policy's moving-average copy
    after each row's prompt with its privileged context."""
    if s.task_teachers is not None:
        return task_teacher_logprobs(s, groups, teacher_tasks(s, groups))
    if s.teacher_prompts is None:
        return frozen_logprobs(s, groups, s.teacher)
    prompts = [s.teacher_prompts[i] for i in groups.indices for _ in range(groups.group_size)]
    return frozen_logprobs(s, groups, s.teacher, prompts)


def teacher_tasks(s: OnlineSession, groups: Groups) -> list[str] | None:
    """[B] each group's task, whose teacher scores it (multi-teacher distillation); None with one teacher."""
    return None if s.row_tasks is None else [s.row_tasks[i] for i in groups.indices]


def task_teacher_logprobs(s: OnlineSession, groups: Groups, tasks: list[str]) -> Tensor:
    """[N, T] each row's log-probs under its own task's teacher, ``tasks`` [B] the task of each group: every
    teacher scores only its own groups' rows (one pass of each over its share, not every teacher over all),
    and the parts are put back in the rows they came from."""
    logprobs = torch.zeros(groups.completions.mask.shape)
    for task, teacher in s.task_teachers.items():
        mine = torch.tensor([t == task for t in tasks], dtype=torch.bool)
        if mine.any():
            logprobs[mine.repeat_interleave(groups.group_size)] = frozen_logprobs(s, groups.select(mine), teacher)
    return logprobs


def reverse_kl_metrics(groups: Groups, teacher: Tensor, tasks: list[str] | None) -> dict[str, float]:
    """``distill/reverse_kl``: the k1 reverse KL to the teacher the step starts from, sum_t (log pi_student -
    log pi_teacher) over the sampled tokens / tokens, over every process's rows; with ``tasks`` [B] (the task of
    each group: multi-teacher distillation), the same over each task's rows, ``distill/reverse_kl/<task>``."""
    mask = groups.completions.mask
    kl_N = ((groups.old_logprobs - teacher) * mask).sum(-1)
    tokens_N = mask.sum(-1).float()
    sums = {"kl": float(kl_N.sum()), "tokens": float(tokens_N.sum())}
    for task in dict.fromkeys(tasks or ()):  # a process reports the tasks it holds; the reduction joins them
        mine = torch.tensor([t == task for t in tasks], dtype=torch.bool).repeat_interleave(groups.group_size)
        sums[f"kl/{task}"], sums[f"tokens/{task}"] = float(kl_N[mine].sum()), float(tokens_N[mine].sum())
    sums = distributed.reduce_values(sums)
    out = {"distill/reverse_kl": sums["kl"] / max(sums["tokens"], 1.0)}
    for key in sums:
        if key.startswith("kl/"):
            task = key.removeprefix("kl/")
            out[f"distill/reverse_kl/{task}"] = sums[key] / max(sums[f"tokens/{task}"], 1.0)
    return out


def move_self_teacher(s: OnlineSession) -> None:
    """SDFT's teacher follows the policy after every step, ``phi <- (1 - rate) phi + rate theta``
    (F.ema_weights); a rate of 0 leaves it at the starting weights."""
    rate = s.alg.self_teacher_ema
    if not rate:
        return
    state = fsdp.full_state_dict(s.policy)  # every process gathers; each moves its own copy the same way
    with torch.no_grad(), offload.resident(s.teacher, write=True):
        for name, weight in s.teacher.named_parameters():  # each tied weight once
            weight.copy_(F.ema_weights(weight, state[name].to(weight.device), rate=rate))
