"""Playing one episode of a verifiers env: its ``setup``, ``run`` and ``finalize`` on an event loop of its own,
with the policy's turns supplied from outside (:mod:`posttrain.data.tasks.verifiers` says what maps to what).

The env asks its seat's harness for a turn through ``interaction.turn(message)``; here the seat is played by
posttrain, so each turn is handed in by :meth:`Play.reply` and committed to the seat's ``vf.Trace`` through
verifiers' own graph, as its interception server commits a model call.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any

MODEL_NAME = "posttrain"
"""The model name stamped on the traces' committed responses."""


class PlayError(RuntimeError):
    """The env did something posttrain's episodes cannot hold: the message says what."""


def opening(data: Any) -> list[Any]:
    """The messages verifiers' chat harness opens with: the system prompt, then the prompt."""
    import verifiers.v1 as vf

    system = [vf.SystemMessage(content=data.system_prompt)] if data.system_prompt else []
    if data.prompt is None:
        return system
    return [*system, *([vf.UserMessage(content=data.prompt)] if isinstance(data.prompt, str) else data.prompt)]


class Play:
    """One episode of the env on one task, on its own event loop: ``Env.setup``, ``run`` and ``finalize``
    as verifiers runs them, with the policy's turns supplied from outside. ``start()`` runs the env until
    it asks the policy for a turn and returns what the policy reads first; ``reply(text)`` hands it the
    turn and returns the env's next messages, or None when the episode is over (``reward()``)."""

    def __init__(self, loaded: Any, task: Any):  # a verifiers.Loaded
        self.loaded, self.task = loaded, task
        self.loop = asyncio.new_event_loop()
        self.sent: list[Any] = []  # the conversation the policy has read and written so far
        self.asked: asyncio.Future | None = None  # resolves to the new messages when the policy owes a turn
        self.answer: asyncio.Future | None = None
        self.seat: str | None = None  # the env's seat the policy plays
        self.traces: list[Any] = []  # the policy's, finished and live
        self.run: asyncio.Task | None = None

    def start(self) -> list[Any] | None:
        self.run = self.loop.create_task(self._episode())
        return self._until_asked()

    def reply(self, text: str) -> list[Any] | None:
        self.answer.set_result(text)
        return self._until_asked()

    def reward(self) -> float:
        """The episode's reward: the policy's traces' weighted rewards (``Trace.reward``)."""
        return sum(trace.reward for trace in self.traces)

    def reward_so_far(self) -> float:
        """What the episode would score if it ended now: the live trace scored as a stopped run is."""
        *done, live = self.traces
        scored = live.model_copy(update={"rewards": dict(live.rewards), "metrics": dict(live.metrics)})
        self.loop.run_until_complete(self.task.score(scored))
        return sum(trace.reward for trace in done) + scored.reward

    def close(self) -> None:
        shut_down(self.loop, self.run)

    def _until_asked(self) -> list[Any] | None:
        self.asked = self.loop.create_future()
        self.loop.run_until_complete(asyncio.wait([self.asked, self.run], return_when=asyncio.FIRST_COMPLETED))
        if self.asked.done():
            return self.asked.result()
        self.run.result()  # the env's own error, if it raised
        return None

    async def ask(self, seat: str, request: list[Any]) -> str:
        """The policy's next turn after ``request``, which must extend the conversation so far."""
        import verifiers.v1 as vf

        if self.seat not in (None, seat):
            raise PlayError(f"the env asked seats {self.seat!r} and {seat!r} for turns; posttrain plays one seat, "
                            "the policy's")
        if request[: len(self.sent)] != self.sent:
            raise PlayError("the env started a second conversation or rewrote earlier messages: a posttrain "
                            "episode is one conversation, token by token")
        self.seat, new = seat, request[len(self.sent):]
        self.answer = self.loop.create_future()
        self.asked.set_result(new)
        text = await self.answer
        self.sent = [*request, vf.AssistantMessage(content=text)]
        return text

    async def _episode(self) -> None:
        import verifiers.v1 as vf
        from verifiers.v1.episode import EnvInfo

        env, task = self.loaded.env, self.task
        seats = Seats(self, env.config)
        await env.setup(seats)
        await env.run(task, seats)
        episode = vf.Episode(env=EnvInfo(id=env.config.env_id), task=trace_task(task), traces=self.traces, ok=True)
        await env.finalize(task, episode)


def shut_down(loop: asyncio.AbstractEventLoop, run: asyncio.Task | None) -> None:
    """Cancel an episode's run (its ``finally`` blocks run) and close its loop."""
    if loop.is_closed():
        return
    if run is not None and not run.done():
        run.cancel()
        try:
            loop.run_until_complete(asyncio.wait([run]))
        except RuntimeError:  # collected while another episode's loop runs: its finally blocks do not run
            run.get_coro().close()
    loop.close()


