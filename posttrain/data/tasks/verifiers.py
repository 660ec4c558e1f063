"""``--environment verifiers:NAME`` (or ``--task verifiers:NAME``): a taskset of ``verifiers`` as a task.

verifiers (PyPI ``verifiers``, Prime Intellect's environment library) 0.4 is its ``verifiers.v1`` stack
alone (the classic ``load_environment()`` / ``SingleTurnEnv`` / ``Rubric`` API of 0.3 is gone): an
environment is a *taskset* package that exports a ``vf.Taskset`` subclass in ``__all__`` (and, for more
than one plain conversation, a ``vf.Env`` subclass whose ``run(task, agents)`` drives the exchange), its
tasks are ``vf.TaskData`` rows, its rewards the task's ``@vf.reward`` methods scored on a ``vf.Trace``.
This module loads ``NAME`` the way verifiers does (``vf.resolve_env_config`` then
``vf.load_environment``: ``owner/name@version`` -> module ``name``, ``-`` -> ``_``, imported from the
Python path), with ``verifiers:NAME(key=value,...)`` setting the taskset's config (``--env.taskset.KEY``).

What maps to what:

1. **Rows.** Each task is a row: ``prompt`` is what verifiers' chat harness sends first (a system message
   from ``system_prompt``, then ``prompt``: a string as one user message, or its messages), the taskset's
   own ``TaskData`` fields (``answer``, ``info``, ...) and ``idx`` are columns, and ``verifiers_task`` is
   the task's data, from which each episode rebuilds the task as verifiers' env server does. v1 has no
   train/eval split: the last tenth of the tasks (at most 200) are held out; an infinite taskset gives
   its first 1024 tasks for training and the next 200.
2. **Reward.** An episode is played through the env's own ``setup``/``run``/``finalize`` with posttrain
   as the policy's harness: every policy turn is committed to the seat's ``vf.Trace`` through verifiers'
   graph (``prepare_turn(...).commit(response)``, what its interception server does with a model call),
   the trace is scored by ``Task.score`` when the exchange closes (no runtime: verifiers itself then
   skips the rewards that need one), and the reward is the trace's weighted sum (``Trace.reward``),
   with what ``run``/``finalize`` recorded. There is no correctness check (``posttrain eval`` counts a
   reward of at least ``success_threshold`` as solved).
3. **Protocol.** A taskset with the plain ``SingleAgentEnv`` and no tools is single-turn: plain prompts,
   and the reward function plays each completion as the episode's one reply. Any other ``Env`` runs as a
   posttrain environment: each ``interaction.turn(message)`` of its ``run`` is a policy turn, its message
   the next user turn of the chat template (inserted, never trained on); ``@vf.stop`` checks on the trace
   run before each turn, as verifiers' session does. Each step's reward is the score so far minus what
   was given, so an episode ``max_turns`` cuts off sums to its trace's score at its last turn.
4. **Tools.** The ``@vf.tool`` methods of the taskset's and task's ``vf.Toolset`` servers are given to
   posttrain's own tool loop, named ``SERVER_TOOL`` as verifiers' chat program names MCP tools: the
   chat template renders the calls and results, so the result tokens are inserted and masked like any
   tool's, where answering calls from the environment would put them in user turns the model was never
   taught to read. The env then sees each turn's reply after its last tool result.

Token-exactness: the ids posttrain trains are the ids it sampled; the env's messages and tool results
are rendered by the chat template and inserted once, never re-tokenized. What the trace holds is the
*decoded* text of each turn, which is what verifiers' rewards read anyway. Not supported, each a clear
error: an env message that is not one user turn (several messages, another role, images), an env that
plays the policy in a second conversation or rewrites earlier messages (its episode is not one token
stream), a seat other than the policy's that needs a model (``user-sim``'s user), steering, tasks that
need a container or a runtime (``NEEDS_CONTAINER``, rewards that take ``runtime`` are skipped as
verifiers skips them offline), ``@vf.stop`` on requests or responses. Tool calls made inside a turn run in
posttrain's tool loop and are not in the trace (``trace.tool_messages`` is empty); a toolset's state
channel and per-task ``setup_task`` are not used. An episode the token budget truncates mid-turn never
reaches the env, so it scores what its earlier turns scored.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from posttrain.config import ConfigError
from posttrain.data.environments import Step, environment_reward
from posttrain.data.rewards import completion_text
from posttrain.data.settings import parse_settings
from posttrain.data.tasks.task import VERIFIERS_PREFIX, Task
from posttrain.data.tasks.verifiers_play import (
    Play,
    PlayError,
    opening,
    shut_down,
)

TRAIN_TASKS, TEST_TASKS = 1024, 200
"""Rows taken from an infinite taskset; at most TEST_TASKS held out of a finite one."""
TASK_COLUMN = "verifiers_task"
"""The column holding each row's task data (``TaskData.model_dump(mode="json")``)."""

