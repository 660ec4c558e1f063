"""The optimizer and its guarded step, shared by the trainers.

``build_optimizer``: AdamW with a linear learning-rate warm-up, then a constant,
linear or cosine schedule (``lr_multiplier``) that reaches 0 after ``total_steps``.
``apply_gradients``: sum the accumulated gradient over processes (a no-op in
one process; see ``posttrain.parallel.distributed``), clip it to ``max_grad_norm`` and
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

from posttrain.config import OptimConfig
from posttrain.parallel import distributed, fsdp
from posttrain.parallel.offload import OffloadedAdamW


def lr_multiplier(step: int, *, warmup_steps: int, total_steps: int, schedule: str = "constant") -> float:
    """The learning rate of optimizer step ``step`` (0-based) as a fraction of the configured one.

    Warm-up: ``(step + 1) / (warmup_steps + 1)`` for ``step < warmup_steps``.
    After it, with ``p = (step - warmup_steps) / (total_steps - warmup_steps)``:
    constant 1; linear ``1 - p``; cosine ``(1 + cos(pi * p)) / 2``. The last
    step (``total_steps - 1``) still has a positive rate, as in transformers'
    schedulers: no step is wasted at zero.
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "linear":
        return 1.0 - progress
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"lr_schedule: unknown schedule {schedule!r}; use constant, linear or cosine")


def build_optimizer(params: Iterable[torch.nn.Parameter], optim: OptimConfig, total_steps: int):
    """(AdamW, LambdaLR) following :func:`lr_multiplier` over ``total_steps`` optimizer steps.

    The scheduler advances once per optimizer step (PPO's epochs and mini-batches
    count), so callers pass the run's optimizer steps, not its training steps.
    """
    params = list(params)
    # The fused kernel: one pass over each tensor instead of a dozen foreach passes, a much faster
    # optimizer step on a CPU (benchmarks/RESULTS.md); transformers' Trainer uses it too.
    # It refuses FSDP's sharded parameters beside plain step counters: those keep foreach.
    fused = not any(fsdp.is_sharded_parameter(p) for p in params)
    adamw = OffloadedAdamW if optim.offload_optimizer else torch.optim.AdamW  # fsdp.check refuses FSDP + offload
    optimizer = adamw(params, lr=optim.learning_rate, weight_decay=optim.weight_decay, fused=fused or None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(
        step, warmup_steps=optim.warmup_steps, total_steps=total_steps, schedule=optim.lr_schedule))
    return optimizer, scheduler


def apply_gradients(optimizer: torch.optim.Optimizer, scheduler, optim: OptimConfig,
                    bad_steps: int) -> tuple[float, int]:
    """Sum the accumulated gradient over processes, then clip and apply it, or drop it when non-finite.

    ``bad_steps`` counts the consecutive skipped steps before this one; returns
    (the gradient norm before clipping, the updated count). Raises FloatingPointError
    when the count reaches ``optim.max_bad_steps``.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    replicated = [p for p in params if not fsdp.is_sharded_parameter(p)]  # FSDP units reduced their own
    distributed.sum_gradients(replicated)  # every process then holds the same gradient and takes the same step
    if len(replicated) < len(params):
        grad_norm = fsdp.grad_norm_and_clip(params, optim.max_grad_norm)
    else:
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
