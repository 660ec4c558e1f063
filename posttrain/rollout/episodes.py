"""Multi-turn episodes: the policy calls tools or plays an environment, reads what comes back, and continues.

An episode starts from a prompt (and, with an environment, from the prompt's dataset row). Each turn the policy generates until it closes a tool call (the
format's ``call_end``), its end-of-sequence token, or the episode's token budget. A turn that closes a
call is parsed and the call runs (:class:`Tools`: in a worker process killed at a time limit when one
is set); the format renders its result, and the result's tokens are inserted after the turn. A turn that
ends with the end-of-sequence token ends the episode, unless an environment
(:mod:`posttrain.data.environments`) plays it: the environment takes the turn's text and answers with
an observation, inserted as the next user turn of the chat template, a reward and whether it is done.
The next turn continues from everything so far, up to ``max_turns`` turns.

Token in, token out: an episode's completion holds the token ids the policy sampled and the ids that
were inserted, never re-tokenized text. ``Completions.mask`` marks the policy's tokens (what is trained
on), ``Completions.inserted`` the others (context only), and ``truncated`` an episode that ran out of
budget before its end-of-sequence token. :class:`EpisodeGenerator` has the generator's interface, so
sampling, held-out evaluation and ReMax's greedy baseline run episodes unchanged.

Tool faults (an unknown tool, a malformed call, a tool that raises, hangs past its limit, dies or
returns something that is not text) are, with ``on_error='feedback'``, the tool's result: an error
message the policy reads, counted in :class:`EpisodeStats`; with ``on_error='raise'`` they stop the run
with that message. An environment that raises ends its episode with a penalty
(:data:`ENVIRONMENT_FAULT_REWARD`), counted in ``episode/environment_errors``, or stops the run.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from posttrain.data import isolation
from posttrain.data.environments import Environment, Step
from posttrain.data.prompts import ExternalTool
from posttrain.rollout.completions import POLICY_SAMPLER, Completions, Generator, SamplingParams
from posttrain.rollout.generators import make_generator
from posttrain.rollout.tool_formats import FAMILIES, ChatTemplateCalls, ToolCall, detect_format

TOOL_ERRORS = ("unknown_tool", "malformed_call", "error", "timeout", "crash", "not_text")
"""The kinds of tool fault :class:`EpisodeStats` counts."""


class ToolError(RuntimeError):
    """A tool call failed and ``on_error='raise'``: the message says which call and how."""


class ToolFormat(Protocol):
    """How a model writes a tool call and reads its result, in the middle of its turn (the chat-template
    formats, :class:`~posttrain.rollout.tool_formats.ChatTemplateCalls`, end the turn instead)."""

    call_end: str
    """The text that closes a call: a turn stops there."""

    def parse(self, turn: str) -> ToolCall:
        """The call a turn ends with; ValueError (its message says what is wrong) when it is malformed."""
        ...

    def result(self, text: str) -> str:
        """The text inserted after a call: the tool's result (or error) as the model reads it."""
        ...

    def before(self, turn: str) -> str:
        """The turn's text before the call it ends with (what a chat API returns as the call's ``content``)."""
        ...