def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``verifiers:NAME(key=value,...)`` -> (NAME, {key: value}).

    >>> parse_spec("verifiers:owner/my-env@0.1(num_tasks=8, split=test)")
    ('owner/my-env@0.1', {'num_tasks': 8, 'split': 'test'})
    """
    name, paren, settings = spec.removeprefix(VERIFIERS_PREFIX).strip().partition("(")
    name = name.strip()
    if paren and not settings.endswith(")"):
        raise ConfigError(f"environment: {spec!r} is not {VERIFIERS_PREFIX}NAME(key=value,...): close the settings "
                          "with ')'")
    if not name:
        raise ConfigError(f"environment: {spec!r} names no taskset; give {VERIFIERS_PREFIX}NAME")
    return name, parse_settings(settings[:-1], f"verifiers taskset {name!r}", "environment") if paren else {}


@dataclass
class Loaded:
    """A loaded verifiers environment: the env, its taskset's task type and config, its tools."""

    spec: str
    env: Any  # vf.Env
    task_cls: type
    tools: tuple[VerifiersTool, ...]
    servers: tuple[Any, ...]  # the vf.Toolset instances the tools are methods of

    @property
    def single_turn(self) -> bool:
        """The plain single-agent env with no tools: one reply per task, no posttrain environment needed."""
        import verifiers.v1 as vf

        return type(self.env) is vf.SingleAgentEnv and not self.tools

    def task_of(self, row: Mapping[str, Any]) -> Any:
        """The row's task, rebuilt from its data as verifiers' env server rebuilds a shipped task."""
        data = self.task_cls.data_type().model_validate(row[TASK_COLUMN])
        return self.task_cls(data, self.env.config.taskset.task)


@functools.cache
def load(spec: str) -> Loaded:
    """The environment of ``verifiers:NAME(...)``, loaded once per process; a ConfigError that names it and
    says how verifiers looks tasksets up when it does not resolve."""
    import verifiers.v1 as vf
    from pydantic import ValidationError

    name, settings = parse_spec(spec)
    try:
        config = vf.resolve_env_config({"taskset": {"id": name, **settings}})
        env = vf.load_environment(with_null_harness(config))
    except ValidationError as error:
        raise ConfigError(f"environment: verifiers taskset {name!r} rejects the settings {settings}: {error}") from None
    except (ImportError, AttributeError, TypeError, ValueError) as error:
        raise ConfigError(
            f"environment: verifiers cannot load {name!r}: {error}. verifiers imports a taskset id as a module "
            "(owner/name@version -> name, '-' -> '_') that exports its vf.Taskset subclass (and, for a multi-turn "
            "env, its vf.Env subclass) in __all__: install the environment's package or put its module on "
            "PYTHONPATH. A legacy (verifiers < 0.4) environment that defines load_environment() does not load "
            "with verifiers 0.4") from None
    task_cls = type(env.taskset).task_type()
    if task_cls.NEEDS_CONTAINER:
        raise ConfigError(f"environment: verifiers taskset {name!r} needs a container to run its tasks in; posttrain "
                          "plays episodes in-process")
    servers = (*env.taskset.toolsets(env.taskset.config), *task_cls.toolsets(env.config.taskset.task))
    for server in servers:
        asyncio.run(server.setup())
    tools = tuple(VerifiersTool(spec, i, method, tool_name(server, method))
                  for i, server in enumerate(servers) for method in tool_methods(server))
    return Loaded(spec, env, task_cls, tools, servers)


