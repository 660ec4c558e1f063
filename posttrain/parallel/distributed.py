"""Data parallelism over processes: every process holds the whole model and trains on its share.

Launched by ``torchrun`` or ``accelerate launch`` (both set ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``), ``init`` joins the process group:
NCCL on GPUs, process ``LOCAL_RANK`` on GPU ``LOCAL_RANK``; gloo on CPUs. Without these
variables every collective here returns its input untouched, ``shard`` returns everything, and
a run is the plain single-process run, bit for bit.

How the trainers use it (docs/decisions.md, "Multi-process training"):

1. Every process draws the same prompt (or pair) order and takes a contiguous share of each
   step's draw (``shard``): a prompt's group never spans processes. The offline trainers (SFT,
   preference, reward model), whose examples' lengths are known before the step, split the draw
   by length instead (``balanced_shard``, Karmarkar-Karp), near-equal tokens on every process.
2. The loss is normalised by the whole step's token or sequence count (``all_sum``) and the
   gradients are summed over processes once per optimizer step (``sum_gradients``), so the
   update is the one a single process makes on the whole batch. This is DDP's all-reduce with
   ``no_sync`` on every micro-batch but the last, without wrapping the model: a process may
   hold fewer groups than another, or none (dynamic sampling, skipped rewards), and generation,
   the reference copy and checkpoints use the plain model.
3. Metrics are reduced over processes (``gather``, ``reduce_values``); only rank 0 writes the
   run directory and evaluates (``on_main``), the others wait for its result.
4. FSDP (``posttrain.parallel.fsdp``, ``--fsdp`` or an accelerate FSDP config) shards the policy over the
   same processes and keeps 1-3. DeepSpeed, Megatron-LM and tensor parallelism (an
   ``accelerate config`` may ask for them) are refused.
"""

from __future__ import annotations

import atexit
import os
import pickle
import sys
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from posttrain.config import ConfigError

T = TypeVar("T")

# Rank 0 evaluates and saves while the others wait in a collective: allow it an hour.
TIMEOUT = timedelta(hours=1)
BUCKET_BYTES = 128 << 20  # gradients are summed in flat buffers of at most this size
_UNSUPPORTED = {  # what `accelerate launch` sets when its config asks for a sharded engine
    "ACCELERATE_USE_DEEPSPEED": "DeepSpeed",
    "ACCELERATE_USE_MEGATRON_LM": "Megatron-LM",
    "ACCELERATE_USE_PARALLELISM_CONFIG": "tensor/context parallelism",
}