@dataclass(frozen=True)
class JSONCalls:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, answered by
    ``<tool_response>...</tool_response>``: the convention of Hermes, Qwen and the chat templates that
    render tools (TRL's too)."""

    call_start: str = "<tool_call>"
    call_end: str = "</tool_call>"
    response_start: str = "<tool_response>\n"
    response_end: str = "\n</tool_response>\n"

    def parse(self, turn: str) -> ToolCall:
        start = turn.rfind(self.call_start)
        if start < 0 or not turn.endswith(self.call_end):
            raise ValueError(f"a call is {self.call_start}{{...}}{self.call_end}")
        body = turn[start + len(self.call_start): len(turn) - len(self.call_end)]
        try:
            call = json.loads(body)
        except json.JSONDecodeError as error:
            raise ValueError(f"the call is not JSON ({error.msg} at column {error.colno})") from None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ValueError('a call is {"name": TOOL, "arguments": {...}}')
        arguments = call.get("arguments", {})
        if not isinstance(arguments, dict):
            raise ValueError(f"arguments must be a JSON object, got {type(arguments).__name__}")
        return ToolCall(call["name"], arguments)

    def result(self, text: str) -> str:
        return f"{self.response_start}{text}{self.response_end}"

    def before(self, turn: str) -> str:
        """The turn's text before the call it ends with."""
        return turn[: turn.rfind(self.call_start)] if self.call_start in turn else turn


@dataclass(frozen=True)
class InlineCalls:
    """``[tool_name argument]`` answered by ``=result;``: a compact format for character-level models (the
    built-in tiny models); the argument is the tool's one positional argument, as a string."""

    call_end: str = "]"
    pattern: re.Pattern = field(default=re.compile(r"\[(\w+) ([^\[\]]*)\]$"))

    def parse(self, turn: str) -> ToolCall:
        match = self.pattern.search(turn)
        if match is None:
            raise ValueError("a call is [tool argument]")
        return ToolCall(match.group(1), positional=(match.group(2),))

    def result(self, text: str) -> str:
        return f"={text};"

    def before(self, turn: str) -> str:
        """The turn's text before the call it ends with."""
        match = self.pattern.search(turn)
        return turn if match is None else turn[: match.start()]


@dataclass
class EpisodeStats:
    """What the episodes of one ``generate`` call did."""

    turns: list[int] = field(default_factory=list)
    """[N] policy turns of each episode."""
    tool_calls: int = 0
    errors: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TOOL_ERRORS, 0))
    inserted_tokens: int = 0
    environment_errors: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    """Episodes that could not be recorded, by why (an agent's: :mod:`posttrain.rollout.agents`); their groups
    leave the update."""

    def counts(self) -> dict[str, int]:
        """Totals that add up over calls and processes (:meth:`metrics_of` turns them into per-episode means)."""
        return {"episodes": len(self.turns), "turns": sum(self.turns), "tool_calls": self.tool_calls,
                "inserted_tokens": self.inserted_tokens, "environment_errors": self.environment_errors,
                **{f"tool_errors/{k}": v for k, v in self.errors.items()},
                **{f"dropped/{k}": v for k, v in self.dropped.items()}}

    @staticmethod
    def metrics_of(counts: dict[str, float]) -> dict[str, float]:
        """Per-episode means of summed :meth:`counts`: ``episode/turns``, ``episode/tool_calls``,
        ``episode/tool_errors`` (and by kind, where any), ``episode/inserted_tokens``, and
        ``episode/environment_errors`` and ``episode/dropped`` (and by why) where any."""
        n = max(counts["episodes"], 1)
        errors = {key.removeprefix("tool_errors/"): value for key, value in counts.items()
                  if key.startswith("tool_errors/")}
        dropped = {key.removeprefix("dropped/"): value for key, value in counts.items() if key.startswith("dropped/")}
        return {"episode/turns": counts["turns"] / n, "episode/tool_calls": counts["tool_calls"] / n,
                "episode/tool_errors": sum(errors.values()) / n, "episode/inserted_tokens": counts["inserted_tokens"] / n,
                **{f"episode/tool_errors/{kind}": count / n for kind, count in errors.items() if count},
                **({"episode/environment_errors": counts["environment_errors"] / n}
                   if counts.get("environment_errors") else {}),
                **({"episode/dropped": sum(dropped.values()) / n} if any(dropped.values()) else {}),
                **{f"episode/dropped/{why}": count / n for why, count in dropped.items() if count}}

    def metrics(self) -> dict[str, float]:
        return self.metrics_of(self.counts())


