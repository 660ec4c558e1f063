"""Environments: interactive tasks the policy plays turn by turn.

An environment starts an episode from a dataset row (:meth:`Environment.reset`), then takes each of the
policy's turns (the text it wrote, up to its end-of-turn token) and answers with a :class:`Step`: what
the policy reads next, a reward, and whether the episode is over. The episode's environment reward is
the sum of its steps' rewards; it reaches reward functions and correctness checks as the
``environment_reward`` column (:func:`environment_reward` is the reward function that passes it on), so
the advantages of every online preset see the whole episode's outcome.

An environment is a class with ``reset(row)`` and ``step(turn)``, constructed with no arguments, one
instance per episode; ``--environment FILE.py:CLASS`` names one, and ``--task gem:ENV_ID`` wraps an
environment of the ``gem-llm`` library (:mod:`posttrain.data.tasks.gem`). An episode must be a function
of its row (seed any randomness from it): resuming a run replays the same rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Step:
    """What the environment answers to one turn of the policy."""

    observation: str = ""
    """What the policy reads before its next turn (a user message with a chat template); ignored when done."""
    reward: float = 0.0
    """This step's reward; the episode's is the sum."""
    done: bool = False
    """The episode is over (solved, failed, out of the environment's own turns)."""


class Environment(Protocol):
    def reset(self, row: Mapping[str, Any]) -> None:
        """Start an episode from a dataset row (its ``prompt`` is what the policy reads first)."""
        ...

    def step(self, turn: str) -> Step:
        """The policy's turn, without its end-of-turn token: the next observation, reward and done."""
        ...


ENVIRONMENT_REWARD = "environment_reward"
"""The column holding each episode's summed environment reward."""


def environment_reward(prompts: list, completions: list, environment_reward: list[float],
                       **columns: Any) -> list[float]:
    """The environment's reward of each episode (the sum of its steps')."""
    return [float(r) for r in environment_reward]