def world_size() -> int:
    """Processes in the run: the process group's size, else ``WORLD_SIZE`` (1 when unset)."""
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    """This process's index, 0 to ``world_size() - 1``."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def is_main() -> bool:
    """Rank 0: the process that writes the run directory and evaluates."""
    return rank() == 0


def say(message: str) -> None:
    """A progress line on stderr, from rank 0 only."""
    if is_main():
        print(f"[posttrain] {message}", file=sys.stderr, flush=True)


def init(device: str) -> None:
    """Join the process group when launched with several processes (idempotent)."""
    if world_size() == 1 or dist.is_initialized():
        return
    for variable, engine in _UNSUPPORTED.items():
        if os.environ.get(variable, "").lower() == "true":
            raise ConfigError(
                f"{engine}: posttrain trains data-parallel, with or without FSDP; choose 'multi-GPU' or "
                f"FSDP in `accelerate config`, or launch with torchrun ({variable} is set)"
            )
    cuda = device != "cpu" and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=TIMEOUT)
    atexit.register(dist.destroy_process_group)


def seed(base: int) -> None:
    """Seed torch with ``base + rank``: each process samples its own completions."""
    torch.manual_seed(base + rank())


def shard(items: Sequence[T]) -> list[T]:
    """This process's contiguous share of ``items`` (all of them in a single process)."""
    n, w, r = len(items), world_size(), rank()
    return list(items[r * n // w:(r + 1) * n // w])


def balanced_partition(costs: Sequence[int], parts: int) -> list[list[int]]:
    """The positions of ``costs`` split into ``parts`` sets of near-equal total cost: Karmarkar and Karp's
    largest differencing method, ``parts``-way. Each item starts as a partition with the item alone in
    one set; the two partitions with the largest spread (largest set minus smallest) are merged, the
    first's largest set with the second's smallest, until one is left. Deterministic (ties by position),
    so every process computes the same split; each set's positions ascending, the sets in the order of
    their first position (a set may be empty only when there are fewer items than parts)."""
    import heapq

    if parts <= 1:
        return [list(range(len(costs)))]
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for i, cost in enumerate(costs):
        sets = [(int(cost), [i])] + [(0, []) for _ in range(parts - 1)]
        heapq.heappush(heap, (-int(cost), i, sets))
    while len(heap) > 1:
        _, order, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        merged = sorted(((a[0] + b[0], a[1] + b[1]) for a, b in zip(first, reversed(second))),
                        key=lambda s: -s[0])
        heapq.heappush(heap, (merged[-1][0] - merged[0][0], order, merged))
    sets = [sorted(rows) for _, rows in heap[0][2]] if heap else [[] for _ in range(parts)]
    return sorted(sets, key=lambda rows: rows[0] if rows else len(costs))


def balanced_shard(items: Sequence[T], costs: Sequence[int]) -> tuple[list[T], Tensor]:
    """This process's share of ``items``, balanced by ``costs`` over the processes
    (:func:`balanced_partition`), and the index [len(items)] that puts every process's rows, gathered in
    rank order (:func:`gather_rows`), back in the order of ``items``. One process: all of them, in order.
    Where the balance would leave a process nothing, the contiguous :func:`shard`."""
    w = world_size()
    sets = balanced_partition(costs, w)
    if any(not rows for rows in sets):
        sets = [list(range(r * len(items) // w, (r + 1) * len(items) // w)) for r in range(w)]
    order = torch.tensor([k for rows in sets for k in rows], dtype=torch.long)
    return [items[k] for k in sets[rank()]], order.argsort()


def gather(obj: T) -> list[T]:
    """Every process's ``obj`` (picklable; tensors on the CPU), in rank order."""
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def concat(items: list[T]) -> list[T]:
    """Every process's ``items``, concatenated in rank order."""
    if world_size() == 1:
        return items
    return [item for part in gather(items) for item in part]


def gather_rows(x: Tensor) -> Tensor:
    """Every process's rows of ``x`` [n, ...], concatenated in rank order, on ``x``'s device."""
    if world_size() == 1:
        return x
    return torch.cat(gather(x.cpu())).to(x.device)


def reduce_values(values: dict[str, float], combine: Callable[[Iterable[float]], float] = sum) -> dict[str, float]:
    """Each value combined (``sum``, ``max``) over the processes that report it."""
    if world_size() == 1:
        return values
    parts = gather(values)
    names = dict.fromkeys(name for part in parts for name in part)
    return {name: combine(part[name] for part in parts if name in part) for name in names}


def all_sum(x: Tensor) -> Tensor:
    """``x`` summed over processes (``x`` itself in a single process)."""
    if world_size() == 1:
        return x
    total = x.to(_collective_device(), copy=True)
    dist.all_reduce(total)
    return total.to(x.device)


def any_true(flag: bool) -> bool:
    """Whether ``flag`` holds on any process."""
    if world_size() == 1:
        return flag
    return bool(all_sum(torch.tensor(float(flag))) > 0)


def on_main(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run ``fn`` on rank 0 only; every process returns its result, or raises its error."""
    if world_size() == 1:
        return fn(*args, **kwargs)
    outcome: list[Any] = [None]
    error = None
    if is_main():
        try:
            outcome = [(fn(*args, **kwargs), None)]
        except Exception as caught:  # raised on every process, so none waits forever
            error = caught
            outcome = [(None, _portable(caught))]
    dist.broadcast_object_list(outcome, src=0)
    value, failure = outcome[0]
    if error is not None:
        raise error
    if failure is not None:
        raise failure
    return value


def broadcast_parameters(params: Iterable[torch.nn.Parameter]) -> None:
    """Rank 0's values of ``params`` on every process (a random initialisation may differ)."""
    if world_size() == 1:
        return
    with torch.no_grad():
        for p in params:
            if type(p.data) is torch.Tensor:  # FSDP's shards (DTensor) are each process's own by design
                dist.broadcast(p.data, src=0)


def sum_gradients(params: Sequence[torch.nn.Parameter]) -> None:
    """Sum each parameter's gradient over processes, in place; a parameter that got no gradient on
    any process keeps none (AdamW skips it, as in one process)."""
    if world_size() == 1:
        return
    got = all_sum(torch.tensor([p.grad is not None for p in params], dtype=torch.float32)) > 0
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    for bucket in _buckets(grads):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat)
        for grad, summed in zip(bucket, flat.split([g.numel() for g in bucket])):
            grad.copy_(summed.view_as(grad))
    for p, grad, keep in zip(params, grads, got.tolist()):
        p.grad = grad if keep else None


def _portable(error: Exception) -> Exception:
    """``error`` if it survives pickling (to be raised on the other processes), else a RuntimeError naming it."""
    try:
        return pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(f"rank 0 failed: {error!r}")


def _buckets(tensors: list[Tensor]) -> list[list[Tensor]]:
    """Consecutive tensors of one dtype and device, at most ``BUCKET_BYTES`` per bucket."""
    buckets: list[list[Tensor]] = []
    size = 0
    for t in tensors:
        bytes_ = t.numel() * t.element_size()
        last = buckets[-1] if buckets else None
        if last is None or (t.dtype, t.device) != (last[0].dtype, last[0].device) or size + bytes_ > BUCKET_BYTES:
            buckets.append([])
            size = 0
        buckets[-1].append(t)
        size += bytes_
    return buckets


def _collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