class Tools:
    """Python functions the policy may call, by name; each runs in a forked worker killed after
    ``timeout`` seconds when ``timeout`` > 0. An :class:`~posttrain.data.prompts.ExternalTool` (an MCP
    server's) runs its calls itself, within the same limit."""

    def __init__(self, functions: Sequence[Callable[..., Any]], *, timeout: float = 0.0, on_error: str = "feedback"):
        if on_error not in ("feedback", "raise"):
            raise ValueError(f"on_error must be 'feedback' or 'raise', got {on_error!r}")
        self.functions = {fn.__name__: fn for fn in functions}
        if len(self.functions) != len(functions):
            raise ValueError("two tools share a name: " + ", ".join(fn.__name__ for fn in functions))
        self.timeout, self.on_error = timeout, on_error

    def run(self, call: ToolCall) -> tuple[str, str | None]:
        """(the result's text, the fault's kind or None)."""
        fn = self.functions.get(call.name)
        if fn is None:
            return self.fault("unknown_tool", f"unknown tool {call.name!r}; tools: {', '.join(self.functions)}")
        if isinstance(fn, ExternalTool):  # no worker to fork: its failure's detail is the message, not a traceback
            try:
                return fn.call(call.positional, call.arguments, self.timeout), None
            except isolation.CallFailed as failure:
                return self.fault(failure.kind, f"{call.name} failed: {failure.detail}")
        try:
            result = isolation.call(lambda **kwargs: fn(*call.positional, **kwargs), call.arguments,
                                    timeout=self.timeout, limit_name="tool_timeout")
        except isolation.CallFailed as failure:
            last = failure.detail.strip().splitlines()[-1]
            return self.fault(failure.kind, f"{call.name} failed: {last}")
        if isinstance(result, bool) or not isinstance(result, (str, int, float)):
            return self.fault("not_text", f"{call.name} returned {type(result).__name__}, not text")
        return str(result), None

    def fault(self, kind: str, message: str) -> tuple[str, str]:
        """The fault as the policy reads it, ``("error: MESSAGE", kind)``; with ``on_error="raise"`` a ToolError."""
        if self.on_error == "raise":
            raise ToolError(message)
        return f"error: {message}", kind


def make_episode_generator(backend: str, model: Any, tokenizer: Any, params: SamplingParams, eos_ids: list[int],
                           tools: Tools | None, fmt: ToolFormat | None, *, max_turns: int, seed: int = 0,
                           environment: Callable[[], Environment] | None = None,
                           on_error: str = "feedback") -> "EpisodeGenerator":
    """Episodes whose turns the configured generator samples, stopping at ``eos_ids`` (with a chat-template
    format, at its family's end-of-turn tokens too) and, with a mid-turn format, where a call closes; an
    environment's observations are rendered as user turns of the chat template."""
    if isinstance(fmt, ChatTemplateCalls):  # a call ends the turn: at the family's end-of-turn tokens too
        eos_ids = [*eos_ids, *(i for i in fmt.turn_end_ids(tokenizer) if i not in eos_ids)]
    stop_ids = ([tokenizer.encode(fmt.call_end, add_special_tokens=False)[-1]]
                if tools is not None and fmt.call_end is not None else [])
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    return EpisodeGenerator(TurnGenerators(backend, model, tokenizer, params, [*eos_ids, *stop_ids], seed),
                            tokenizer, tools, fmt, environment=environment,
                            render=user_turn(tokenizer, tokenizer.decode([eos_ids[0]])) if environment else None,
                            on_error=on_error, max_new_tokens=params.max_new_tokens, max_turns=max_turns,
                            eos_ids=eos_ids, pad_id=pad_id)


@dataclass
class TurnGenerators:
    """``turn_generators(budget)``: the configured generator for one turn of at most ``budget`` tokens, which
    stops at ``stop_ids``. (A class, not a closure, so that an episode generator pickles: asynchronous
    rollouts send it to their process.)"""

    backend: str
    model: Any
    tokenizer: Any
    params: SamplingParams
    stop_ids: list[int]
    seed: int

    def __call__(self, budget: int) -> Generator:
        return make_generator(self.backend, self.model, self.tokenizer,
                              dataclasses.replace(self.params, max_new_tokens=budget), self.stop_ids, seed=self.seed)


def as_is(text: str) -> str:
    return text


def user_turn(tokenizer: Any, eos_text: str) -> Callable[[str], str]:
    """How an observation is inserted after a policy turn that ended with ``eos_text``: as the user turn
    the tokenizer's chat template renders, up to the assistant's next header; the text itself without
    a template."""
    if getattr(tokenizer, "chat_template", None) is None:
        return as_is
    return UserTurn(tokenizer, eos_text)


