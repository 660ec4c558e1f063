"""Rollouts from separate vLLM servers (``posttrain serve``), on this machine or others: ``--rollout-server URL``.

:class:`RemoteGenerator` has the generators' interface (row ``i*G + j`` is sample ``j`` of prompt ``i``), so
the training loop does not know where its samples come from. Each ``generate`` call:

1. publishes the policy's current weights (merged under LoRA, the base model's names) through the
   transport, as version ``v`` (one more than the last);
2. on every server: ``/pause`` (in-flight requests finish first), load version ``v`` (``/collective_rpc``
   into posttrain's worker extension, :mod:`posttrain.rollout.vllm_worker`), ``/reset_prefix_cache``,
   ``/resume``. A server answers with the version it loaded; a sample is only drawn by a server that
   loaded ``v``, so each sample's version is the trainer's;
3. splits the prompts over the servers (contiguous shards, the servers in turn) and sends each shard as
   one ``/v1/completions`` request of token ids (``n`` samples, the sampled tokens' log-probs, their ids).

A server that refuses a connection, errors or does not answer within ``timeout_s`` is dropped for the rest
of the run with a warning naming it, and its shard goes to the next live server, so no step is lost while
one server is alive; with none, the error names every server and what each did. A trainer that restarts
(``--resume``) publishes its weights before its first sample, since every call publishes.

Partial rollouts (``partial_rollouts``, :mod:`posttrain.rollout.partial`): while a call's requests are in flight,
``interrupted()`` is asked every :data:`POLL_SECONDS`; once it says newer weights wait, every live server is
asked to abort its requests (``/abort_requests``), each of which answers with the tokens it had sampled
(``finish_reason`` "abort"). The rows that had not ended are then continued, by a later call, from their prompt
and their tokens, under the newer weights. A request that reaches a server after the abort runs under the old
weights until the next one (asked again while requests are in flight), so its tokens keep the old version.

Asynchronous rollouts (``async_rollout``) sample from the servers on a thread of the trainer
(:class:`posttrain.rollout.worker.ThreadRolloutWorker`) with a copy of the policy taken when each request
was made; :meth:`RemoteGenerator.for_model` gives that copy a generator that shares the servers, the
version counter and a lock with the trainer's own (evaluation, ReMax's greedy baseline), so each call
publishes, loads and samples as one unit and a version number is never used twice.

Transports (:class:`WeightTransport`, ``--weight-transport``):

- :class:`FilesystemWeights` (``filesystem``, the default) writes a safetensors file per version into a
  directory every server can read (one machine, or machines sharing a disk), under a temporary name and
  renamed, so a server never reads a partial file; the last two versions are kept; each server loads it.
- :class:`CollectiveWeights` (``gloo``, ``nccl``) broadcasts the tensors from the trainer to each server's
  worker over a two-member ``torch.distributed`` group (the trainer's rendezvous store, the server joining
  it through ``/collective_rpc``): nothing touches a disk, so servers on machines without a shared one work,
  and on GPUs ``nccl`` moves the weights GPU to GPU. It is posttrain's own group rather than vLLM's NCCL
  weight-transfer engine so that the trainer needs no vLLM and the same code runs with ``gloo`` on a CPU
  (what the tests run) as with ``nccl`` on GPUs.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from posttrain.models.logprobs import probe_logprobs
from posttrain.parallel.distributed import say
from posttrain.rollout.completions import Capabilities, Completions, SamplingParams, per_prompt_budgets
from posttrain.rollout.vllm import completions_from_samples, ending_in_eos, merged_weights
from posttrain.rollout.vllm_worker import WEIGHTS_FILE

POLL_SECONDS = 0.05
"""How often a call with ``interrupted`` asks it while its requests are in flight (partial rollouts)."""


class RolloutServerError(RuntimeError):
    """No rollout server could do what was asked; the message names each server and what it did."""


def _request(url: str, path: str, body: dict | None, timeout: float, method: str = "POST") -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url.rstrip("/") + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        text = response.read().decode()
    return json.loads(text) if text.strip() else None


def _reason(error: BaseException) -> str:
    if isinstance(error, urllib.error.HTTPError):
        detail = error.read().decode(errors="replace")[:300]
        return f"HTTP {error.code}: {detail}"
    if isinstance(error, urllib.error.URLError):
        return f"unreachable ({error.reason})"
    if isinstance(error, TimeoutError):
        return "no answer within the timeout"
    return f"{type(error).__name__}: {error}"


def wait_until_ready(urls: list[str], timeout_s: float) -> None:
    """Block until every server answers ``/health``; an error naming the ones that did not within ``timeout_s``."""
    deadline, waiting = time.monotonic() + timeout_s, dict.fromkeys(urls, "not asked yet")
    while waiting and time.monotonic() < deadline:
        for url in list(waiting):
            try:
                _request(url, "/health", None, timeout=5, method="GET")
                del waiting[url]
            except (OSError, ValueError) as error:
                waiting[url] = _reason(error)
        if waiting:
            time.sleep(0.5)
    if waiting:
        raise RolloutServerError(f"rollout servers not ready after {timeout_s:.0f} s: "
                                 + "; ".join(f"{url}: {why}" for url, why in waiting.items())
                                 + " (start each with posttrain serve --model MODEL --port PORT)")


class WeightTransport(Protocol):
    """How a version of the weights reaches each server."""

    def publish(self, weights: list[tuple[str, Tensor]], version: int) -> None:
        """Make ``weights`` available as ``version``, once, before any server loads it."""
        ...

    def load(self, url: str, weights: list[tuple[str, Tensor]], version: int, timeout_s: float) -> list[int]:
        """Load ``version`` on the (paused) server at ``url``; the versions its workers report."""
        ...


def _versions(answer: Any) -> list[int]:
    return [int(v) for v in answer["results"]]


@dataclass
class FilesystemWeights:
    """A safetensors file per version under ``directory`` (which every server must be able to read)."""

    directory: Path
    keep: int = 2

    def publish(self, weights: list[tuple[str, Tensor]], version: int) -> None:
        from safetensors.torch import save_file

        target = self.directory / f"v{version:06d}"
        partial = self.directory / f".v{version:06d}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        # clone: tied and merged weights can share storage, which safetensors refuses to write twice
        save_file({name: tensor.detach().to("cpu").clone().contiguous() for name, tensor in weights},
                  str(partial / WEIGHTS_FILE))
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)  # a server never sees a partly written version
        for old in sorted(self.directory.glob("v*"))[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def load(self, url: str, weights: list[tuple[str, Tensor]], version: int, timeout_s: float) -> list[int]:
        path = str((self.directory / f"v{version:06d}").resolve())
        return _versions(_request(url, "/collective_rpc", {"method": "posttrain_load", "args": [path, str(version)]},
                                  timeout_s))


@dataclass
class CollectiveWeights:
    """Weights broadcast over a ``torch.distributed`` group per server (``backend`` gloo or nccl).

    This process hosts the rendezvous store at ``host:port`` (port 0: a free one), which every server must
    reach: ``host`` is this machine's address as the servers see it. A server joins on its first load (and
    again after a trainer restart: each trainer's groups live under a prefix of their own)."""

    backend: str = "gloo"
    host: str = "127.0.0.1"
    port: int = 0
    groups: dict[str, Any] = field(default_factory=dict)  # url -> the group this process shares with it

    def __post_init__(self) -> None:
        import uuid

        import torch.distributed as dist

        self.store = dist.TCPStore(self.host, self.port, is_master=True, wait_for_workers=False)
        self.address = f"{self.host}:{self.store.port}"
        self.prefix = f"posttrain-{uuid.uuid4().hex[:12]}"

    def publish(self, weights: list[tuple[str, Tensor]], version: int) -> None:
        pass  # nothing to prepare: each load sends the tensors themselves

    def _group(self, url: str, timeout_s: float) -> Any:
        import datetime

        import torch.distributed as dist

        if url in self.groups:
            return self.groups[url]
        prefix = f"{self.prefix}/{len(self.groups)}"
        with ThreadPoolExecutor(1) as pool:  # both members block in the rendezvous: the server's on a thread
            joined = pool.submit(_request, url, "/collective_rpc", {
                "method": "posttrain_join", "args": [self.address, prefix, self.backend, str(timeout_s)]}, timeout_s)
            store, timeout = dist.PrefixStore(prefix, self.store), datetime.timedelta(seconds=timeout_s)
            group = (dist.ProcessGroupNCCL(store, 0, 2) if self.backend == "nccl"
                     else dist.ProcessGroupGloo(store, 0, 2, timeout))
            joined.result()
        self.groups[url] = group
        return group

    def load(self, url: str, weights: list[tuple[str, Tensor]], version: int, timeout_s: float) -> list[int]:
        group = self._group(url, timeout_s)
        meta = [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in weights]
        pool = ThreadPoolExecutor(1)
        try:
            received = pool.submit(_request, url, "/collective_rpc",
                                   {"method": "posttrain_receive", "args": [json.dumps(meta), str(version)]},
                                   timeout_s)
            device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else "cpu"
            for _, tensor in weights:
                group.broadcast(tensor.detach().to(device).contiguous(), 0).wait()
            return _versions(received.result(timeout=timeout_s))
        except BaseException:
            self.groups.pop(url, None)  # a broken group is not reused: the server joins a new one
            raise
        finally:
            pool.shutdown(wait=False)  # a server stuck in its receive must not hold this process