def with_null_harness(config: Any) -> Any:
    """The env config with the ``null`` harness (a chat loop with the taskset's tools, no bash) on every seat
    that pins none: posttrain's decode loop plays that harness's part."""
    import verifiers.v1 as vf
    from verifiers.v1.configs.agent import agent_config_fields

    null = vf.harness_config_type("null")(id="null")
    seats = {name: seat.model_copy(update={"harness": null})
             for name, seat in agent_config_fields(config).items() if seat.harness is None}
    return config.model_copy(update=seats)


# --- rows ----------------------------------------------------------------------------------


def as_chat(message: Any) -> dict[str, str]:
    """A text message as posttrain's chat dict; a ValueError for what a chat prompt cannot hold."""
    from verifiers.v1.types import AssistantMessage

    content = message.content
    if not isinstance(content, str) or (isinstance(message, AssistantMessage) and message.tool_calls):
        raise ValueError(f"a {message.role} message with images, content parts or tool calls; posttrain's "
                         "prompts and inserted turns are text")
    return {"role": message.role, "content": content}


def rows_of(loaded: Loaded) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training rows, held-out rows) of the taskset, in its load order."""
    import verifiers.v1 as vf

    taskset = loaded.env.taskset
    infinite = not taskset.bounded
    tasks = list(taskset.take(TRAIN_TASKS + TEST_TASKS) if infinite else taskset)
    own = set(loaded.task_cls.data_type().model_fields) - set(vf.TaskData.model_fields)
    rows = []
    for task in tasks:
        data = task.data.model_dump(mode="json")
        prompt = opening(task.data) if task.data.prompt is not None else first_request(loaded, task)
        rows.append({"prompt": [as_chat(m) for m in prompt], "idx": data["idx"],
                     **{k: data[k] for k in sorted(own)},
                     TASK_COLUMN: task.data.model_dump(mode="json", exclude_defaults=True)})
    held_out = TEST_TASKS if infinite else min(TEST_TASKS, max(1, len(rows) // 10)) if len(rows) > 1 else 0
    return rows[: len(rows) - held_out], rows[len(rows) - held_out:]


def first_request(loaded: Loaded, task: Any) -> list[Any]:
    """What the env sends the policy first on a prompt-less task (it opens the exchange itself)."""
    play = Play(loaded, task)
    try:
        first = play.start()
    finally:
        play.close()
    if first is None:
        raise ValueError(f"verifiers task {task.data.idx}: the env's run() asked the policy for no turn")
    return first


# --- the posttrain pieces ----------------------------------------------------------------------


class VerifiersEnvironment:
    """The env as a posttrain :class:`~posttrain.data.environments.Environment`
    (``functools.partial(VerifiersEnvironment, spec)`` constructs it with no arguments, as a run does)."""

    def __init__(self, spec: str):
        self.spec = spec

    def reset(self, row: Mapping[str, Any]) -> None:
        loaded = load(self.spec)
        self.play = Play(loaded, loaded.task_of(row))
        first = self.play.start()
        weakref.finalize(self, shut_down, self.play.loop, self.play.run)  # an episode max_turns ended mid-run
        if first is None:
            raise PlayError("the env's run() asked the policy for no turn")
        if [as_chat(m) for m in first] != list(row["prompt"]):
            raise PlayError("the env's opening messages are not the row's prompt: its first turn must be a "
                            "function of the task")
        self.given = 0.0

    def step(self, turn: str) -> Step:
        new = self.play.reply(turn)
        score = self.play.reward() if new is None else self.play.reward_so_far()
        reward, self.given = score - self.given, score
        if new is None:
            self.play.close()
            return Step("", reward, done=True)
        return Step(observation_text(new), reward)


def observation_text(messages: list[Any]) -> str:
    """The env's next messages as the one user turn posttrain inserts; a PlayError for anything else."""
    chat = [as_chat(m) for m in messages]
    if len(chat) != 1 or chat[0]["role"] != "user":
        raise PlayError(f"the env answered with {[m['role'] for m in chat]} messages; posttrain inserts one user "
                        "turn between the policy's turns")
    return chat[0]["content"]


