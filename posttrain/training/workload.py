"""What an online run trains on: its prompts, reward functions and answer check (a built-in task's, or a
dataset's with the user's rewards), its held-out tasks, and how completions are scored.

:func:`load_workload` reads the config's task or dataset, the reward functions (the Python caller's first,
then ``--reward`` specs, a reward model, a judge) and an environment, and checks the rows before any model
loads. :func:`score_texts` scores a batch of completion texts with a workload's rewards and check.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from posttrain.algorithms.presets import OnlineAlgorithm
from posttrain.config import Config, ConfigError, DataConfig
from posttrain.data.environments import ENVIRONMENT_REWARD, environment_reward
from posttrain.data.images import dataset_directory, resolve_image_paths
from posttrain.data.judge import Judge, load_rubric
from posttrain.data.prompt_variants import ask, ask_each_differently, resolve_variants
from posttrain.data.prompts import (
    as_completion,
    check_prompt_rows,
    read_rows,
    within_prompt_budget,
)
from posttrain.data.remote import is_url, remote_judge, remote_rewards
from posttrain.data.rewards import RewardModel, load_reward, load_reward_function
from posttrain.data.scoring import RewardPolicy, Scores, score
from posttrain.data.tasks import get_task
from posttrain.data.tasks.task import REASONING_GYM_PREFIX, VERIFIERS_PREFIX
from posttrain.models.modeling import resolve_device
from posttrain.parallel import distributed
from posttrain.tracking.metrics import VARIANT_SEPARATOR
from posttrain.training.setup import Inputs


@dataclass
class Workload:
    """What to train on: prompts, reward functions and (for built-in tasks) a correctness check."""

    train_rows: list[dict[str, Any]]
    test_rows: list[dict[str, Any]]
    reward_fns: list[Callable]
    reward_weights: list[float]
    correct: Callable | None  # (prompts, completions, **columns) -> list[bool]
    max_new_tokens: int
    default_model: str | None
    final_answer: Callable[[str], str | None] | None = None  # the task's answer parser (posttrain eval's maj@K)
    tools: tuple[Callable, ...] = ()  # the task's tools (multi-turn episodes)
    tool_format: str | None = None  # how the task's calls are written
    tool_timeout: float | None = None  # the task's limit per call
    environment: Callable[[], Any] | None = None  # the class whose instances play the episodes
    agent: Any = None  # the user's agent (posttrain.rollout.agents.Agent), whose calls the sampler answers

    @property
    def episode_reward(self) -> str:
        """The column that holds an episode's own reward (``Completions.rewards``)."""
        return AGENT_REWARD if self.agent is not None else ENVIRONMENT_REWARD


AGENT_REWARD = "agent_reward"
"""The column of the number an agent returned (None where it returned None)."""


@dataclass
class AgentReward:
    """An agent's episode reward: the number the agent returned, else (it returned None) the weighted sum of
    the task's reward functions on the episode; with none, an error that says what to do."""

    fns: list[Callable]
    weights: list[float]
    __name__ = "agent"

    def __call__(self, prompts: list, completions: list, agent_reward: list, **columns: Any) -> list[float]:
        out = list(agent_reward)
        missing = [i for i, value in enumerate(out) if value is None]
        if missing and not self.fns:
            raise ValueError("the agent returned None and the run has no reward function to score its episode: "
                             "return the episode's reward, or give --reward")
        if missing:
            scores = score(self.fns, self.weights, [prompts[i] for i in missing], [completions[i] for i in missing],
                           {k: [v[i] for i in missing] for k, v in columns.items()}, RewardPolicy())
            for i, total in zip(missing, scores.total.tolist()):
                out[i] = total
        return out


def within_budget(config: Config, work: Workload, prompt_ids: list[Tensor]) -> tuple[Workload, list[Tensor]]:
    """The workload and encoded prompts without those over ``max_prompt_length`` (``long_prompts``)."""
    env = config.episodes.environment
    task = env if env and env.startswith(VERIFIERS_PREFIX) else config.data.task
    source, limit = config.data.dataset or f"task {task}", config.preference.max_prompt_length
    kept = within_prompt_budget(prompt_ids, limit, config.data.long_prompts, source, config.rollout.prompts_per_step)
    if len(kept) == len(prompt_ids):
        return work, prompt_ids
    distributed.say(f"{source}: dropped {len(prompt_ids) - len(kept)} of {len(prompt_ids)} prompts longer than "
                    f"max_prompt_length {limit} tokens (long_prompts drop)")
    return dataclasses.replace(work, train_rows=[work.train_rows[i] for i in kept]), [prompt_ids[i] for i in kept]


