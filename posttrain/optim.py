"""The optimizer and its guarded step, shared by the trainers.

``build_optimizer``: AdamW with a linear learning-rate warm-up, then constant.
``apply_gradients``: sum the accumulated gradient over processes (a no-op in
one process; see ``posttrain.distributed``), clip it to ``max_grad_norm`` and
apply it, unless its norm is non-finite (a NaN/inf loss or gradient): then the
step is skipped (the gradient is dropped, the weights and AdamW's moments stay
as they were), and ``max_bad_steps`` consecutive skips stop the run. The
scheduler advances either way, so the learning-rate schedule follows the step
count.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from posttrain import distributed
from posttrain.config import OptimConfig


def build_optimizer(params: Iterable[torch.nn.Parameter], optim: OptimConfig):
    """(AdamW, LambdaLR): lr rises linearly over ``warmup_steps``, then stays at ``learning_rate``."""
    optimizer = torch.optim.AdamW(params, lr=optim.learning_rate, weight_decay=optim.weight_decay)
    warmup = optim.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: min(1.0, (k + 1) / (warmup + 1)))
    return optimizer, scheduler


def apply_gradients(optimizer: torch.optim.Optimizer, scheduler, optim: OptimConfig,
                    bad_steps: int) -> tuple[float, int]:
    """Sum the accumulated gradient over processes, then clip and apply it, or drop it when non-finite.

    ``bad_steps`` counts the consecutive skipped steps before this one; returns
    (the gradient norm before clipping, the updated count). Raises FloatingPointError
    when the count reaches ``optim.max_bad_steps``.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    distributed.sum_gradients(params)  # every process then holds the same gradient and takes the same step
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, optim.max_grad_norm or math.inf))
    if math.isfinite(grad_norm):
        optimizer.step()
        bad_steps = 0
    else:
        bad_steps += 1
        if bad_steps >= optim.max_bad_steps:
            raise FloatingPointError(
                f"{bad_steps} consecutive optimizer steps had a non-finite gradient norm ({grad_norm}); "
                "stopping with the last good checkpoint intact. Lower learning_rate or check the data and rewards."
            )
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return grad_norm, bad_steps
