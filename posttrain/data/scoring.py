"""Scoring completions with reward functions (TRL's signature), isolated when asked.

A reward function is ``fn(prompts, completions, **columns) -> list[float | StepRewards | None]``.
``None`` means "not applicable" to that sample: the weighted sum skips it (as in
TRL). A :class:`StepRewards` is a process reward: rewards at steps inside the
completion (each at a character offset of its text) and an optional final one;
the trainer places each step's reward on the token where the step ends. A reward that raises, times out, returns NaN/inf or the wrong number of
values is never turned into a number. What happens is the ``on_error`` policy:

- ``error``: stop with the failing prompt, completion and traceback;
- ``skip``: mark the sample failed (the loop drops its whole group) and count it.

A call that fails as a whole is retried sample by sample, so the failure is
pinned on the sample that caused it, unless the function declares
``retry_samples_alone = False`` (a reward service: its failure is the service's,
and asking again per sample would cost every sample the service's retries); then
the batch's samples fail together. With ``timeout > 0`` every call runs in a
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
from posttrain.data.rewards import completion_text

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


@dataclass(frozen=True)
class StepRewards:
    """A process reward for one completion: ``steps`` as ``(end, reward)`` pairs, ``end`` the character offset
    in the completion's text where the step ends (the step's last character is ``text[end - 1]``; steps in
    order), and ``final`` an outcome reward at the completion's end (None: none from this function).

    The trainer gives each step's reward to the token holding the step's last character. Presets with
    token-level returns (ppo, reinforce_pp, reinforce_pp_baseline) add it to that token's reward; grpo and
    dr_grpo use it as DeepSeekMath's process supervision (posttrain.functional.process_advantages)."""

    steps: tuple[tuple[int, float], ...]
    final: float | None = None

    def total(self) -> float:
        """Every reward it gives, summed (what the logs show as the function's value)."""
        return sum(reward for _, reward in self.steps) + (self.final or 0.0)


def reward_name(fn: RewardFn) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


@dataclass
class Scores:
    total: Tensor  # [N] weighted sum over the applicable functions (0 where failed); a StepRewards' final only
    terms: dict[str, Tensor]  # function name -> [N] its own value, nan where not applicable or failed
    failed: Tensor  # [N] bool: some reward function failed on this sample (skip policy only)
    failures: dict[str, int]  # function name -> failed samples
    steps: list[list[tuple[int, float]]] | None = None  # [N] weighted (end, reward) steps; None: no function gave any


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
    steps: list[list[tuple[int, float]]] | None = None
    for fn, weight in zip(reward_fns, weights):
        name = reward_name(fn)
        values, bad, processes = _score_one(fn, name, prompts, completions, columns, policy)
        terms[name], failures[name] = values, int(bad.sum())
        present = ~values.isnan()
        outcome = values.clone()
        for i, process in processes.items():  # the steps go to the tokens; the final alone is the outcome
            steps = steps if steps is not None else [[] for _ in range(n)]
            _check_step_ends(name, i, process, completions[i])
            steps[i] += [(end, weight * reward) for end, reward in process.steps]
            outcome[i] = process.final or 0.0
        total += torch.where(present, weight * outcome, torch.zeros_like(values))
        applicable |= present
        failed |= bad
    missing = ~applicable & ~failed
    if missing.any():
        i = int(missing.nonzero()[0])
        raise RewardError(
            f"every reward function returned None for sample {i} (prompt {prompts[i]!r}, "
            f"completion {completions[i]!r}); at least one must apply to each completion"
        )
    if steps is not None:
        steps = [sorted(row) for row in steps]  # several functions' steps, in text order
    return Scores(total.float(), {k: v.float() for k, v in terms.items()}, failed, failures, steps)


def _check_step_ends(name: str, i: int, process: "StepRewards", completion: Any) -> None:
    """A step must end inside the completion's text (1 <= end <= len(text))."""
    length = len(completion_text(completion))
    bad = [end for end, _ in process.steps if not 1 <= end <= length]
    if bad:
        raise RewardError(f"reward function {name!r} returned a step ending at character {bad[0]} of sample {i}, "
                          f"whose completion has {length} characters; a step's end is an offset in 1..{length}")


