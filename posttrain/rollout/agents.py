"""The user's own agent as a rollout: its code calls an OpenAI-compatible endpoint, and every call is recorded.

``--agent FILE.py:FUNCTION`` (or ``module:function``) names ``function(client, row) -> float | None``.
Each episode runs the function once with ``client``, an ``openai.OpenAI`` (an ``openai.AsyncOpenAI`` for
an ``async def``) pointed at ``/episodes/{episode}/v1`` of a local endpoint
(:class:`~posttrain.rollout.openai_api.EndpointServer`), and ``row``, the dataset row. The agent does what it
does (its own tools, its own loop, the OpenAI Agents SDK); each chat-completions call is answered by the
run's sampler, and the number it returns is the episode's reward (:mod:`posttrain.training.workload`).

Token in, token out. The first call's messages are rendered by the chat template (with the request's tools)
into the episode's prompt. Each answer is the sampled token ids, parsed by the run's tool format into the
message the agent reads (``content`` and ``tool_calls``). A later call must continue the conversation: the
messages already recorded, then the answer the policy gave (one of the ``n`` choices), then new messages;
only the new messages are rendered, as the chat template writes them after that answer (tool results with
the format's ``render_results``, a user message as the template's next user turn), and inserted. The
episode is the exact sequence the policy read and wrote: its answers trained on (``mask``), everything else
context (``inserted``), never re-tokenized. What cannot be one sequence is dropped, counted in
``episode/dropped/not_one_sequence`` with the reason said once: a call whose history differs from the
recorded one (a rewritten or shortened history, a second conversation, a sub-agent), a system message in
the middle, tool results followed by other messages. Its group leaves the update; its calls are still
answered, so the agent runs to its end.

Episodes run concurrently, one thread each (one event loop for ``async def`` agents), and their calls are
batched: the trainer's thread waits until every running episode is waiting on the model (or
:data:`BATCH_WINDOW` passes with no new call), then samples every pending call in one ``generate``. An
agent that raises, returns something that is not a number or None, never calls the model, or runs past
``agent_timeout`` is dropped and counted (``episode/dropped/agent_error``, ``no_model_call``, ``timeout``);
the step goes on.

The run's sampling settings are used: a request's ``temperature`` or ``top_p`` that differs is said once
and not followed, since the trainer computes log-probs at the run's temperature. ``stop`` strings end an
answer where they appear (the tokens up to the one that completes the string are recorded, the text before
it returned). With ``n`` > 1 the episode continues with the choice the agent sends back; an episode's last
call's choices are recorded as its first.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import queue
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from posttrain.data.prompts import renders_tools, with_tool_descriptions
from posttrain.parallel.distributed import say
from posttrain.rollout.completions import Completions, Generator, SamplingParams
from posttrain.rollout.episodes import EpisodeStats
from posttrain.rollout.openai_api import (
    ChatRequest,
    Choice,
    EndpointServer,
    FunctionCall,
    Message,
    Pending,
    RequestError,
    chat_response,
)
from posttrain.rollout.tool_formats import ChatTemplateCalls

BATCH_WINDOW = 0.02
"""Seconds the batcher waits for one more call once one is pending and some episodes are not waiting."""
DROPS = ("agent_error", "no_model_call", "not_one_sequence", "timeout")
"""Why an agent's episode is dropped (``episode/dropped/KIND``)."""


class NotOneSequence(ValueError):
    """A call that does not continue its episode's recorded conversation; the message says where it differs."""


@dataclass
class Agent:
    """The user's function and how to load it again (a spec pickles; the rollout process loads it)."""

    fn: Callable[..., Any]
    spec: str | None = None

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)

    def __getstate__(self) -> dict:
        return {"spec": self.spec} if self.spec else {"fn": self.fn, "spec": None}

    def __setstate__(self, state: dict) -> None:
        self.spec = state["spec"]
        self.fn = state["fn"] if self.spec is None else load_agent(self.spec).fn