@dataclass
class UserTurn:
    """An observation as the chat template's next user turn, after an assistant turn that ended with
    ``eos_text``: found by rendering a conversation with and without it."""

    tokenizer: Any
    eos_text: str
    marker = "\u2063turn\u2063"  # text no template rewrites, to find where the assistant's turn ends

    def __call__(self, text: str) -> str:
        before = [{"role": "user", "content": "-"}, {"role": "assistant", "content": self.marker}]
        prefix = self.tokenizer.apply_chat_template(before, tokenize=False)
        full = self.tokenizer.apply_chat_template([*before, {"role": "user", "content": text}], tokenize=False,
                                                  add_generation_prompt=True)
        after_turn = prefix[prefix.rindex(self.marker) + len(self.marker):]
        if not full.startswith(prefix) or not after_turn.startswith(self.eos_text):
            raise ValueError("the chat template does not render a user turn after an assistant turn that ends "
                             f"with {self.eos_text!r}; cannot insert environment observations")
        return after_turn[len(self.eos_text):] + full[len(prefix):]


FORMATS: dict[str, Callable[[], Any]] = {"json": JSONCalls, "inline": InlineCalls,
                                        **{family: functools.partial(ChatTemplateCalls, family) for family in FAMILIES}}
"""``tool_format`` name -> the format (``auto``: :func:`tool_format` picks one from the chat template)."""


def tool_format(name: str, tokenizer: Any) -> Any:
    """The format ``name`` names; ``auto``: the one the tokenizer's chat template writes calls in."""
    return FORMATS[detect_format(tokenizer) if name == "auto" else name]()

ENVIRONMENT_FAULT_REWARD = -1.0
"""The environment reward added to an episode whose environment raised (``on_error='feedback'``): the
episode ends there, with a penalty a success would outweigh in environments that score success as 1."""


class EnvironmentFault(RuntimeError):
    """An environment raised and ``on_error='raise'``: the message says which row, which turn and what."""