class VerifiersReward:
    """The task's rewards on single-turn completions: each completion played as the episode's one reply."""

    __name__ = "verifiers"

    def __init__(self, spec: str):
        self.spec = spec

    def __call__(self, prompts: list, completions: list, verifiers_task: list[dict], **columns: Any) -> list[float]:
        loaded = load(self.spec)
        return [play_one(loaded, loaded.task_of({TASK_COLUMN: data}), completion_text(c))
                for c, data in zip(completions, verifiers_task)]


def play_one(loaded: Loaded, task: Any, text: str) -> float:
    """The reward of ``text`` as the one reply of an episode of ``task``."""

    play = Play(loaded, task)
    try:
        if play.start() is None or play.reply(text) is not None:
            raise PlayError("a single-turn env must ask the policy for exactly one turn")
        return play.reward()
    finally:
        play.close()


class VerifiersTool:
    """A ``@vf.tool`` method of a toolset as a posttrain tool: a named callable whose signature and docstring
    describe it (a parameter the docstring does not describe gets its name as the description, where MCP
    would give none); it resolves the method through :func:`load`, so it pickles with an episode generator."""

    def __init__(self, spec: str, server: int, fn: Any, name: str):
        self.spec, self.server, self.method, self.__name__ = spec, server, fn.__name__, name
        signature = inspect.signature(fn)
        self.__signature__ = signature
        self.__annotations__ = {p.name: p.annotation for p in signature.parameters.values()
                                if p.annotation is not inspect.Parameter.empty}
        self.__annotations__["return"] = str
        doc = inspect.getdoc(fn) or name
        if "Args:" not in doc and signature.parameters:
            doc += "\n\nArgs:\n" + "".join(f"    {p}: {p}\n" for p in signature.parameters)
        self.__doc__ = doc

    def _fn(self) -> Any:
        return getattr(load(self.spec).servers[self.server], self.method)

    def __call__(self, *args: Any, **kwargs: Any) -> str:
        result = self._fn()(*args, **kwargs)
        if inspect.isawaitable(result):
            result = asyncio.run(_awaited(result))
        return tool_text(result)


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def tool_methods(server: Any) -> list[Any]:
    from verifiers.v1.utils.decorators import discover_decorated

    return discover_decorated(server, "tool")


def tool_name(server: Any, method: Any) -> str:
    """``SERVER_TOOL``, as verifiers' chat program names an MCP server's tool (bare with no server name)."""
    name = getattr(method, "tool_name", None) or method.__name__
    return f"{server.server_name}_{name}" if server.server_name else name


def tool_text(result: Any) -> str:
    """A tool's result as the text the policy reads: text as it is, a list of texts a line each (MCP's text
    blocks), numbers as written, anything else as JSON."""
    if isinstance(result, str):
        return result
    if isinstance(result, (list, tuple)) and all(isinstance(item, str) for item in result):
        return "\n".join(result)
    if isinstance(result, (int, float)) and not isinstance(result, bool):
        return str(result)
    from pydantic import BaseModel

    return json.dumps(result.model_dump(mode="json") if isinstance(result, BaseModel) else result, default=str)


def make_task(spec: str, seed: int = 0) -> Task:
    """The task of ``verifiers:NAME(...)``: its rows, its reward, and its env or tools where it has them
    (``seed`` does not change a taskset's fixed split)."""
    loaded = load(spec)
    train, test = rows_of(loaded)
    if not train:
        raise ConfigError(f"environment: verifiers taskset {spec!r} has no tasks to train on")
    episodes = not loaded.single_turn
    kind = type(loaded.env).__name__ + (f" with tools {', '.join(t.__name__ for t in loaded.tools)}"
                                        if loaded.tools else "")
    return Task(
        name=spec,
        description=f"verifiers {kind}: {'multi-turn episodes' if episodes else 'single-turn'}; reward: the task's",
        train=train,
        test=test,
        reward_funcs=(environment_reward,) if episodes else (VerifiersReward(spec),),
        reward_weights=(1.0,),
        correct=None,
        max_new_tokens=512,
        default_model="smollm2-135m",
        tools=loaded.tools,
        environment=functools.partial(VerifiersEnvironment, spec) if episodes else None,
    )
