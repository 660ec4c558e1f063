"""Scoring completions with reward functions (TRL's signature), isolated when asked.

A reward function is ``fn(prompts, completions, **columns) -> list[float | None]``.
``None`` means "not applicable" to that sample: the weighted sum skips it (as in
TRL). A reward that raises, times out, returns NaN/inf or the wrong number of
values is never turned into a number. What happens is the ``on_error`` policy:

- ``error``: stop with the failing prompt, completion and traceback;
- ``skip``: mark the sample failed (the loop drops its whole group) and count it.

A call that fails as a whole is retried sample by sample, so the failure is
pinned on the sample that caused it. With ``timeout > 0`` every call runs in a
forked worker process that is killed at the limit (a hung reward cannot hang
the run); with ``timeout == 0`` calls run in-process (cheap, the default for
pure-Python rewards).
"""

from __future__ import annotations

import math
import multiprocessing
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

RewardFn = Callable[..., list]


class RewardError(RuntimeError):
    """A reward function failed or returned something unusable."""


class _CallFailed(Exception):
    """One reward call failed; ``detail`` says how (a traceback, a timeout, a bad value)."""

    def __init__(self, detail: str):
        super().__init__(detail)
        self.detail = detail


@dataclass(frozen=True)
class RewardPolicy:
    timeout: float = 0.0  # seconds per call; > 0 runs each call in a forked worker process
    on_error: str = "error"  # "error" | "skip"

    def __post_init__(self) -> None:
        if self.on_error not in ("error", "skip"):
            raise ValueError(f"reward_errors: got {self.on_error!r}; use error or skip")
        if self.timeout < 0:
            raise ValueError(f"reward_timeout: got {self.timeout}; use 0 (in-process) or a number of seconds")


def reward_name(fn: RewardFn) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


@dataclass
class Scores:
    total: Tensor  # [N] weighted sum over the applicable functions (0 where failed)
    terms: dict[str, Tensor]  # function name -> [N] its own value, nan where not applicable or failed
    failed: Tensor  # [N] bool: some reward function failed on this sample (skip policy only)
    failures: dict[str, int]  # function name -> failed samples


def score(
    reward_fns: Sequence[RewardFn],
    weights: Sequence[float],
    prompts: list[Any],
    completions: list[Any],
    columns: dict[str, list[Any]],
    policy: RewardPolicy = RewardPolicy(),
) -> Scores:
    """Run every reward function on ``N`` completions and combine them with their weights."""
    n = len(completions)
    terms: dict[str, Tensor] = {}
    failures: dict[str, int] = {}
    total = torch.zeros(n, dtype=torch.float64)
    applicable = torch.zeros(n, dtype=torch.bool)
    failed = torch.zeros(n, dtype=torch.bool)
    for fn, weight in zip(reward_fns, weights):
        name = reward_name(fn)
        values, bad = _score_one(fn, name, prompts, completions, columns, policy)
        terms[name], failures[name] = values, int(bad.sum())
        present = ~values.isnan()
        total += torch.where(present, weight * values, torch.zeros_like(values))
        applicable |= present
        failed |= bad
    missing = ~applicable & ~failed
    if missing.any():
        i = int(missing.nonzero()[0])
        raise RewardError(
            f"every reward function returned None for sample {i} (prompt {prompts[i]!r}, "
            f"completion {completions[i]!r}); at least one must apply to each completion"
        )
    return Scores(total.float(), {k: v.float() for k, v in terms.items()}, failed, failures)


def _score_one(fn: RewardFn, name: str, prompts: list, completions: list, columns: dict[str, list],
               policy: RewardPolicy) -> tuple[Tensor, Tensor]:
    """([N] values, nan where None or failed; [N] bool failed)."""
    try:
        return _checked(_call(fn, prompts, completions, columns, policy.timeout), len(completions)), \
            torch.zeros(len(completions), dtype=torch.bool)
    except _CallFailed as whole:
        batch_failure = whole.detail
    # Retry one sample at a time to find which samples fail.
    values = torch.full((len(completions),), math.nan, dtype=torch.float64)
    failed = torch.zeros(len(completions), dtype=torch.bool)
    for i in range(len(completions)):
        one = {k: v[i:i + 1] for k, v in columns.items()}
        try:
            values[i] = _checked(_call(fn, prompts[i:i + 1], completions[i:i + 1], one, policy.timeout), 1)[0]
        except _CallFailed as error:
            if policy.on_error == "error":
                raise RewardError(f"reward function {name!r} failed on sample {i}\n  prompt: {prompts[i]!r}\n"
                                  f"  completion: {completions[i]!r}\n{error.detail}") from None
            failed[i] = True
    if policy.on_error == "error":  # every sample passes alone: the batch call itself is wrong
        raise RewardError(f"reward function {name!r} failed on the batch of {len(completions)}: {batch_failure}")
    return values, failed


def _checked(values: Any, expected: int) -> Tensor:
    if values is None or not hasattr(values, "__len__") or len(values) != expected:
        got = "None" if values is None else (f"{len(values)} values" if hasattr(values, "__len__") else repr(values))
        raise _CallFailed(f"returned {got} for {expected} completions")
    out = torch.empty(expected, dtype=torch.float64)
    for i, value in enumerate(values):
        if value is None:
            out[i] = math.nan
            continue
        value = float(value)
        if not math.isfinite(value):
            raise _CallFailed(f"returned {value} for sample {i}; return None for 'not applicable'")
        out[i] = value
    return out


def _call(fn: RewardFn, prompts: list, completions: list, columns: dict[str, list], timeout: float) -> Any:
    kwargs = {"prompts": prompts, "completions": completions, **columns}
    if timeout <= 0:
        try:
            return fn(**kwargs)
        except Exception:
            raise _CallFailed(traceback.format_exc()) from None
    return _call_in_worker(fn, kwargs, timeout)


def _call_in_worker(fn: RewardFn, kwargs: dict[str, Any], timeout: float) -> Any:
    """Run ``fn(**kwargs)`` in a forked child (nothing is pickled but the result); kill it at ``timeout``."""
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    worker = context.Process(target=_worker, args=(fn, kwargs, sender), daemon=True)
    worker.start()
    sender.close()
    try:
        if not receiver.poll(timeout):
            raise _CallFailed(f"timed out after {timeout:g} s (reward_timeout)")
        try:
            ok, payload = receiver.recv()
        except EOFError:
            raise _CallFailed("the worker process died without an answer") from None
    finally:
        if worker.is_alive():
            worker.kill()
        worker.join()
        receiver.close()
    if not ok:
        raise _CallFailed(payload)
    return payload


def _worker(fn: RewardFn, kwargs: dict[str, Any], sender: Any) -> None:
    try:
        result = fn(**kwargs)
        sender.send((True, None if result is None else list(result)))
    except BaseException:
        sender.send((False, traceback.format_exc()))