def load_workload(config: Config, inputs: Inputs = Inputs()) -> Workload:
    """The task or dataset named by the config, with its reward functions (``inputs``' first); checks the rows."""
    data = config.data
    env_spec = config.episodes.environment  # verifiers:NAME is a task: it brings its rows and rewards
    own = env_spec if env_spec and env_spec.startswith(VERIFIERS_PREFIX) else None
    if own and data.dataset is not None:
        raise ConfigError(f"environment: {own} brings its own tasks; drop --dataset or the environment")
    if data.dataset is not None:
        train_rows = read_rows(data.dataset, data.dataset_config, data.dataset_split)
        check_prompt_rows(train_rows, data.dataset)
        resolve_image_paths(train_rows, dataset_directory(data.dataset), data.dataset)
        test_rows = read_rows(data.eval_dataset, data.dataset_config, data.eval_dataset_split) if data.eval_dataset else []
        if test_rows:
            check_prompt_rows(test_rows, data.eval_dataset)
            resolve_image_paths(test_rows, dataset_directory(data.eval_dataset), data.eval_dataset)
        task = None
    else:
        task = get_task(own or data.task)  # a fixed split: the built-in models were warm-started on its train part
        train_rows, test_rows = list(task.train), list(task.test)
        distributed.say(f"task {own or data.task}: {task.description} ({len(train_rows)} training prompts, "
                        f"{len(test_rows)} held out)")
    if data.train_prompt_variants:  # each prompt asked one of several ways: the problem, not a phrasing, is learnt
        train_rows = ask_each_differently(train_rows, resolve_variants(data.train_prompt_variants),
                                          config.run.seed, data.dataset or data.task)
    agent = inputs.agent
    if agent is None and config.episodes.agent:
        from posttrain.rollout.agents import load_agent

        try:
            agent = load_agent(config.episodes.agent)
        except (ValueError, OSError, AttributeError, TypeError) as error:
            raise ConfigError(str(error) if str(error).startswith("agent") else f"agent: {error}") from None
    given = data.reward or inputs.reward_funcs or data.reward_url or data.reward_model is not None or data.judge
    if data.dataset is not None and not given and agent is None:
        raise ConfigError("reward: a --dataset needs at least one --reward NAME or FILE.py:FUNCTION (from "
                          "Python: reward_funcs=[...]), a --reward-url URL, a --reward-model DIR, a --judge MODEL "
                          "or an --agent that returns rewards")
    if given:
        fns = [*inputs.reward_funcs, *(load_reward(spec) for spec in data.reward), *remote_rewards(data)]
        weights = [*(inputs.reward_weights or [1.0] * len(inputs.reward_funcs)),
                   *(data.reward_weights or [1.0] * len(data.reward)), *[1.0] * len(data.reward_url)]
        if data.reward_model is not None:  # alongside the functions, or instead of the task's rewards
            fns.append(RewardModel(data.reward_model, batch_size=config.optim.micro_batch_size,
                                   normalize=data.reward_model_normalize, device=resolve_device(config.model.device)))
            weights.append(data.reward_model_weight)
        if data.judge is not None:
            fns.append(remote_judge(data) if is_url(data.judge) else make_judge(config))
            weights.append(data.judge_weight)
    elif task is not None:
        fns, weights = list(task.reward_funcs), list(task.reward_weights)
    else:
        fns, weights = [], []
    if agent is not None and not given:  # the agent's number, or the task's rewards where it returns None
        fns, weights = [AgentReward(fns, weights)], [1.0]
    environment = inputs.environment or (
        load_reward_function(env_spec, "environment") if env_spec and not own else None)
    environment = environment or (task.environment if task else None)
    if agent is not None:  # the agent brings its own tools, environment and loop
        environment = None
    if environment is not None and environment_reward not in fns:  # the episode's reward counts, always
        fns, weights = [environment_reward, *fns], [1.0, *weights]
    budget = config.rollout.max_new_tokens or (task.max_new_tokens if task else None)
    if budget is None:
        raise ConfigError("max_new_tokens: set the completion token budget for a dataset run")
    return Workload(train_rows, test_rows[: data.eval_size], fns, weights,
                    task.correct if task else None, budget, task.default_model if task else None,
                    task.final_answer if task else None, task.tools if task and agent is None else (),
                    task.tool_format if task else None, task.tool_timeout if task else None, environment, agent)


