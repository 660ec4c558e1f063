"""Generation in a process of its own: the sampler of asynchronous rollouts.

The trainer hands a :class:`RolloutWorker` a generator and the model it samples with (pickled once;
the worker keeps its own copy), then requests in order: prompts to complete, with the weights to
complete them with when they changed since the last request. The worker answers each request in
the order it came, so the trainer can queue several ahead and keep training meanwhile.

The worker is spawned, not forked: a fork of a process whose OpenMP threads have run hangs at the
child's first parallel region with more than one thread. What the generator holds crosses by
pickling: tensors through shared memory (``torch.multiprocessing``); functions and classes by
reference. Those of a file loaded as ``FILE.py:NAME`` (reward functions, tools, environments) are
loaded again in the worker, under the module name the trainer gave them, before the generator is
unpickled; anything else must be importable (defined at a module's top level).

The worker's torch random generator starts from the state the trainer gives it and is the only one
its sampling draws from, so a worker that receives the requests a synchronous run would make, in the
same order, samples the same tokens.

A generator whose compute runs elsewhere (rollout servers: ``capabilities.samples_elsewhere``) needs no process of
its own: :class:`ThreadRolloutWorker` answers the same requests, in order, on a thread of the trainer.

Partial rollouts (``partial=True``; :mod:`posttrain.rollout.partial`): while the worker samples a request, it
reads the requests that arrive meanwhile without waiting and sets them aside, in order, to answer after it. When
one carries weights, the request being sampled stops (between two decode steps; rollout servers abort it, for
the thread worker), those weights are loaded (and
that request's probe log-probs computed with them, for its answer), and its unfinished rows continue under them.
The worker always samples with the newest weights it has received: a request whose turn comes after newer
weights were loaded is sampled by them, and its tokens say so (``Completions.token_versions``).
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import Tensor

from posttrain.data.rewards import USER_MODULE_PREFIX
from posttrain.models.logprobs import probe_logprobs
from posttrain.models.compute import register_attention_implementations
from posttrain.rollout import partial as partial_rollouts
from posttrain.rollout.completions import Completions

POLL_SECONDS = 1.0  # how often a waiting side checks that the other is still alive


@dataclass
class Request:
    """Complete ``prompt_ids`` (``num_samples`` each) with the model at policy version ``version``; ``weights``
    (parameter name -> tensor) replace the worker's before it starts, None: keep the last ones."""

    request_id: int
    version: int
    prompt_ids: list[Tensor]
    num_samples: int
    greedy: bool = False
    rows: list[dict[str, Any]] | None = None
    weights: dict[str, Tensor] | None = None
    probe_ids: Tensor | None = None  # [T]: answer their log-probs under the new weights (the sync check)


@dataclass
class Result:
    """What the worker sampled for one request, and the seconds it took."""

    request_id: int
    completions: Completions
    seconds: float
    episode_counts: dict[str, int] = field(default_factory=dict)  # multi-turn episodes: turns, tool calls, ...
    probe_logprobs: Tensor | None = None  # [T - 1], when the request sent probe_ids


class RolloutWorkerError(RuntimeError):
    """The rollout process failed; the message holds its traceback."""


