"""Built-in verifiable tasks: a dataset split, its rewards and its correctness check.

A :class:`Task` bundles what a run needs besides a model: ``train`` and
``test`` rows (a ``prompt`` string plus columns such as ``answer`` that
reach reward functions as keyword arguments, TRL style), default reward
functions with weights, a ``correct`` check used for held-out accuracy, a
token budget and the built-in starting model the task was designed for.

Besides the registry :data:`TASKS`, ``--task reasoning-gym:SPEC`` builds a task from reasoning-gym's
procedural families (:mod:`posttrain.tasks.reasoning_gym`, needs the ``reasoning-gym`` extra).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from posttrain.config import ConfigError
from posttrain.rewards import RewardFn


@dataclass(frozen=True)
class Task:
    name: str
    """Registry name (``--task``)."""
    description: str
    """One line for ``--help`` and logs."""
    train: list[dict[str, Any]]
    """Training prompts: dicts with a ``prompt`` string and extra columns."""
    test: list[dict[str, Any]]
    """Held-out rows, disjoint from ``train``, same columns."""
    reward_funcs: tuple[RewardFn, ...]
    """Default reward functions, TRL signature ``fn(prompts, completions, **columns)``."""
    reward_weights: tuple[float, ...]
    """One weight per reward function."""
    correct: Callable[..., list[bool]]
    """``correct(prompts, completions, **columns) -> list[bool]``: held-out accuracy."""
    max_new_tokens: int
    """Completion budget that fits every reference solution plus EOS."""
    default_model: str
    """Built-in starting model (see ``posttrain.models.tiny.BUILTIN_MODELS``)."""
    final_answer: Callable[[str], str | None] | None = None
    """The final answer a completion's text gives (None: none), for maj@K's vote in ``posttrain eval``;
    None: :func:`posttrain.rewards.extract_answer`."""


def _addition(seed: int) -> Task:
    from posttrain.tasks import addition

    return addition.make_task(seed)


def _gsm(seed: int) -> Task:
    from posttrain.tasks import gsm

    return gsm.make_task(seed)


TASKS: dict[str, Callable[[int], Task]] = {"addition": _addition, "gsm": _gsm}
"""Task name -> builder taking the split seed."""

REASONING_GYM_PREFIX = "reasoning-gym:"


def _reasoning_gym(spec: str, seed: int) -> Task:
    if importlib.util.find_spec("reasoning_gym") is None:
        raise ConfigError(f"task: {spec!r} needs the reasoning-gym package: pip install 'posttrain[reasoning-gym]'")
    from posttrain.tasks import reasoning_gym

    return reasoning_gym.make_task(spec, seed)


def get_task(name: str, seed: int = 0) -> Task:
    """The built-in task ``name``, or the reasoning-gym task of a ``reasoning-gym:...`` spec, its split
    drawn with ``seed``."""
    if name.startswith(REASONING_GYM_PREFIX):
        return _reasoning_gym(name, seed)
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(sorted(TASKS))}, "
                         f"or {REASONING_GYM_PREFIX}FAMILY for a reasoning-gym family")
    return TASKS[name](seed)
