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
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from posttrain.data import isolation

RewardFn = Callable[..., list]


class RewardError(RuntimeError):
    """A reward function failed or returned something unusable."""


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
    n = len(completions)
    try:
        returned = _call(fn, prompts, completions, columns, policy.timeout)
    except isolation.CallFailed as whole:
        return _score_one_by_one(fn, name, prompts, completions, columns, policy, whole.detail)
    if not _has_length(returned, n):  # the batch is wrong, not one sample: say so, whatever the policy
        raise RewardError(f"reward function {name!r} returned {_describe_count(returned)} for {n} completions; "
                          "it must return one value (or None) per completion")
    values, problems = _checked(returned)
    failed = torch.zeros(n, dtype=torch.bool)
    for i, problem in problems.items():
        _fail_or_skip(policy, name, i, prompts, completions, problem)
        failed[i] = True
    return values, failed


def _score_one_by_one(fn: RewardFn, name: str, prompts: list, completions: list, columns: dict[str, list],
                      policy: RewardPolicy, batch_failure: str) -> tuple[Tensor, Tensor]:
    """The call on the whole batch raised or timed out: retry one sample at a time to find which fail."""
    values = torch.full((len(completions),), math.nan, dtype=torch.float64)
    failed = torch.zeros(len(completions), dtype=torch.bool)
    for i in range(len(completions)):
        one = {k: v[i:i + 1] for k, v in columns.items()}
        try:
            returned = _call(fn, prompts[i:i + 1], completions[i:i + 1], one, policy.timeout)
            problem = None if _has_length(returned, 1) else f"returned {_describe_count(returned)} for 1 completion"
        except isolation.CallFailed as error:
            problem = error.detail
        if problem is None:
            value, problems = _checked(returned)
            values[i], problem = value[0], problems.get(0)
        if problem is not None:
            _fail_or_skip(policy, name, i, prompts, completions, problem)
            failed[i] = True
    if policy.on_error == "error":  # every sample passes alone: the batch call itself is wrong
        raise RewardError(f"reward function {name!r} failed on the batch of {len(completions)}: {batch_failure}")
    return values, failed


def _fail_or_skip(policy: RewardPolicy, name: str, i: int, prompts: list, completions: list, problem: str) -> None:
    if policy.on_error == "error":
        raise RewardError(f"reward function {name!r} failed on sample {i}\n  prompt: {prompts[i]!r}\n"
                          f"  completion: {completions[i]!r}\n{problem}")


def _has_length(values: Any, expected: int) -> bool:
    return values is not None and hasattr(values, "__len__") and len(values) == expected


def _describe_count(values: Any) -> str:
    if values is None:
        return "None"
    return f"{len(values)} values" if hasattr(values, "__len__") else f"{type(values).__name__} {values!r}"


def _checked(values: Sequence[Any]) -> tuple[Tensor, dict[int, str]]:
    """(float64 values, nan for None and for unusable ones; sample index -> what is wrong with its value).

    Only numbers are rewards: a string, even "0.5", is a bug in the function, and NaN or inf is a failure
    (None is the way to say "not applicable")."""
    out = torch.full((len(values),), math.nan, dtype=torch.float64)
    problems: dict[int, str] = {}
    for i, value in enumerate(values):
        if isinstance(value, Tensor) and value.numel() == 1:
            value = value.item()
        if value is None:
            continue
        if not isinstance(value, numbers.Real):
            problems[i] = f"returned {type(value).__name__} {value!r}; return a number, or None for 'not applicable'"
        elif not math.isfinite(value):
            problems[i] = f"returned {float(value)}; return None for 'not applicable'"
        else:
            out[i] = float(value)
    return out, problems


def _call(fn: RewardFn, prompts: list, completions: list, columns: dict[str, list], timeout: float) -> Any:
    kwargs = {"prompts": prompts, "completions": completions, **columns}
    return isolation.call(fn, kwargs, timeout=timeout, limit_name="reward_timeout", convert=_as_list)


def _as_list(result: Any) -> Any:
    """A reward's values as a list (a generator or an array pickled whole), None as it is."""
    return None if result is None else list(result)
