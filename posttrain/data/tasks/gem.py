"""``--task gem:ENV_ID``: an environment of GEM (``gem-llm``, "a gym for generalist LLMs") as a multi-turn task.

GEM was picked among the environment libraries that install offline (``verifiers``, ``openenv``,
``textarena``, ``gem-llm``) because its interface is the one posttrain's protocol already is: a
gym-style ``reset(seed) -> (observation, info)`` and ``step(action) -> (observation, reward,
terminated, truncated, info)`` on plain text, with single-agent games (Guess the Number, Wordle,
Mastermind, Hangman, Minesweeper, ...) that run in-process on a CPU and are seeded, so an episode is a
function of its row. ``verifiers`` builds on an OpenAI-compatible client and its own trainer,
``openenv`` runs environments as HTTP services in containers, and ``textarena`` centres on
multi-player games.

Rows are seeds: row k's ``prompt`` is the game's instructions after ``reset(seed=k)``, as one user chat
message, and the episode replays that seed. Held-out rows use seeds past the training ones (small
games such as the easy Guess the Number repeat their secrets across seeds: held-out success there
measures the strategy, not unseen secrets). Each policy turn is an action, answered with the game's
observation and its prompt for the next move as the next user turn.

GEM's games reward a solved episode 1.0 and every other step at most 0 (-0.1 for an action that
cannot be parsed), so an episode counts as correct when its environment reward reaches 1.0.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Mapping
from typing import Any

from posttrain.data.environments import Step, environment_reward
from posttrain.data.tasks.task import GEM_PREFIX, Task

SUCCESS_REWARD = 1.0
"""GEM's reward for a solved game (``gem.utils.constants.LanguageGameReward.success_reward``)."""
TRAIN_SEEDS, TEST_SEEDS = 1024, 200
TEST_SEED_START = 1_000_000
"""Held-out rows' seeds start here, past any training seed."""


def require_gem() -> None:
    if importlib.util.find_spec("gem") is None:
        raise ImportError("GEM environments need the gem-llm package: pip install 'posttrain[gem]' && "
                          "pip install --no-deps gem-llm==0.1.0 (it pins an older reasoning-gym than posttrain's)")


class GemEnvironment:
    """A GEM environment as a posttrain :class:`~posttrain.data.environments.Environment`
    (``functools.partial(GemEnvironment, env_id)`` constructs it with no arguments, as a run does)."""

    def __init__(self, env_id: str):
        self.env_id = env_id

    def reset(self, row: Mapping[str, Any]) -> None:
        import gem

        self.env = gem.make(self.env_id)
        self.env.reset(seed=int(row["seed"]))

    def step(self, turn: str) -> Step:
        observation, reward, terminated, truncated, info = self.env.step(turn)
        suffix = info.get("suffix") if isinstance(info, dict) else None
        text = f"{observation}\n{suffix}" if suffix and not (terminated or truncated) else str(observation)
        return Step(text, float(reward), bool(terminated or truncated))


def first_observation(env_id: str, seed: int) -> str:
    import gem

    observation, _ = gem.make(env_id).reset(seed=seed)
    return str(observation)


def correct(prompts: list, completions: list, environment_reward: list[float], **columns: Any) -> list[bool]:
    """Solved episodes: an environment reward of at least GEM's success reward."""
    return [float(r) >= SUCCESS_REWARD for r in environment_reward]


def make_task(spec: str, seed: int = 0) -> Task:
    """The task of ``gem:ENV_ID``: seeded rows (``seed`` shifts them), the environment, its reward."""
    require_gem()
    from gem.envs.registration import ENV_REGISTRY

    env_id = spec.removeprefix(GEM_PREFIX)
    if env_id not in ENV_REGISTRY:
        games = sorted(name for name in ENV_REGISTRY if name.startswith("game:"))
        raise ValueError(f"task: {spec!r}: GEM has no environment {env_id!r}; its games: {', '.join(games)}")

    def rows(start: int, count: int) -> list[dict[str, Any]]:
        return [{"prompt": [{"role": "user", "content": first_observation(env_id, k)}], "seed": k}
                for k in range(start, start + count)]

    offset = seed * (TRAIN_SEEDS + TEST_SEEDS)
    return Task(
        name=spec,
        description=f"GEM environment {env_id}: multi-turn episodes, one action per turn; reward: the game's",
        train=rows(offset, TRAIN_SEEDS),
        test=rows(TEST_SEED_START + offset, TEST_SEEDS),
        reward_funcs=(environment_reward,),
        reward_weights=(1.0,),
        correct=correct,
        max_new_tokens=512,
        default_model="smollm2-135m",
        environment=functools.partial(GemEnvironment, env_id),
    )