class RolloutWorker:
    """A process that samples with its own copy of ``model``, driven by :meth:`submit` and :meth:`receive`."""

    def __init__(self, generator: Any, model: torch.nn.Module, *, threads: int, rng_state: Tensor,
                 partial: bool = False):
        """``generator`` samples with ``model`` (a module it holds); ``threads``: the worker's torch threads;
        ``rng_state``: its torch random generator's state to start from; ``partial``: interrupt a request when
        newer weights arrive and continue it with them (the generator's ``capabilities.resumes`` must be True)."""
        try:
            payload = _dumps((generator, model))
        except Exception as error:  # a lambda, a nested function, a class defined inside a function
            raise RolloutWorkerError(
                f"async_rollout: the generator cannot be sent to the rollout process ({type(error).__name__}: "
                f"{error}); tools, environments and reward functions must be defined at a module's top level "
                "(or in a file passed as FILE.py:NAME)") from None
        modules = {name: module.__file__ for name, module in list(sys.modules.items())
                   if name.startswith(USER_MODULE_PREFIX) and getattr(module, "__file__", None)}
        context = mp.get_context("spawn")
        self.requests, self.results = context.Queue(), context.Queue()
        self.process = context.Process(target=_serve, name="posttrain-rollout", daemon=False,
                                       args=(payload, modules, threads, rng_state, os.getpid(),
                                             self.requests, self.results, partial))
        self.process.start()
        self.outstanding = 0  # requests sent and not answered yet
        # a worker nobody closed (a session dropped in a notebook) stops when this object goes
        self._finalizer = weakref.finalize(self, _stop, self.process, self.requests, self.results)

    def submit(self, request: Request) -> None:
        self.requests.put(request)
        self.outstanding += 1

    def receive(self) -> Result:
        """The answer to the oldest outstanding request (waits for it)."""
        kind, payload = self._answer()
        if kind != "result":
            raise RolloutWorkerError(f"rollout process: expected a result, got {kind!r}")
        return payload

    def rng_state(self) -> Tensor:
        """The worker's random generator state once every outstanding request is answered (receive them first)."""
        if self.outstanding:
            raise RuntimeError("rng_state: receive the outstanding results first")
        self.requests.put("rng_state")
        self.outstanding += 1
        kind, state = self._answer()
        return state

    def close(self) -> None:
        self._finalizer()

    def _answer(self) -> tuple[str, Any]:
        while True:
            try:
                kind, payload = self.results.get(timeout=POLL_SECONDS)
                break
            except queue.Empty:
                if not self.process.is_alive():
                    raise self._died() from None
            except (ConnectionError, EOFError, OSError):  # an answer whose tensors died with the process
                self.process.join(timeout=POLL_SECONDS)
                raise self._died() from None
        self.outstanding -= 1
        if kind == "error":
            error, text = payload
            if error is not None:  # the generator's own exception (EnvironmentFault, a tool's error): as it was
                raise error
            raise RolloutWorkerError(f"the rollout process failed:\n{text}")
        return kind, payload

    def _died(self) -> RolloutWorkerError:
        return RolloutWorkerError(f"the rollout process died (exit code {self.process.exitcode}) without an answer")


class ThreadRolloutWorker:
    """:class:`RolloutWorker`'s interface on a thread: for a generator that only waits on servers.

    Its copy of the model receives each request's weights as the process worker's does; the generator
    publishes them to the servers. Its random generator is the trainer's state, kept unchanged: the
    servers draw the samples with theirs. ``partial``: as the process worker's (the generator aborts its
    servers' requests when newer weights arrive)."""

    def __init__(self, generator: Any, model: torch.nn.Module, *, rng_state: Tensor, partial: bool = False):
        self.sampler, self._rng_state, self.partial = Sampler(generator, model), rng_state, partial
        self.requests: queue.Queue[Request | None] = queue.Queue()
        self.results: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.outstanding = 0
        self.thread = threading.Thread(target=self._serve, name="posttrain-rollout", daemon=True)
        self.thread.start()

    def submit(self, request: Request) -> None:
        self.requests.put(request)
        self.outstanding += 1

    def receive(self) -> Result:
        kind, payload = self.results.get()
        self.outstanding -= 1
        if kind == "error":
            raise payload
        return payload

    def rng_state(self) -> Tensor:
        if self.outstanding:
            raise RuntimeError("rng_state: receive the outstanding results first")
        return self._rng_state

    def close(self) -> None:
        self.requests.put(None)
        self.thread.join()

    def _serve(self) -> None:
        inbox = Inbox(self.requests)
        while True:
            try:
                request = inbox.next()
            except queue.Empty:
                continue
            if request is None:
                return
            try:
                self.results.put(("result", _generate(self.sampler, request, inbox if self.partial else None)))
            except BaseException as error:  # noqa: BLE001  # the trainer raises it at its receive
                self.results.put(("error", error))


def _stop(process: Any, requests: Any, results: Any) -> None:
    """Ask the process to stop, kill it if it does not within 10 s, and close the queues."""
    if process.is_alive():
        requests.put(None)
        process.join(timeout=10)
    if process.is_alive():
        process.kill()
        process.join()
    for channel in (requests, results):
        channel.cancel_join_thread()  # nobody reads what is still buffered for a stopped process
        channel.close()


def _dumps(obj: Any) -> bytes:
    """Pickle with torch's reductions: tensors travel as shared-memory handles, not copies."""
    buffer = io.BytesIO()
    ForkingPickler(buffer, pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def _load_user_modules(modules: dict[str, str]) -> None:
    import importlib.util

    for name, path in modules.items():
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)


