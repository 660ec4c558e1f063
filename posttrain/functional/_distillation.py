"""Distillation over the whole vocabulary (GKD's generalised Jensen-Shannon divergence), and the moving average
of weights that self-distillation's teacher is.

`generalized_jsd` (GKD, Agarwal et al. 2024, arXiv:2306.13649, eq. (1)) compares the teacher's and
the student's next-token distributions at each position:

    JSD(beta) = beta * KL(T || M) + (1 - beta) * KL(S || M),   M = beta * T + (1 - beta) * S

beta = 0 and beta = 1 are the limits GKD (and TRL) use: the forward KL(T || S) and the reverse
KL(S || T). Both distributions are softmax(logits / temperature). Unlike on-policy distillation's
per-token advantage (`distillation_advantages`, one sampled token), this needs both models' logits
over the vocabulary.

`ema_weights` is SDFT's teacher update (Shenfeld et al. 2026, arXiv:2601.19897, Algorithm 1): the teacher is the
policy itself, its weights an exponential moving average of the policy's, ``phi <- (1 - rate) phi + rate theta``
after each step. ``rate = 0`` keeps the starting weights (TRL's ``teacher_model_kind='base'``), ``rate = 1`` is the
current policy (``'live'``). The self-distillation advantage itself is `distillation_advantages`, with the teacher's
log-probs taken after the privileged prompt.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._checks import check_ndim, check_same_shape, check_unit_interval, compute_dtype


def generalized_jsd(student_logits: Tensor, teacher_logits: Tensor, *, beta: float = 0.5,
                    temperature: float = 1.0) -> Tensor:
    """[M] the generalised JSD between teacher and student at each of M positions.

    Args:
        student_logits: [M, V] the student's logits (with grad).
        teacher_logits: [M, V] the teacher's, over the same vocabulary.
        beta: in [0, 1]: 0 the forward KL(T || S), 1 the reverse KL(S || T), 0.5 the symmetric JSD.
        temperature: > 0, divides both models' logits.

    Returns:
        [M] divergences in nats (float32 at least).
    """
    check_ndim("student_logits", student_logits, 2, "[M, V]")
    check_same_shape(student_logits=student_logits, teacher_logits=teacher_logits)
    check_unit_interval("beta", beta)
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    dtype = compute_dtype(student_logits, teacher_logits)
    student = (student_logits.to(dtype) / temperature).log_softmax(-1)
    teacher = (teacher_logits.to(dtype).detach() / temperature).log_softmax(-1)

    def kl(p: Tensor, q: Tensor) -> Tensor:  # KL(P || Q) from log-probs, 0 log 0 = 0
        return (p.exp() * (p - q)).nan_to_num(0.0).sum(-1)

    if beta == 0:
        return kl(teacher, student)
    if beta == 1:
        return kl(student, teacher)
    mixture = torch.logsumexp(torch.stack([teacher + math.log(beta), student + math.log1p(-beta)]), 0)
    return beta * kl(teacher, mixture) + (1 - beta) * kl(student, mixture)


def ema_weights(teacher: Tensor, policy: Tensor, *, rate: float) -> Tensor:
    """SDFT's teacher weights after one step: ``(1 - rate) * teacher + rate * policy`` (arXiv:2601.19897, Alg. 1).

    Args:
        teacher: [*] one of the teacher's weight tensors.
        policy: [*] the policy's weight of the same name (no gradient flows to it).
        rate: in [0, 1]: 0 keeps the teacher, 1 copies the policy.

    Returns:
        [*] the new teacher weight, in the teacher's dtype.
    """
    check_same_shape(teacher=teacher, policy=policy)
    check_unit_interval("rate", rate)
    dtype = compute_dtype(teacher, policy)
    # phi + rate (theta - phi); torch.lerp computes it from the nearer end, so rate 0 and 1 give each end exactly
    return torch.lerp(teacher.to(dtype), policy.detach().to(dtype), rate).to(teacher.dtype)