class EpisodeGenerator:
    """A :class:`~posttrain.rollout.completions.Generator` whose completions are multi-turn episodes.

    ``turn_generator(budget)`` returns a generator that stops at the end-of-sequence ids and (with
    tools) at the last token of the format's ``call_end``, within ``budget`` new tokens. A turn that
    closes a call runs it; a turn that ends with an end-of-sequence token ends the episode, or, with an
    ``environment`` (one instance per episode, reset from the episode's row), goes to the environment,
    whose observation ``render`` turns into inserted text. ``stats`` holds what the last ``generate``
    call's episodes did; the completions' ``rewards`` are the environment's, per episode.
    """

    capabilities = POLICY_SAMPLER  # its turns are posttrain's decode loop's, on the model it is given

    def __init__(self, turn_generator: Callable[[int], Generator], tokenizer: Any, tools: Tools | None = None,
                 fmt: ToolFormat | None = None, *, environment: Callable[[], Environment] | None = None,
                 render: Callable[[str], str] | None = None, on_error: str = "feedback",
                 max_new_tokens: int, max_turns: int, eos_ids: Sequence[int], pad_id: int):
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if tools is None and environment is None:
            raise ValueError("an episode needs tools or an environment")
        if (tools is None) != (fmt is None):
            raise ValueError("tools and their format go together")
        if on_error not in ("feedback", "raise"):
            raise ValueError(f"on_error must be 'feedback' or 'raise', got {on_error!r}")
        self.turn_generator, self.tokenizer, self.tools, self.fmt = turn_generator, tokenizer, tools, fmt
        self.environment, self.render, self.on_error = environment, render or as_is, on_error
        self.max_new_tokens, self.max_turns, self.pad_id = max_new_tokens, max_turns, pad_id
        self.eos_ids = set(eos_ids)
        self.stop_id = (tokenizer.encode(fmt.call_end, add_special_tokens=False)[-1]
                        if fmt is not None and fmt.call_end is not None else None)
        self.stats = EpisodeStats()

    @torch.no_grad()
    def generate(self, prompt_ids: list[Tensor], *, num_samples: int, greedy: bool = False,
                 rows: Sequence[Mapping[str, Any]] | None = None) -> Completions:
        if self.environment is not None and (rows is None or len(rows) != len(prompt_ids)):
            raise ValueError("an environment starts each episode from its dataset row: pass one row per prompt")
        stats = EpisodeStats()
        episodes = [Episode(prompt_ids[i // num_samples], rows[i // num_samples] if rows is not None else {})
                    for i in range(len(prompt_ids) * num_samples)]
        active = [e for e in episodes if self.environment is None or self._reset(e, stats)]
        first, sampler_logprobs = len(active) == len(episodes), True
        while active:
            generator = self.turn_generator(max(self.max_new_tokens - len(e.tokens) for e in active))
            if first:  # every prompt's samples at once, as a plain rollout
                out = generator.generate(prompt_ids, num_samples=num_samples, greedy=greedy)
                first = False
            else:
                out = generator.generate([e.context() for e in active], num_samples=1, greedy=greedy)
            sampler_logprobs &= out.sampling_logprobs is not None
            still = []
            for row, e in enumerate(active):
                policy = out.mask[row].bool()
                new = out.completion_ids[row][policy].tolist()[: self.max_new_tokens - len(e.tokens)]
                e.add(new, out.sampling_logprobs[row][policy].tolist() if sampler_logprobs else None)
                if self._goes_on(e, new, stats):
                    still.append(e)
            active = still
        stats.turns = [e.turns for e in episodes]
        self.stats = stats
        completions = self._completions(episodes, sampler_logprobs)
        if self.environment is not None:
            completions.rewards = torch.tensor([e.reward for e in episodes])
        return completions

    def _goes_on(self, e: Episode, new: list[int], stats: EpisodeStats) -> bool:
        """After the policy wrote ``new``: insert what comes back and return True when the episode goes on;
        False when it ended (its end-of-sequence token with no environment or a done one, its last
        turn, its token budget)."""
        ended = bool(new) and new[-1] in self.eos_ids
        closed = bool(new) and new[-1] == self.stop_id and not ended
        if not ended and not closed:  # the budget ran out mid-turn
            e.truncated, e.turns = True, e.turns + 1
            return False
        turn = self.tokenizer.decode(e.tokens[e.turn_start:], skip_special_tokens=False) if closed else ""
        if closed and not turn.endswith(self.fmt.call_end):  # the stop token inside other text: go on
            if len(e.tokens) < self.max_new_tokens:
                return True
            e.truncated, e.turns = True, e.turns + 1
            return False
        e.turns += 1
        if ended and isinstance(self.fmt, ChatTemplateCalls):  # a call ends the turn: answer it, or the turn ends
            text = self._template_results(e, new, stats)
            if text is not None:
                return self._insert(e, text, stats)
        if ended:
            if e.environment is None:
                return False
            action = self.tokenizer.decode(e.tokens[e.turn_start:-1], skip_special_tokens=True)
            step = self._step(e, action, stats)
            e.reward += step.reward
            if step.done or e.turns >= self.max_turns:
                return False
            text = self.render(step.observation)
        else:
            if e.turns >= self.max_turns:
                return False
            result, fault = self._result(turn)
            stats.tool_calls += 1
            if fault is not None:
                stats.errors[fault] += 1
            text = self.fmt.result(result)
        return self._insert(e, text, stats)

    def _template_results(self, e: Episode, new: list[int], stats: EpisodeStats) -> str | None:
        """The chat template's rendering of the results of the calls a finished turn made (a malformed call's
        error as its result), or None when the turn made none or was the episode's last."""
        turn = self.tokenizer.decode(e.tokens[e.turn_start:-1], skip_special_tokens=False)
        try:
            calls, results = self.fmt.find_calls(turn), None
        except ValueError as error:
            calls = [ToolCall("malformed_call")]
            results = [self.tools.fault("malformed_call", f"malformed tool call: {error}")]
        if not calls or e.turns >= self.max_turns:
            return None
        results = results or [self.tools.run(call) for call in calls]
        stats.tool_calls += len(calls)
        for _, fault in results:
            if fault is not None:
                stats.errors[fault] += 1
        eos_text = self.tokenizer.decode(new[-1:], skip_special_tokens=False)
        return self.fmt.render_results(self.tokenizer, eos_text, calls, [text for text, _ in results])

    def _insert(self, e: Episode, text: str, stats: EpisodeStats) -> bool:
        """Insert ``text`` after the turn (up to the budget) and start the next turn; False when no room is left."""
        insert = self.tokenizer.encode(text, add_special_tokens=False)
        room = self.max_new_tokens - len(e.tokens)
        e.add(insert[:room], inserted=True)
        stats.inserted_tokens += len(insert[:room])
        e.turn_start = len(e.tokens)
        if len(insert) >= room:  # no room left for the policy to read what came back and answer
            e.truncated = True
            return False
        return True

    def _reset(self, e: Episode, stats: EpisodeStats) -> bool:
        """Start episode ``e``'s environment; False (the episode ends before its first turn) when it raised."""
        try:
            e.environment = self.environment()
            e.environment.reset(e.row)
            return True
        except Exception as error:  # noqa: BLE001 - any failure of user code is reported or counted
            self._environment_fault(f"resetting the environment for {_describe(e.row)} raised {error!r}", stats)
            e.environment, e.reward = None, e.reward + ENVIRONMENT_FAULT_REWARD
            return False

    def _step(self, e: Episode, action: str, stats: EpisodeStats) -> Step:
        try:
            step = e.environment.step(action)
            if not isinstance(step, Step):
                raise TypeError(f"step returned {type(step).__name__}, not posttrain.data.environments.Step")
            if not isinstance(step.observation, str):
                raise TypeError(f"the observation is {type(step.observation).__name__}, not text")
            if not math.isfinite(float(step.reward)):
                raise ValueError(f"the reward is {step.reward}")
            return step
        except Exception as error:  # noqa: BLE001 - any failure of user code is reported or counted
            self._environment_fault(f"the environment's step at turn {e.turns} of {_describe(e.row)} raised "
                                    f"{error!r}", stats)
            return Step(reward=ENVIRONMENT_FAULT_REWARD, done=True)

    def _environment_fault(self, message: str, stats: EpisodeStats) -> None:
        if self.on_error == "raise":
            raise EnvironmentFault(message)
        stats.environment_errors += 1

    def _result(self, turn: str) -> tuple[str, str | None]:
        try:
            call = self.fmt.parse(turn)
        except ValueError as error:
            return self.tools.fault("malformed_call", f"malformed tool call: {error}")
        return self.tools.run(call)

    def _completions(self, episodes: list[Episode], sampler_logprobs: bool) -> Completions:
        width = max(1, max(len(e.tokens) for e in episodes))
        ids = torch.full((len(episodes), width), self.pad_id, dtype=torch.long)
        inserted = torch.zeros(len(episodes), width, dtype=torch.bool)
        logprobs = torch.zeros(len(episodes), width) if sampler_logprobs else None
        for row, e in enumerate(episodes):
            ids[row, : len(e.tokens)] = torch.tensor(e.tokens, dtype=torch.long)
            inserted[row, : len(e.tokens)] = torch.tensor(e.inserted, dtype=torch.bool)
            if logprobs is not None:
                logprobs[row, : len(e.tokens)] = torch.tensor(e.logprobs)
        held = torch.arange(width)[None, :] < torch.tensor([len(e.tokens) for e in episodes])[:, None]
        policy = (held & ~inserted).float()  # every position an episode holds, less the inserted ones
        return Completions(ids, policy, torch.tensor([e.truncated for e in episodes]), sampling_logprobs=logprobs,
                           inserted=inserted)


@dataclass
class Episode:
    """One episode as it is played: its prompt and row, the ids so far (the policy's and the inserted
    ones, marked), the sampler's log-probs of the policy's (0 for inserted ones), and what it scored."""

    prompt: Tensor
    row: Mapping[str, Any]
    environment: Environment | None = None
    tokens: list[int] = field(default_factory=list)
    inserted: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turn_start: int = 0
    """Where the current turn began in ``tokens``."""
    turns: int = 0
    truncated: bool = False
    reward: float = 0.0
    """The environment's, summed over its steps."""

    def add(self, ids: list[int], logprobs: list[float] | None = None, *, inserted: bool = False) -> None:
        self.tokens += ids
        self.inserted += [inserted] * len(ids)
        self.logprobs += logprobs[: len(ids)] if logprobs is not None else [0.0] * len(ids)

    def context(self) -> Tensor:
        """What the next turn reads: the prompt and everything so far."""
        return torch.cat([self.prompt, torch.tensor(self.tokens, dtype=torch.long)])


def _describe(row: Mapping[str, Any]) -> str:
    prompt = str(row.get("prompt", ""))
    return f"the row with prompt {prompt[:60]!r}" + ("..." if len(prompt) > 60 else "")