class Sampler:
    """The worker's generator, the model it samples with, the policy version of the weights it holds, and the
    probe log-probs of weights loaded before their request's turn (partial rollouts)."""

    def __init__(self, generator: Any, model: torch.nn.Module):
        self.generator, self.model = generator, model
        self.parameters = dict(model.named_parameters())
        self.version: int | None = None  # the first request's until weights arrive (the copy it was given)
        self.probes: dict[int, Tensor | None] = {}  # request id -> its probe's log-probs under its weights

    @torch.no_grad()
    def load(self, request: Request) -> Request:
        """Load the request's weights, if it carries any, and compute its probe log-probs with them; the
        request without its weights (so that they are never loaded again)."""
        if self.version is None:
            self.version = request.version
        if request.weights is None:
            return request
        for name, weight in request.weights.items():
            self.parameters[name].copy_(weight)
        self.version = request.version
        self.probes[request.request_id] = (probe_logprobs(self.model, request.probe_ids)
                                           if request.probe_ids is not None else None)
        return dataclasses.replace(request, weights=None)


class Inbox:
    """The requests in the order they came; with partial rollouts, those read while a request is sampled wait
    here for their turn."""

    def __init__(self, requests: Any):
        self.requests = requests
        self.waiting: deque[Any] = deque()  # requests (and "rng_state", None) read early, in order

    def next(self) -> Any:
        """The next request, or raises ``queue.Empty`` after :data:`POLL_SECONDS` without one."""
        return self.waiting.popleft() if self.waiting else self.requests.get(timeout=POLL_SECONDS)

    def newer_weights(self) -> bool:
        """Read what has arrived, without waiting; whether a request waiting carries weights not loaded yet."""
        while True:
            try:
                self.waiting.append(self.requests.get_nowait())
            except queue.Empty:
                break
        return any(isinstance(message, Request) and message.weights is not None for message in self.waiting)

    def load_waiting(self, sampler: Sampler) -> int:
        """Load the weights of the waiting requests, in order (each request's probe with its own); the version
        the sampler holds then."""
        self.waiting = deque(sampler.load(message) if isinstance(message, Request) else message
                             for message in self.waiting)
        return sampler.version


def _serve(payload: bytes, modules: dict[str, str], threads: int, rng_state: Tensor, parent: int,
           requests: Any, results: Any, partial: bool) -> None:
    """The worker's loop: answer requests in order until ``None`` arrives or the trainer is gone.

    SIGTERM and SIGINT (a scheduler's preemption, Ctrl-C: both reach every process of the job) are the
    trainer's to handle: it finishes its step, saves the batches sampled ahead, which this process must
    still answer, and then stops it."""
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, signal.SIG_IGN)
    torch.set_num_threads(threads)
    try:
        register_attention_implementations()  # a mixed-precision model names one of posttrain's
        _load_user_modules(modules)
        sampler = Sampler(*pickle.loads(payload))
        torch.set_rng_state(rng_state)
    except BaseException as error:
        results.put(("error", (_picklable(error), traceback.format_exc())))
        return
    inbox = Inbox(requests)
    while True:
        try:
            request = inbox.next()
        except queue.Empty:
            if os.getppid() != parent:  # the trainer died without closing us
                return
            continue
        if request is None:
            return
        if request == "rng_state":
            results.put(("rng_state", torch.get_rng_state()))
            continue
        try:
            results.put(("result", _generate(sampler, request, inbox if partial else None)))
        except BaseException as error:
            results.put(("error", (_picklable(error), traceback.format_exc())))


@torch.no_grad()
def _generate(sampler: Sampler, request: Request, inbox: Inbox | None = None) -> Result:
    """Answer one request; with an ``inbox`` (partial rollouts), interrupted by the newer weights that reach
    it meanwhile, with each token's version."""
    request = sampler.load(request)
    probe = sampler.probes.pop(request.request_id, None)
    generator = sampler.generator
    start = time.perf_counter()
    if inbox is None:
        completions = generator.generate(request.prompt_ids, num_samples=request.num_samples, greedy=request.greedy,
                                         rows=request.rows)
    else:
        completions = partial_rollouts.generate(
            generator, request.prompt_ids, num_samples=request.num_samples, greedy=request.greedy,
            version=sampler.version, interrupted=inbox.newer_weights, load_newer=lambda: inbox.load_waiting(sampler))
    stats = getattr(generator, "stats", None)  # an EpisodeGenerator's counts of this call's episodes
    return Result(request.request_id, completions, time.perf_counter() - start,
                  stats.counts() if stats is not None else {}, probe)


def _picklable(error: BaseException) -> BaseException | None:
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return None