def load_agent(spec: str) -> Agent:
    """The agent ``FILE.py:FUNCTION`` or ``module:function`` names; a ValueError naming what is missing."""
    location, sep, name = spec.rpartition(":")
    if not sep or not location or not name:
        raise ValueError(f"agent: {spec!r} is not FILE.py:FUNCTION or module:function")
    if location.endswith(".py") or Path(location).is_file():
        from posttrain.data.rewards import load_reward_function

        return Agent(load_reward_function(spec, "agent"), spec)
    try:
        module = importlib.import_module(location)
    except ImportError as error:
        raise ValueError(f"agent: cannot import module {location!r} (from {spec!r}): {error}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"agent: module {location!r} has no function {name!r}")
    return Agent(fn, spec)


@dataclass
class Sampled:
    """One choice of a call: the ids sampled (with their log-probs), the message the agent reads, and whether
    the ids end with an end-of-turn token (a ``stop`` string or the budget can end them earlier)."""

    tokens: list[int]
    logprobs: list[float]
    choice: Choice
    ended: bool


@dataclass
class AgentEpisode:
    """One run of the agent: the conversation it sent last, the tokens recorded, what it came to."""

    key: str
    row: Mapping[str, Any]
    prompt: list[int] | None = None
    conversation: tuple[Message, ...] = ()
    tokens: list[int] = field(default_factory=list)
    inserted: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    last: list[Sampled] | None = None
    """The choices of the last call, until the next call shows which one the agent kept."""
    calls: int = 0
    tool_calls: int = 0
    truncated: bool = False
    dropped: str | None = None
    reward: float | None = None
    finished: bool = False

    def add(self, ids: list[int], logprobs: list[float] | None = None, *, inserted: bool = False) -> None:
        self.tokens += ids
        self.inserted += [inserted] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)

    def keep(self, sampled: Sampled) -> None:
        """Record a choice as the policy's turn."""
        self.add(sampled.tokens, sampled.logprobs)
        self.tool_calls += len(sampled.choice.message.tool_calls)
        self.last = None


@dataclass
class Finished:
    """An agent function's end, as its thread reports it."""

    key: str
    value: Any = None
    error: str | None = None


@dataclass
class Job:
    pending: Pending
    episode: AgentEpisode
    context: list[int]
    room: int
    recorded: bool


