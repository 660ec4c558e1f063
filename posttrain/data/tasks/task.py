"""The types of a built-in task: what a run needs besides a model, and the preference pairs built from one."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from posttrain.data.rewards import RewardFn

REASONING_GYM_PREFIX = "reasoning-gym:"
"""``--task reasoning-gym:SPEC`` builds a task from reasoning-gym's families (:mod:`.reasoning_gym`)."""
GEM_PREFIX = "gem:"
"""``--task gem:ENV_ID`` plays a GEM environment (:mod:`.gem`)."""
VERIFIERS_PREFIX = "verifiers:"
"""``--environment verifiers:NAME`` (or ``--task verifiers:NAME``) plays a verifiers taskset (:mod:`.verifiers`)."""


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
    None: :func:`posttrain.data.rewards.extract_answer`."""
    tools: tuple[Callable[..., Any], ...] = ()
    """Tools the policy may call: a task's episodes are multi-turn (``posttrain.rollout.episodes``)."""
    tool_format: str | None = None
    """How its calls are written (``json`` or ``inline``); None: the run's."""
    tool_timeout: float | None = None
    """Seconds per call of its tools (0: in-process, for tools that cannot hang); None: the run's."""
    environment: Callable[[], Any] | None = None
    """The environment class its episodes are played in (:mod:`posttrain.data.environments`), or None."""
    run_defaults: Mapping[str, Any] = field(default_factory=dict)
    """Run settings (config field -> value) tuned on ``default_model``: an online run of the task on that model
    takes those the user does not set (:func:`posttrain.training.defaults.task_defaults`)."""


@dataclass(frozen=True)
class PreferenceTask:
    """A built-in preference dataset: pairs built from a verifiable task's split."""

    name: str
    description: str
    train: list[dict[str, Any]]
    """Training pairs: ``prompt``, ``chosen``, ``rejected``, ``score_chosen``, ``score_rejected``."""
    test: list[dict[str, Any]]
    """Held-out pairs, from ``source.test``'s prompts."""
    source: Task
    """The task the pairs come from: held-out generation accuracy (its ``test`` and ``correct``),
    token budget and default model."""