@dataclass
class Servers:
    """What every generator on the same servers shares: which are dead, the last version, one call at a time."""

    dead: dict[str, str] = field(default_factory=dict)  # url -> why it was dropped
    version: int = -1  # the last version published (-1: none yet)
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class RemoteGenerator:
    """Sampling on ``posttrain serve`` servers; weights published before each call (module docstring)."""

    model: Any
    tokenizer: Any
    params: SamplingParams
    eos_token_ids: list[int]
    urls: list[str]
    transport: WeightTransport
    timeout_s: float = 600.0
    servers: Servers = field(default_factory=Servers)
    sync_seconds: float = 0.0  # the last publish and load, for the step's timing
    sync_check: Any = None  # guards.SyncCheck, set by the session: each server's load is checked with it
    capabilities = Capabilities(own_weights=True, syncs_weights=True, samples_elsewhere=True, pauses=True,
                                resumes=True)

    def __post_init__(self) -> None:
        self.eos_ids = torch.tensor(self.eos_token_ids, dtype=torch.long)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_token_ids[0]
        wait_until_ready(self.live, self.timeout_s)

    def for_model(self, model: Any) -> RemoteGenerator:
        """A generator that publishes ``model``'s weights to the same servers (sharing their state)."""
        return dataclasses.replace(self, model=model)

    @property
    def version(self) -> int:
        return self.servers.version

    @property
    def dead(self) -> dict[str, str]:
        return self.servers.dead

    @property
    def live(self) -> list[str]:
        return [url for url in self.urls if url not in self.dead]

    def _drop(self, url: str, error: BaseException) -> None:
        self.dead[url] = _reason(error)
        say(f"warning: rollout server {url} dropped: {self.dead[url]}; {len(self.live)} left")
        if not self.live:
            raise RolloutServerError("no rollout server is left: " + "; ".join(f"{u}: {why}" for u, why in
                                                                                self.dead.items())
                                     + "; the step did not train. Start a server (posttrain serve) and resume the "
                                     "run from its last checkpoint (--resume RUN_DIR)")

    def sync_weights(self) -> None:
        """Publish the policy's weights as the next version and load them on every live server."""
        start = time.perf_counter()
        version = self.version + 1
        with merged_weights(self.model) as weights:
            self.transport.publish(weights, version)
            self.servers.version = version
            for url in self.live:
                try:
                    _request(url, "/pause?mode=wait", None, self.timeout_s)
                    loaded = self.transport.load(url, weights, version, self.timeout_s)
                    _request(url, "/reset_prefix_cache", None, self.timeout_s)
                    _request(url, "/resume", None, self.timeout_s)
                    if loaded != [version] * len(loaded):
                        raise RolloutServerError(f"loaded version {[str(v) for v in loaded]}, not {version}")
                except (OSError, ValueError, KeyError, RuntimeError) as error:  # RuntimeError: a broken group
                    self._drop(url, error)
        if self.sync_check is not None:  # a wrong load is an error, not a dropped server
            probe = self.sync_check.probe_ids
            expected = probe_logprobs(self.model, probe)
            for url in self.live:
                self.sync_check.verify(expected, self.server_logprobs(url, probe), f"rollout server {url}",
                                       f"weight version {version}")
        self.sync_seconds = time.perf_counter() - start

    def server_logprobs(self, url: str, token_ids: Tensor) -> Tensor:
        """[T] ids -> [T - 1] the server's log-probs of tokens 1.. (prompt log-probs at temperature 1)."""
        ids = token_ids.tolist()
        body = {"prompt": ids, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0, "return_token_ids": True}
        entries = _request(url, "/v1/completions", body, self.timeout_s)["choices"][0]["prompt_logprobs"]
        return torch.tensor([entry[str(token)]["logprob"] for entry, token in zip(entries[1:], ids[1:])])

    def _complete(self, url: str, shard: list[Tensor], num_samples: int, greedy: bool, budget: int) -> list[dict]:
        p = self.params
        body = {"prompt": [ids.tolist() for ids in shard], "n": num_samples, "max_tokens": budget,
                "temperature": 0.0 if greedy else p.temperature, "top_p": 1.0 if greedy else p.top_p,
                "top_k": -1 if greedy or not p.top_k else p.top_k, "logprobs": 0, "return_token_ids": True,
                "stop_token_ids": self.eos_token_ids, "skip_special_tokens": False}
        # no per-request seed: the API applies one seed to every prompt of a request, which would give all
        # of them the same random draws; the server's own generator keeps samples independent
        choices = _request(url, "/v1/completions", body, self.timeout_s)["choices"]
        if len(choices) != len(shard) * num_samples:
            raise RolloutServerError(f"{len(choices)} samples for {len(shard)} prompts x {num_samples}")
        for choice in choices:  # the correction and the mismatch metrics compare them with the trainer's
            logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
            if logprobs is None or len(logprobs) != len(choice["token_ids"]) or None in logprobs:
                raise RolloutServerError(
                    f"{url} returned sample {choice['index']} without a log-prob for each of its "
                    f"{len(choice['token_ids'])} tokens (logprobs.token_logprobs: "
                    f"{'missing' if logprobs is None else f'{len(logprobs)} values'}); serve it with posttrain serve, "
                    "or a vLLM server that returns the sampled tokens' log-probs")
        return sorted(choices, key=lambda choice: choice["index"])

    @torch.no_grad()
    def generate(self, prompt_ids: list[Tensor], *, num_samples: int, greedy: bool = False, rows: Any = None,
                 interrupted: Callable[[], bool] | None = None,
                 max_new_tokens: int | list[int] | None = None) -> Completions:
        """``interrupted``: asked while the requests are in flight; True aborts them (partial rollouts, module
        docstring). ``max_new_tokens``: this call's budget, or one per prompt (default: the sampling
        parameters')."""
        budgets = per_prompt_budgets(max_new_tokens, self.params.max_new_tokens, len(prompt_ids))
        with self.servers.lock:  # another generator on these servers (module docstring) waits its turn
            self.sync_weights()
            return self._sample(prompt_ids, num_samples, greedy, budgets, interrupted)

    def _sample(self, prompt_ids: list[Tensor], num_samples: int, greedy: bool, budgets: list[int],
                interrupted: Callable[[], bool] | None = None) -> Completions:
        # the prompts in contiguous shards, one per live server; a shard's prompts of one budget are one request
        jobs: list[list[int]] = []
        per = -(-len(prompt_ids) // max(len(self.live), 1))
        for start in range(0, len(prompt_ids), per):
            shard = range(start, min(start + per, len(prompt_ids)))
            for budget in dict.fromkeys(budgets[i] for i in shard):
                jobs.append([i for i in shard if budgets[i] == budget])
        results: list[list[dict] | None] = [None] * len(jobs)
        pending = list(range(len(jobs)))
        in_flight = threading.Event()
        watcher = None
        if interrupted is not None:
            in_flight.set()
            watcher = threading.Thread(target=self._abort_when, args=(interrupted, in_flight), daemon=True)
            watcher.start()
        try:
            while pending:
                servers = self.live
                with ThreadPoolExecutor(len(pending)) as pool:
                    futures = {k: pool.submit(self._complete, servers[i % len(servers)],
                                              [prompt_ids[j] for j in jobs[k]], num_samples, greedy,
                                              budgets[jobs[k][0]])
                               for i, k in enumerate(pending)}
                failed = []
                for i, (k, future) in enumerate(futures.items()):
                    try:
                        results[k] = future.result()
                    except (OSError, ValueError, KeyError, RolloutServerError) as error:
                        url = servers[i % len(servers)]
                        if url not in self.dead:
                            self._drop(url, error)  # raises when none is left
                        failed.append(k)
                pending = failed
        finally:
            in_flight.clear()
            if watcher is not None:
                watcher.join()
        by_row: list[dict | None] = [None] * (len(prompt_ids) * num_samples)
        for job, choices in zip(jobs, results):
            for k, choice in enumerate(choices or []):  # sample j of the job's prompt i is choice i * n + j
                by_row[job[k // num_samples] * num_samples + k % num_samples] = choice
        token_ids = [list(choice["token_ids"]) for choice in by_row]
        logprobs = [[float(lp) for lp in choice["logprobs"]["token_logprobs"]] for choice in by_row]
        samples = [ending_in_eos(ids, lps, choice.get("finish_reason") == "stop", self.eos_ids)
                   for choice, ids, lps in zip(by_row, token_ids, logprobs)]
        return completions_from_samples([r[0] for r in samples], [r[1] for r in samples], self.eos_ids, self.pad_id)

    def _abort_when(self, interrupted: Callable[[], bool], in_flight: threading.Event) -> None:
        """While requests are in flight, ask ``interrupted()``; once True, abort every live server's requests
        (again at each poll, for a request that reached its server after the last abort)."""
        while in_flight.is_set():
            if interrupted():
                for url in self.live:
                    try:
                        _request(url, "/abort_requests", {}, self.timeout_s)
                    except (OSError, ValueError) as error:  # the request's own call will find it dead, or not
                        say(f"warning: rollout server {url} did not abort its requests: {_reason(error)}")
            time.sleep(POLL_SECONDS)