class AgentGenerator:
    """A :class:`~posttrain.rollout.completions.Generator` whose completions are the user's agent's episodes.

    ``sampler`` is the run's (:func:`posttrain.rollout.factory.build`), stopping at ``eos_ids`` (with a
    chat-template format, its end-of-turn tokens too) and, with a mid-turn format, at the last token of its
    ``call_end``. It holds the weights: this generator's capabilities are its.
    """

    def __init__(self, agent: Agent, sampler: Generator, tokenizer: Any, fmt: Any, params: SamplingParams, *,
                 eos_ids: Sequence[int], pad_id: int, timeout: float):
        self.agent, self.sampler, self.tokenizer, self.fmt, self.params = agent, sampler, tokenizer, fmt, params
        self.eos_ids, self.pad_id, self.timeout = list(eos_ids), pad_id, timeout
        self.turn_ends = set(self.eos_ids)
        mid_turn = fmt is not None and not isinstance(fmt, ChatTemplateCalls)
        self.stop_id = tokenizer.encode(fmt.call_end, add_special_tokens=False)[-1] if mid_turn else None
        self.stats = EpisodeStats()
        self._said: set[str] = set()
        self._server: EndpointServer | None = None
        self._episodes: dict[str, AgentEpisode] = {}
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._has_logprobs = True

    # -- what the trainer reads --------------------------------------------------------------------

    @property
    def capabilities(self) -> Any:
        return self.sampler.capabilities

    @property
    def sync_check(self) -> Any:
        return getattr(self.sampler, "sync_check", None)

    @sync_check.setter
    def sync_check(self, check: Any) -> None:
        self.sampler.sync_check = check

    def for_model(self, model: Any) -> AgentGenerator:
        """The same agent on a sampler of ``model`` (asynchronous rollouts' copy of the policy)."""
        return AgentGenerator(self.agent, self.sampler.for_model(model), self.tokenizer, self.fmt, self.params,
                              eos_ids=self.eos_ids, pad_id=self.pad_id, timeout=self.timeout)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.update(_server=None, _episodes={}, _queue=None, _lock=None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._queue, self._lock = queue.Queue(), threading.Lock()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    # -- a batch of episodes ------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompt_ids: list[Tensor], *, num_samples: int, greedy: bool = False,
                 rows: Sequence[Mapping[str, Any]] | None = None) -> Completions:
        if rows is None or len(rows) != len(prompt_ids):
            raise ValueError("an agent starts each episode from its dataset row: pass one row per prompt")
        if self._server is None:
            self._server = EndpointServer(self._dispatch)
        episodes = [AgentEpisode(uuid.uuid4().hex[:16], rows[i // num_samples])
                    for i in range(len(prompt_ids) * num_samples)]
        with self._lock:
            self._episodes.update({e.key: e for e in episodes})
        self._queue, self._has_logprobs = queue.Queue(), True
        runner = self._start(episodes)
        try:
            self._serve({e.key: e for e in episodes}, greedy)
        finally:
            with self._lock:
                for e in episodes:
                    self._episodes.pop(e.key, None)
            self._refuse_waiting()
            runner()
        stats = EpisodeStats(turns=[e.calls for e in episodes],
                             tool_calls=sum(e.tool_calls for e in episodes),
                             inserted_tokens=sum(sum(e.inserted) for e in episodes),
                             dropped={kind: sum(e.dropped == kind for e in episodes) for kind in DROPS})
        self.stats = stats
        return self._completions(episodes, prompt_ids, num_samples)

    def _start(self, episodes: list[AgentEpisode]) -> Callable[[], None]:
        """Run the agent once per episode, each reporting :class:`Finished` on the queue; returns what lets
        them go (threads still running past the timeout are left to end by themselves)."""
        import openai

        base = self._server.base_url
        q = self._queue

        if self.agent.is_async:
            async def one(e: AgentEpisode) -> None:
                client = openai.AsyncOpenAI(base_url=base(e.key), api_key="posttrain", max_retries=0,
                                            timeout=self.timeout or None)
                try:
                    value = await asyncio.wait_for(self.agent.fn(client, dict(e.row)), self.timeout or None)
                    q.put(Finished(e.key, value))
                except Exception as error:  # noqa: BLE001 - the user's code: counted, the episode dropped
                    q.put(Finished(e.key, error=_brief(error)))
                finally:
                    await client.close()

            async def every() -> None:
                await asyncio.gather(*(one(e) for e in episodes))

            thread = threading.Thread(target=asyncio.run, args=(every(),), name="posttrain-agents", daemon=True)
            thread.start()
            return lambda: None

        def one_sync(e: AgentEpisode) -> None:
            client = openai.OpenAI(base_url=base(e.key), api_key="posttrain", max_retries=0,
                                   timeout=self.timeout or None)
            try:
                q.put(Finished(e.key, self.agent.fn(client, dict(e.row))))
            except Exception as error:  # noqa: BLE001 - the user's code: counted, the episode dropped
                q.put(Finished(e.key, error=_brief(error)))
            finally:
                client.close()

        pool = ThreadPoolExecutor(max_workers=len(episodes), thread_name_prefix="posttrain-agent")
        for e in episodes:
            pool.submit(one_sync, e)
        return lambda: pool.shutdown(wait=False)

    def _refuse_waiting(self) -> None:
        """Answer the calls still queued when a batch ends (their agents ran out of time) with 410."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, Pending):
                item.fail(RequestError(410, f"episode {item.episode} is over"))

    def _dispatch(self, key: str, request: ChatRequest) -> dict:
        """An endpoint thread's request: queued for the trainer's thread, whose answer it waits for."""
        with self._lock:
            episode = self._episodes.get(key)
        if episode is None:
            raise RequestError(410, f"episode {key} is over (its batch was trained on) or was never started")
        pending = Pending(key, request)
        self._queue.put(pending)
        if not pending.done.wait(self.timeout or None):
            raise RequestError(504, "the trainer did not answer in agent_timeout")
        if pending.error is not None:
            raise pending.error
        return pending.answer

    def _serve(self, episodes: dict[str, AgentEpisode], greedy: bool) -> None:
        """Answer calls in batches until every episode finished or ran out of time."""
        live, deadline = set(episodes), time.monotonic() + (self.timeout or math.inf)
        while live:
            items = self._collect(live, deadline)
            for item in items:
                if isinstance(item, Finished) and item.key in live:
                    self._finish(episodes[item.key], item)
                    live.discard(item.key)
            self._answer([p for p in items if isinstance(p, Pending)], episodes, greedy)
            if time.monotonic() >= deadline:
                for key in live:
                    self._drop(episodes[key], "timeout", f"the agent ran past agent_timeout {self.timeout:g} s")
                    episodes[key].finished = True
                break

    def _collect(self, live: set[str], deadline: float) -> list[Any]:
        """What the queue holds: at least one item (or none by the deadline), then more while some live episode
        is not waiting on the model and calls keep arriving within :data:`BATCH_WINDOW`."""
        try:
            items = [self._queue.get(timeout=max(0.0, min(deadline - time.monotonic(), 3600.0)))]
        except queue.Empty:
            return []
        while True:
            waiting = {p.episode for p in items if isinstance(p, Pending)}
            done = {f.key for f in items if isinstance(f, Finished)}
            if len(live - done - waiting) == 0:
                return items
            try:
                items.append(self._queue.get(timeout=BATCH_WINDOW))
            except queue.Empty:
                return items

    def _finish(self, e: AgentEpisode, item: Finished) -> None:
        e.finished = True
        if e.last:  # the last call's answer: its first choice
            e.keep(e.last[0])
        if item.error is not None:
            return self._drop(e, "agent_error", f"the agent raised {item.error}")
        value = item.value
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value)):
            return self._drop(e, "agent_error", f"the agent returned {value!r}, not a number or None")
        if e.prompt is None:
            return self._drop(e, "no_model_call", "the agent returned without calling the model")
        e.reward = None if value is None else float(value)

    def _drop(self, e: AgentEpisode, kind: str, why: str) -> None:
        if e.dropped is not None:
            return
        e.dropped = kind
        if kind not in self._said:  # once per kind: the counts say how often
            self._said.add(kind)
            prompt = str(e.row.get("prompt", ""))[:60]
            say(f"agent: an episode was dropped ({kind}, counted in episode/dropped/{kind}): {why} "
                f"(row with prompt {prompt!r})")

    # -- answering calls ----------------------------------------------------------------------------

    def _answer(self, pendings: list[Pending], episodes: dict[str, AgentEpisode], greedy: bool) -> None:
        jobs = []
        for p in pendings:
            e = episodes.get(p.episode)
            if e is None or e.finished:
                p.fail(RequestError(410, f"episode {p.episode} is over"))
                continue
            self._notice(p.request)
            try:
                jobs.append(self._job(p, e))
            except RequestError as error:
                p.fail(error)
        todo = [job for job in jobs if job.room > 0]
        for job in jobs:
            if job.room <= 0:  # the episode's token budget is spent: nothing more is sampled or recorded
                job.episode.truncated = True
                job.pending.reply(chat_response(job.pending.request, [Choice(Message("assistant"), "length")] *
                                                job.pending.request.n, len(job.context), 0))
        if not todo:
            return
        each = [job for job in todo for _ in range(job.pending.request.n)]  # n choices: n rows of one context
        sampled = self._sample([job.context for job in each], [job.room for job in each],
                               [bool(job.pending.request.tools) for job in each], greedy)
        start = 0
        for job in todo:
            n = job.pending.request.n
            choices = [self._choice(job.pending.request, tokens, logprobs, job.room)
                       for tokens, logprobs in sampled[start:start + n]]
            start += n
            if job.recorded:
                job.episode.last, job.episode.calls = choices, job.episode.calls + 1
            job.pending.reply(chat_response(job.pending.request, [c.choice for c in choices], len(job.context),
                                            sum(len(c.tokens) for c in choices)))

    def _notice(self, request: ChatRequest) -> None:
        for name, asked, used in (("temperature", request.temperature, self.params.temperature),
                                  ("top_p", request.top_p, self.params.top_p)):
            if asked is not None and asked != used and name not in self._said:
                self._said.add(name)
                say(f"agent: a call asks for {name} {asked:g}; the run samples at {used:g} (--{name.replace('_', '-')}),"
                    " the distribution the trainer computes log-probs at")

    def _job(self, p: Pending, e: AgentEpisode) -> Job:
        """What a call samples from: its episode's recorded context with the call's new messages inserted, or
        (the episode dropped) the call rendered alone."""
        request, recorded = p.request, e.dropped is None
        if recorded:
            try:
                context = self._continue(e, request)
            except NotOneSequence as error:
                self._drop(e, "not_one_sequence", f"call {e.calls + 1}: {error}")
                recorded = False
        if not recorded:
            context = self._render(request)
        room = self.params.max_new_tokens - len(e.tokens) if recorded else self.params.max_new_tokens
        if request.max_tokens is not None:
            room = min(room, request.max_tokens)
        return Job(p, e, context, room, recorded)

    def _continue(self, e: AgentEpisode, request: ChatRequest) -> list[int]:
        """The episode's context for ``request``: its prompt on the first call, else the recorded ids with the
        kept answer and the new messages' rendering added."""
        sent = request.messages
        if e.prompt is None:
            e.prompt, e.conversation = self._render(request), sent
            return e.prompt
        if e.truncated:  # the budget is spent: answered with nothing from here on (finish_reason length)
            return [*e.prompt, *e.tokens]
        known = e.conversation
        for i, (old, new) in enumerate(zip(known, sent)):
            if not old.same_as(new):
                raise NotOneSequence(f"message {i} ({new.role}) differs from the one call {e.calls} sent")
        if len(sent) <= len(known) or sent[len(known)].role != "assistant":
            raise NotOneSequence(f"the messages do not go on from the {len(known)} call {e.calls} sent with the "
                                 "policy's answer")
        if e.last is None:  # the previous call is in this batch too: two calls of one episode at once
            raise NotOneSequence(f"two calls at once after call {e.calls}")
        answer = sent[len(known)]
        kept = next((c for c in e.last if c.choice.message.same_as(answer)), None)
        if kept is None:
            raise NotOneSequence(f"message {len(known)} is not the answer the policy gave")
        e.keep(kept)
        new = sent[len(known) + 1:]
        text = self._after(kept, new)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        room = self.params.max_new_tokens - len(e.tokens)
        e.add(ids[:room], inserted=True)
        e.conversation = sent
        if len(ids) >= room:
            e.truncated = True
        return [*e.prompt, *e.tokens]

    def _after(self, kept: Sampled, new: Sequence[Message]) -> str:
        """The text the model reads after its answer ``kept``: the new messages as the format and the chat
        template write them."""
        calls = kept.choice.message.tool_calls
        if not new:
            raise NotOneSequence("no new message after the policy's answer")
        if calls:
            results = {m.tool_call_id: m.content for m in new if m.role == "tool"}
            if len(new) != len(calls) or any(m.role != "tool" for m in new) or set(results) != {c.id for c in calls}:
                raise NotOneSequence(f"the answer made {len(calls)} call(s); the messages after it must be their "
                                     f"results, one tool message each (got {', '.join(m.role for m in new)})")
            ordered = [results[c.id] for c in calls]
            if not isinstance(self.fmt, ChatTemplateCalls):  # a mid-turn call: its result, and the turn goes on
                return self.fmt.result(ordered[0])
            from posttrain.rollout.tool_formats import ToolCall

            return self.fmt.render_results(self.tokenizer, self._turn_end(kept),
                                           [ToolCall(c.name, c.arguments, id=c.id) for c in calls], ordered)
        if len(new) != 1 or new[0].role != "user":
            raise NotOneSequence("after an answer without calls comes one user message (got "
                                 f"{', '.join(m.role for m in new)})")
        return self._user_turn(new[0].content, kept)

    def _turn_end(self, kept: Sampled) -> str:
        return self.tokenizer.decode(kept.tokens[-1:] if kept.ended else self.eos_ids[:1], skip_special_tokens=False)

    def _user_turn(self, text: str, kept: Sampled) -> str:
        """A user message after the answer, as the chat template's next user turn (the answer's end-of-turn
        included where a ``stop`` string or the budget ended it first); the text as it is without a template."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            return text
        marker = "\u2063turn\u2063"
        before = [{"role": "user", "content": "-"}, {"role": "assistant", "content": marker}]
        prefix = self.tokenizer.apply_chat_template(before, tokenize=False)
        full = self.tokenizer.apply_chat_template([*before, {"role": "user", "content": text}], tokenize=False,
                                                  add_generation_prompt=True)
        after = prefix[prefix.rindex(marker) + len(marker):]
        end = self._turn_end(kept)
        if not full.startswith(prefix) or not after.startswith(end):
            raise NotOneSequence(f"the chat template does not write a user turn after an answer ending with {end!r}")
        return (after[len(end):] if kept.ended else after) + full[len(prefix):]

    def _render(self, request: ChatRequest) -> list[int]:
        """A first call's messages (and tools) as the prompt: the chat template's, with the generation prompt;
        without a template, the messages' texts one per line."""
        messages = [m.for_template() for m in request.messages]
        if getattr(self.tokenizer, "chat_template", None) is None:
            return self.tokenizer("\n".join(m["content"] for m in messages))["input_ids"]
        tools = list(request.tools) or None
        if tools and not renders_tools(self.tokenizer):
            messages = with_tool_descriptions(messages, tools)
        return list(self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                       tokenize=True, return_dict=False))

    def _sample(self, contexts: list[list[int]], rooms: list[int], tools: list[bool],
                greedy: bool) -> list[tuple[list[int], list[float]]]:
        """Each context's answer, up to its room: one ``generate`` for all, again for the answers that stopped
        at the call-end token without closing a call the request can take (a mid-turn format's marker inside
        other text, or a request with no tools)."""
        out: list[list[int]] = [[] for _ in contexts]
        logprobs: list[list[float]] = [[] for _ in contexts]
        active = list(range(len(contexts)))
        while active:
            batch = self.sampler.generate([torch.tensor([*contexts[i], *out[i]], dtype=torch.long) for i in active],
                                          num_samples=1, greedy=greedy)
            still = []
            for row, i in enumerate(active):
                policy = batch.mask[row].bool()
                new = batch.completion_ids[row][policy].tolist()[: rooms[i] - len(out[i])]
                out[i] += new
                self._has_logprobs &= batch.sampling_logprobs is not None
                logprobs[i] += (batch.sampling_logprobs[row][policy].tolist()[: len(new)]
                                if batch.sampling_logprobs is not None else [0.0] * len(new))
                at_call = bool(new) and new[-1] == self.stop_id and new[-1] not in self.turn_ends
                if at_call and len(out[i]) < rooms[i] and not (
                        tools[i] and self.tokenizer.decode(out[i], skip_special_tokens=False).endswith(self.fmt.call_end)):
                    still.append(i)
            active = still
        return list(zip(out, logprobs))

    def _choice(self, request: ChatRequest, tokens: list[int], logprobs: list[float], room: int) -> Sampled:
        """The message an answer's ids say, and why it ended."""
        decode = self.tokenizer.decode
        for end in range(1, len(tokens) + 1) if request.stop else ():  # the first token that completes a stop string
            text = decode(tokens[:end], skip_special_tokens=True)
            hits = [text.find(s) for s in request.stop if s in text]
            if hits:
                return Sampled(tokens[:end], logprobs[:end], Choice(Message("assistant", text[:min(hits)]), "stop"),
                               ended=False)
        ended = bool(tokens) and tokens[-1] in self.turn_ends
        body = tokens[:-1] if ended else tokens
        turn = decode(body, skip_special_tokens=False)
        calls: list[FunctionCall] = []
        content = decode(body, skip_special_tokens=True)
        if request.tools and self.fmt is not None:
            try:
                if isinstance(self.fmt, ChatTemplateCalls) and ended:
                    found = self.fmt.find_calls(turn)
                elif self.stop_id is not None and tokens and tokens[-1] == self.stop_id and turn.endswith(self.fmt.call_end):
                    found = [self.fmt.parse(turn)]
                    content = self.fmt.before(turn)
                else:
                    found = []
            except ValueError:  # a malformed call: the agent reads the text as the policy wrote it
                found = []
            for call in found:
                arguments = dict(call.arguments)
                if call.positional:  # a format of one positional argument: the tool's first parameter
                    arguments = {request.first_parameter(call.name) or "input": call.positional[0], **arguments}
                calls.append(FunctionCall(call.id or uuid.uuid4().hex[:9], call.name, arguments))
        if isinstance(self.fmt, ChatTemplateCalls) and ended:  # reasoning and call markup are not content
            content = self.fmt.content(turn)
        finish = "tool_calls" if calls else "stop" if ended else "length" if len(tokens) >= room else "stop"
        return Sampled(tokens, logprobs, Choice(Message("assistant", content, tuple(calls)), finish), ended)

    # -- the batch's completions --------------------------------------------------------------------

    def _completions(self, episodes: list[AgentEpisode], prompt_ids: list[Tensor], g: int) -> Completions:
        width = max(1, max(len(e.tokens) for e in episodes))
        ids = torch.full((len(episodes), width), self.pad_id, dtype=torch.long)
        inserted = torch.zeros(len(episodes), width, dtype=torch.bool)
        logprobs = torch.zeros(len(episodes), width)
        dropped = torch.tensor([e.dropped is not None for e in episodes])
        prompts = []
        for row, e in enumerate(episodes):
            if e.dropped is None:
                ids[row, : len(e.tokens)] = torch.tensor(e.tokens, dtype=torch.long)
                inserted[row, : len(e.tokens)] = torch.tensor(e.inserted, dtype=torch.bool)
                logprobs[row, : len(e.tokens)] = torch.tensor(e.logprobs)
            prompts.append(torch.tensor(e.prompt, dtype=torch.long) if e.prompt is not None and e.dropped is None
                           else prompt_ids[row // g])
        lengths = torch.tensor([0 if e.dropped else len(e.tokens) for e in episodes])
        held = torch.arange(width)[None, :] < lengths[:, None]
        rewards = torch.tensor([0.0 if e.dropped else math.nan if e.reward is None else e.reward for e in episodes])
        return Completions(ids, (held & ~inserted).float(), torch.tensor([e.truncated for e in episodes]),
                           sampling_logprobs=logprobs if self._has_logprobs else None, inserted=inserted, rewards=rewards, prompt_ids=prompts,
                           dropped=dropped)


def _brief(error: BaseException) -> str:
    """An exception as one line: its repr and where in the user's code it was raised."""
    frames = traceback.extract_tb(error.__traceback__)
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    return f"{error!r}{where}"