def trace_task(task: Any) -> Any:
    import verifiers.v1 as vf

    return vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash)


class Seats:
    """The env's ``agents``: one :class:`Seat` per ``AgentConfig`` field of its config, by name."""

    def __init__(self, play: Play, config: Any):
        from verifiers.v1.configs.agent import agent_config_fields

        self._seats = {name: Seat(play, name, spec) for name, spec in agent_config_fields(config).items()}

    def __getattr__(self, name: str) -> Seat:
        seats = self.__dict__.get("_seats")
        if seats is None or name not in seats:
            raise AttributeError(f"no agent {name!r}; this config declares {sorted(seats or {})}")
        return seats[name]


class Seat:
    """An agent of the env whose turns the policy plays (``run`` and ``interaction``, as ``vf.Agent``'s)."""

    def __init__(self, play: Play, name: str, config: Any):
        self.play, self.name, self.config = play, name, config
        self.trainable = True

    async def run(self, task: Any, **_: Any) -> Any:
        """One rollout on ``task``'s prompt: the policy's reply (its tool calls run in posttrain's tool loop)."""
        async with self.interaction(task) as interaction:
            await interaction.turn()
            interaction.trace.stop("agent_completed")
        return interaction.trace

    @asynccontextmanager
    async def interaction(self, task: Any, **_: Any):
        if not self.trainable:
            raise PlayError(f"the env's seat {self.name!r} is not the policy's and needs a model of its own; "
                            "posttrain plays the policy's seat only")
        interaction = Interaction(self, task)
        self.play.traces.append(interaction.trace)
        try:
            yield interaction
        finally:
            await interaction.close()


class Interaction:
    """``vf.Interaction``'s ``turn`` and ``trace``: each turn is one policy turn, committed to the trace."""

    def __init__(self, seat: Seat, task: Any):
        import verifiers.v1 as vf

        self.seat, self.task = seat, task
        self.trace = vf.Trace(task=trace_task(task), agent=vf.AgentInfo(config=seat.config, name=seat.name))
        self.messages: list[Any] = opening(task.data)
        self.started = self.over = self.closed = False

    async def turn(self, message: Any = None) -> Any:
        import verifiers.v1 as vf
        from verifiers.v1.dialects import parse_message
        from verifiers.v1.graph import prepare_turn

        if self.over:
            raise RuntimeError("the exchange is over (the run ended); read interaction.trace")
        prompted = not self.started and self.task.data.prompt is not None
        if message is None and not prompted:
            raise ValueError("nothing to run a turn on: a bare turn() takes a prompted task's opening reply")
        if message is not None and prompted:
            raise ValueError("the task's prompt opens this exchange: take its first reply with a bare turn()")
        new = ([] if message is None else [vf.UserMessage(content=message)] if isinstance(message, str)
               else [parse_message(m) if isinstance(m, dict) else m for m in message])
        self.started = True
        if await self._stopped():
            self.over = True
            return vf.Segment(messages=[], terminated=True)
        request = [*self.messages, *new]
        text = await self.seat.play.ask(self.seat.name, request)
        reply = vf.AssistantMessage(content=text)
        response = vf.Response(id=uuid.uuid4().hex, created=int(time.time()), model=MODEL_NAME, message=reply,
                               finish_reason="stop")
        prepare_turn(self.trace, request).commit(response)
        self.messages = [*request, reply]
        return vf.Segment(messages=[reply])

    async def send(self, *_: Any, **__: Any) -> dict:
        raise PlayError("steering (Interaction.send/steer) is not supported: posttrain plays one turn at a time")

    steer = send

    async def _stopped(self) -> bool:
        """The task's ``@vf.stop`` checks on the trace, run before each turn as verifiers' session runs them."""
        import verifiers.v1 as vf
        from verifiers.v1.session import call_hook, hook_boundary

        for stop in self.task.hooks("stop"):
            if hook_boundary(stop, allow_trace=True) is not vf.Trace:
                raise PlayError(f"@vf.stop {stop.__name__} checks a model request or response; posttrain runs the "
                                "checks on the trace only")
            if await call_hook(stop, {vf.Trace: self.trace}):
                self.trace.stop(stop.__name__)
                return True
        return self.trace.stop_condition is not None

    async def close(self) -> Any:
        """End the exchange and score the trace with the task's rewards (no runtime, as verifiers offline)."""
        if not self.closed:
            self.closed = True
            self.trace.stop("user_closed")  # keeps a stop already set
            await self.task.score(self.trace)
            self.trace.is_completed = self.trace.ok = True
        return self.trace