def make_judge(config: Config) -> Judge:
    """The run's ``--judge``, loaded on the training device and batched like the reward model."""
    from posttrain.models.loading import load_model_and_tokenizer

    data = config.data
    model, tokenizer = load_model_and_tokenizer(data.judge, device=config.model.device)
    return Judge(model, tokenizer, rubric=load_rubric(data.judge_rubric, "pointwise"),
                 pairwise_rubric=load_rubric(data.judge_pairwise_rubric, "pairwise"),
                 batch_size=config.optim.micro_batch_size)


def eval_label(task: str) -> str:
    """The metric name of an ``eval_tasks`` entry: a built-in task's name, or a reasoning-gym spec's
    families joined by ``+`` (``reasoning-gym:gsm_symbolic`` -> ``gsm_symbolic``)."""
    if not task.startswith(REASONING_GYM_PREFIX):
        return task
    from posttrain.data.tasks.reasoning_gym import (
        parse_spec,  # the optional reasoning-gym package
    )

    return "+".join(c.family for c in parse_spec(task))


def load_eval_workloads(config: Config, max_new_tokens: int) -> dict[str, Workload]:
    """The ``eval_tasks`` by label: each task's held-out rows (up to ``eval_size``), rewards and check,
    generated with the run's token budget; with ``eval_prompt_variants``, one per task and variant,
    labelled ``LABEL@VARIANT``."""
    data = config.data
    variants = resolve_variants(data.eval_prompt_variants) if data.eval_prompt_variants else [None]
    workloads: dict[str, Workload] = {}
    for spec in data.eval_tasks:
        label = eval_label(spec)
        if label in workloads:
            raise ConfigError(f"eval_tasks: two entries are both labelled {label!r}; give each task once")
        try:
            task = get_task(spec)
        except ConfigError:
            raise
        except ValueError as error:  # an unknown built-in task
            raise ConfigError(f"eval_tasks: {error}") from None
        if not task.test:
            raise ConfigError(f"eval_tasks: {spec!r} has no held-out problems")
        rows = list(task.test)[: data.eval_size]
        for variant in variants:
            workloads[label if variant is None else f"{label}{VARIANT_SEPARATOR}{variant.name}"] = Workload(
                [], rows if variant is None else ask(rows, variant, spec), list(task.reward_funcs),
                list(task.reward_weights), task.correct, max_new_tokens, task.default_model, task.final_answer)
    return workloads


def score_texts(work: Workload, data: DataConfig, rows: list[dict], texts: list[str],
                g: int, environment_rewards: Tensor | None = None) -> tuple[Scores, Tensor | None]:
    """The workload's rewards of ``len(rows) * g`` completion texts (row i's at i*g .. i*g + g - 1), and
    the task's verdicts ([N] bool; None when the workload has no correctness check). An environment's
    episode rewards ([N]) reach the reward functions and the check as the ``environment_reward`` column, an
    agent's as ``agent_reward`` (None where it returned None)."""
    prompts = [row["prompt"] for row in rows for _ in range(g)]
    completions = [as_completion(p, t) for p, t in zip(prompts, texts)]
    columns = {k: [row.get(k) for row in rows for _ in range(g)] for k in rows[0] if k != "prompt"}
    if environment_rewards is not None:
        columns[work.episode_reward] = [None if math.isnan(v) else v for v in environment_rewards.tolist()]
    scores = score(work.reward_fns, work.reward_weights, prompts, completions, columns,
                   RewardPolicy(data.reward_timeout, data.reward_errors))
    correct = None
    if work.correct is not None:
        correct = torch.tensor(work.correct(prompts=prompts, completions=completions, **columns), dtype=torch.bool)
    return scores, correct


def rewards_as_given(config: Config, alg: OnlineAlgorithm, work: Workload) -> OnlineAlgorithm:
    """The preset for rewards without an answer check (``--reward`` functions, a reward model): a preset's
    own ``binary_reward`` (DAPO's +-1 for a correct answer) is dropped, so the rewards train as they are and
    dynamic sampling drops the groups whose rewards are all equal. One the user gave is kept (``validate``
    refuses it)."""
    if work.correct is not None or alg.binary_reward is None or "binary_reward" in config.overrides:
        return alg
    distributed.say(f"{alg.name}: your rewards train as they are (binary_reward {alg.binary_reward} maps a "
                    "task's answer check, which they have none of)")
    return dataclasses.replace(alg, binary_reward=None)