def _score_one(fn: RewardFn, name: str, prompts: list, completions: list, columns: dict[str, list],
               policy: RewardPolicy) -> tuple[Tensor, Tensor, dict[int, StepRewards]]:
    """([N] values, nan where None or failed; [N] bool failed; the samples it gave step rewards)."""
    n = len(completions)
    try:
        returned = _call(fn, prompts, completions, columns, policy.timeout)
    except isolation.CallFailed as whole:
        if getattr(fn, "retry_samples_alone", True):
            return _score_one_by_one(fn, name, prompts, completions, columns, policy, whole.detail)
        if policy.on_error == "error":
            raise RewardError(f"reward function {name!r} failed on the batch of {n}:\n{whole.detail}") from None
        return torch.full((n,), math.nan, dtype=torch.float64), torch.ones(n, dtype=torch.bool), {}
    if not _has_length(returned, n):  # the batch is wrong, not one sample: say so, whatever the policy
        raise RewardError(f"reward function {name!r} returned {_describe_count(returned)} for {n} completions; "
                          "it must return one value (or None) per completion")
    values, problems = _checked(returned)
    failed = torch.zeros(n, dtype=torch.bool)
    for i, problem in problems.items():
        _fail_or_skip(policy, name, i, prompts, completions, problem)
        failed[i] = True
    processes = {i: value for i, value in enumerate(returned) if isinstance(value, StepRewards) and not failed[i]}
    return values, failed, processes


def _score_one_by_one(fn: RewardFn, name: str, prompts: list, completions: list, columns: dict[str, list],
                      policy: RewardPolicy, batch_failure: str) -> tuple[Tensor, Tensor, dict[int, StepRewards]]:
    """The call on the whole batch raised or timed out: retry one sample at a time to find which fail."""
    values = torch.full((len(completions),), math.nan, dtype=torch.float64)
    failed = torch.zeros(len(completions), dtype=torch.bool)
    processes: dict[int, StepRewards] = {}
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
        elif isinstance(returned[0], StepRewards):
            processes[i] = returned[0]
    if policy.on_error == "error":  # every sample passes alone: the batch call itself is wrong
        raise RewardError(f"reward function {name!r} failed on the batch of {len(completions)}: {batch_failure}")
    return values, failed, processes


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
        if isinstance(value, StepRewards):
            problem = _step_rewards_problem(value)
            if problem is None:
                out[i] = value.total()
            else:
                problems[i] = problem
            continue
        if not isinstance(value, numbers.Real):
            problems[i] = f"returned {type(value).__name__} {value!r}; return a number, or None for 'not applicable'"
        elif not math.isfinite(value):
            problems[i] = f"returned {float(value)}; return None for 'not applicable'"
        else:
            out[i] = float(value)
    return out, problems


def _step_rewards_problem(value: StepRewards) -> str | None:
    """What is wrong with a StepRewards' fields (None: nothing); where the ends fall is checked with the text."""
    for k, step in enumerate(value.steps):
        if not (isinstance(step, (tuple, list)) and len(step) == 2 and isinstance(step[0], numbers.Integral)
                and isinstance(step[1], numbers.Real) and not isinstance(step[1], bool)):
            return f"returned StepRewards whose step {k} is {step!r}; a step is (end character offset: int, reward: float)"
        if not math.isfinite(step[1]):
            return f"returned StepRewards whose step {k} has reward {step[1]}; rewards must be finite"
    ends = [end for end, _ in value.steps]
    if ends != sorted(set(ends)):
        return f"returned StepRewards with step ends {ends}; they must increase (one reward per step)"
    if value.final is not None and not (isinstance(value.final, numbers.Real) and math.isfinite(value.final)):
        return f"returned StepRewards with final {value.final!r}; a final reward is a finite number or None"
    return None


def _call(fn: RewardFn, prompts: list, completions: list, columns: dict[str, list], timeout: float) -> Any:
    kwargs = {"prompts": prompts, "completions": completions, **columns}
    return isolation.call(fn, kwargs, timeout=timeout, limit_name="reward_timeout", convert=_as_list)


def _as_list(result: Any) -> Any:
    """A reward's values as a list (a generator or an array pickled whole), None as it is."""
    return None if result is None else list(result)
