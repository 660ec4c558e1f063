"""Where an online step's completions come from: sampled in the trainer's process when the step asks
(synchronous), or by a rollout process that samples ahead while the trainer trains (asynchronous).

Both hand the loop :class:`Round`\\ s: this process's prompts of one generation round and their
completions, each row tagged with the policy version that sampled it (the trainer's step count when
its weights were taken). A step's first round is its batch; dynamic sampling asks for more rounds.

Asynchronous rollouts (``async_rollout``, ``max_staleness`` K) keep the first rounds of the next K
steps in flight: at the start of step ``t`` the rollout process holds requests for steps ``t`` to
``t + K``, the last one submitted now with the current weights (version ``t``). Step ``t``'s batch was
therefore sampled by version ``max(0, t - K)``: exactly K versions stale once the pipeline is full,
never more. Refill rounds are submitted with the current weights (0 stale) and answered after the
rounds already queued. With K = 0 every request is the synchronous run's, made at the same point, and
the process samples from the same random stream: the same tokens, weights and metrics.

Partial rollouts (``partial_rollouts``) let the rollout process switch to newer weights in the middle of a
request (:mod:`posttrain.rollout.partial`): its tokens carry their versions, and each row's version is its
oldest token's, so the bound above still holds for every token. Where the switch falls depends on how fast
the two processes run, so such a run is not reproducible token for token.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from posttrain.config import ConfigError
from posttrain.models.logprobs import probe_logprobs
from posttrain.parallel import distributed
from posttrain.rollout.completions import Completions
from posttrain.rollout.worker import Request, RolloutWorker, ThreadRolloutWorker
from posttrain.training.groups import Groups

logger = logging.getLogger(__name__)


class RolloutSession(Protocol):
    """What the rollouts use of ``posttrain.training.session.OnlineSession`` (which holds them)."""

    config: Any
    step: int
    sampler: Any  # PromptSampler: the prompts' order
    encoded_prompts: list[torch.Tensor]
    generator: Any  # samples in this process (synchronous rounds; the rollout process gets a copy)
    episodes: Any  # the generator again when it plays multi-turn episodes, else None
    policy: torch.nn.Module
    sampling_copy: torch.nn.Module | None
    sync_check: Any  # guards.SyncCheck, or None where nothing is checked (a sampling copy with noise)

    @property
    def train_rows(self) -> list[dict[str, Any]]: ...

    def refresh_sampler(self, for_step: int | None = None) -> None: ...


@dataclass
class Round:
    """One generation round of this process: its prompts and their ``G`` completions each."""

    indices: list[int]  # [b] dataset rows of the prompts
    completions: Completions  # [b * G], ``versions`` set
    seconds: float = 0.0  # spent sampling (in the rollout process, for an asynchronous round)
    waited: float = 0.0  # the trainer blocked on it
    episode_counts: dict[str, int] = field(default_factory=dict)  # multi-turn episodes: turns, tool calls, ...


def draw_prompts(s: RolloutSession) -> list[int]:
    """This process's share of the next ``prompts_per_step`` prompts of the sampler's order."""
    return distributed.shard(s.sampler.next(s.config.rollout.prompts_per_step))


def tagged(completions: Completions, version: int) -> Completions:
    """``versions`` set: ``version`` (the request's) on every row, or, where the tokens carry their own versions
    (partial rollouts), each row's oldest token's."""
    if completions.token_versions is None:
        completions.versions = torch.full((len(completions.mask),), version, dtype=torch.long)
    else:
        newest = int(completions.token_versions.max())
        completions.versions = completions.token_versions.masked_fill(completions.mask == 0, newest).amin(1)
    return completions


class SyncRollouts:
    """Every round sampled in this process, by the current policy (or its sampling copy), when asked."""

    def first_round(self, s: RolloutSession) -> Round:
        s.refresh_sampler()  # a sampling copy (noise, another dtype): this step's, from the current policy
        return self.round(s)

    def extra_round(self, s: RolloutSession) -> Round:
        return self.round(s)

    def round(self, s: RolloutSession) -> Round:
        indices = draw_prompts(s)
        start = time.perf_counter()
        completions = s.generator.generate([s.encoded_prompts[i] for i in indices],
                                           num_samples=s.config.rollout.group_size,
                                           rows=[s.train_rows[i] for i in indices])
        seconds = time.perf_counter() - start
        counts = s.episodes.stats.counts() if s.episodes is not None else {}
        return Round(indices, tagged(completions, s.step), seconds, seconds, counts)

    def state(self, s: RolloutSession) -> dict[str, Any] | None:
        return None

    def load(self, state: dict[str, Any] | None) -> None:
        if state and state["rounds"]:
            raise ConfigError(f"resume: the checkpoint holds {len(state['rounds'])} batch(es) sampled ahead by "
                              "asynchronous rollouts; resume with --async-rollout and --max-staleness "
                              f"{len(state['rounds'])} or more")

    def close(self) -> None:
        pass


class AsyncRollouts:
    """The steps' first rounds sampled up to ``max_staleness`` steps ahead by a :class:`RolloutWorker`."""

    def __init__(self, max_staleness: int, threads: int | None = None, partial: bool = False):
        self.max_staleness = max_staleness
        self.threads = threads  # the rollout process's torch threads (None: see ``start``)
        self.partial = partial  # partial rollouts: a request in flight switches to newer weights
        self.worker: RolloutWorker | ThreadRolloutWorker | None = None
        self.next_id = 0
        self.in_flight: deque[tuple[int, list[int], int]] = deque()  # (request id, prompts, version), in order
        self.answered: dict[int, Round] = {}
        self.ahead: deque[int] = deque()  # request ids of the first rounds of steps step, step + 1, ...
        self.sent_version: int | None = None  # the weights the worker holds
        self.rng_state: torch.Tensor | None = None  # a resumed worker's random generator
        self.trainer_threads: int | None = None  # the trainer's torch threads before it shared them
        self.expected: dict[int, tuple[torch.Tensor, Any, int]] = {}  # request id -> the trainer's probe log-probs

    def first_round(self, s: RolloutSession) -> Round:
        self.start(s)
        while len(self.ahead) <= self.max_staleness:  # this step's batch and the next K steps'
            self.ahead.append(self.submit(s, for_step=s.step + len(self.ahead)))
        return self.wait(self.ahead.popleft())

    def extra_round(self, s: RolloutSession) -> Round:
        self.start(s)
        return self.wait(self.submit(s, for_step=s.step))

    def start(self, s: RolloutSession) -> None:
        """Spawn the rollout process with a copy of the sampling model (the trainer's weights keep moving),
        its random generator where this process's is (or where a checkpoint left it).

        Threads: with K >= 1 the trainer and the rollout process run at once, so they split this process's
        torch threads (``rollout_threads`` for the rollout process, half by default; the trainer keeps the
        rest), as two threads each would oversubscribe the cores. With K = 0 they take turns and the
        rollout process gets as many as the trainer (the synchronous run's count, so the same arithmetic)."""
        if self.worker is not None:
            return
        s.refresh_sampler()  # a sampling copy holds the current policy (a resumed run's too) before it is copied
        model = s.sampling_copy if s.sampling_copy is not None else s.policy
        rng = self.rng_state if self.rng_state is not None else torch.get_rng_state()
        self.sent_version = s.step  # the copy is the current policy's
        partial = self.partial and s.generator.capabilities.resumes
        if self.partial and not partial:
            logger.warning("partial_rollouts: %s cannot be interrupted; each request is sampled whole, with the "
                           "weights it started with", type(s.generator).__name__)
        if s.generator.capabilities.samples_elsewhere:  # rollout servers: a thread waits on them
            model = copy.deepcopy(model)
            self.worker = ThreadRolloutWorker(s.generator.for_model(model), model, rng_state=rng, partial=partial)
            return
        total = torch.get_num_threads()
        threads = self.threads or (max(1, total // 2) if self.max_staleness else total)
        if self.max_staleness:
            self.trainer_threads = total  # given back at close
            torch.set_num_threads(max(1, total - threads))
        generator, model = copy.deepcopy((s.generator, model))  # one copy: the generator holds the model
        self.worker = RolloutWorker(generator, model, threads=threads, rng_state=rng, partial=partial)

    def submit(self, s: RolloutSession, for_step: int) -> int:
        """Request the next prompts' completions with the current weights; ``for_step``: the step that will
        train on them (the sampling copy's noise is drawn for it, as a synchronous run draws it)."""
        indices = draw_prompts(s)
        weights = None
        noise = s.config.off_policy.sampler_noise
        if s.sampling_copy is not None and (noise or self.sent_version != s.step):
            s.refresh_sampler(for_step)
            weights = {name: p.detach().clone() for name, p in s.sampling_copy.named_parameters()}
        elif s.sampling_copy is None and self.sent_version != s.step:
            weights = {name: p.detach().clone() for name, p in s.policy.named_parameters() if p.requires_grad}
        self.sent_version = s.step
        request_id, self.next_id = self.next_id, self.next_id + 1
        probe = None
        if weights is not None and s.sync_check is not None:  # what the worker must compute with these weights
            sender = s.sampling_copy if s.sampling_copy is not None else s.policy
            probe = s.sync_check.probe_ids
            self.expected[request_id] = (probe_logprobs(sender, probe), s.sync_check, for_step)
        self.worker.submit(Request(request_id, s.step, [s.encoded_prompts[i] for i in indices],
                                   s.config.rollout.group_size, rows=[s.train_rows[i] for i in indices],
                                   weights=weights, probe_ids=probe))
        self.in_flight.append((request_id, indices, s.step))
        return request_id

    def wait(self, request_id: int) -> Round:
        start = time.perf_counter()
        while request_id not in self.answered:
            result = self.worker.receive()
            expected, indices, version = self.in_flight.popleft()
            assert result.request_id == expected, "the rollout process answers in order"
            if expected in self.expected:
                trainer, check, step = self.expected.pop(expected)
                check.verify(trainer, result.probe_logprobs, "the rollout process", f"step {step}")
            self.answered[expected] = Round(indices, tagged(result.completions, version), result.seconds,
                                            episode_counts=result.episode_counts)
        return dataclasses.replace(self.answered.pop(request_id), waited=time.perf_counter() - start)

    # -- checkpoint state: the batches sampled ahead, and the rollout process's random generator -------------

    def state(self, s: RolloutSession) -> dict[str, Any]:
        """Every process's rounds sampled ahead (each one a whole step's batch, in rank order) and rank 0's
        worker generator state; waits for the rounds in flight. Every process must call it."""
        rounds = [self.wait(request_id) for request_id in self.ahead]
        self.ahead = deque()
        for round_ in rounds:  # they stay this process's next batches
            self.ahead.append(self.keep(round_))
        rng = self.worker.rng_state() if self.worker is not None else self.rng_state
        parts = distributed.gather([(r.indices, dataclasses.asdict(r.completions), r.episode_counts)
                                    for r in rounds])
        whole = []
        for k in range(len(rounds)):
            shares = [part[k] for part in parts]
            counts: dict[str, int] = {}
            for _, _, share_counts in shares:
                for key, value in share_counts.items():
                    counts[key] = counts.get(key, 0) + value
            whole.append({"indices": sum((indices for indices, _, _ in shares), []),
                          "completions": dataclasses.asdict(Completions.cat([Completions(**c) for _, c, _ in shares])),
                          "episode_counts": counts})
        return {"rounds": whole, "rng": rng}

    def load(self, state: dict[str, Any] | None) -> None:
        """The rounds a checkpoint holds become this process's next batches (its share of each)."""
        if not state:
            return
        rounds = state["rounds"]
        if len(rounds) > self.max_staleness:
            raise ConfigError(f"max_staleness: the checkpoint holds {len(rounds)} batch(es) sampled ahead; "
                              f"resume with --max-staleness {len(rounds)} or more")
        self.rng_state = state["rng"]
        for whole in rounds:
            completions = Completions(**whole["completions"])
            g = len(completions.mask) // len(whole["indices"])
            mine = distributed.shard(range(len(whole["indices"])))
            rows = torch.tensor([i * g + j for i in mine for j in range(g)], dtype=torch.long)
            self.ahead.append(self.keep(Round([whole["indices"][i] for i in mine], completions.rows(rows),
                                              episode_counts=whole["episode_counts"] if distributed.is_main() else {})))

    def keep(self, round_: Round) -> int:
        """File an answered round under a new request id."""
        request_id, self.next_id = self.next_id, self.next_id + 1
        self.answered[request_id] = round_
        return request_id

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None
        if self.trainer_threads is not None:
            torch.set_num_threads(self.trainer_threads)
            self.trainer_threads = None


# -- how old a step's samples are ---------------------------------------------------------


def staleness_bound(s: RolloutSession) -> int:
    """How many versions behind the policy a trained sample may be: ``max_staleness`` with asynchronous
    rollouts. Dynamic sampling's surplus groups train one step after they were sampled, in a synchronous run
    too, so the bound is at least 1 for them."""
    return max(s.config.off_policy.max_staleness if s.config.off_policy.async_rollout else 0, 1)


def fresh_enough(s: RolloutSession, surplus: Groups) -> Groups | None:
    """The surplus groups still within the staleness bound at the next step (older ones are dropped)."""
    versions = surplus.completions.versions
    if versions is None:
        return surplus
    keep = (s.step + 1 - versions.view(-1, surplus.group_size)[:, 0]) <= staleness_bound(s)
    return surplus.select(keep) if keep.any() else None


def staleness(s: RolloutSession, batch: Groups) -> dict[str, float]:
    """How many policy versions behind this step's policy the trained samples are, over every process."""
    versions = batch.completions.versions
    if versions is None:  # surplus groups from a checkpoint written before versions were recorded
        return {}
    age = (s.step - versions).float()
    total = distributed.reduce_values({"sum": float(age.sum()), "rows": len(age)})
    oldest = distributed.reduce_values({"max": float(age.max()) if len(age) else 0.0}, max)
    out = {"staleness/mean": total["sum"] / max(total["rows"], 1), "staleness/max": oldest["max"]}
    comp = batch.completions
    if comp.token_versions is not None:  # partial rollouts: the tokens' own versions
        counts = distributed.reduce_values(token_staleness_counts(s.step - comp.token_versions, comp.mask,
                                                                  staleness_bound(s)))
        tokens = max(counts.pop("tokens"), 1.0)
        out["staleness/token_mean"] = counts.pop("age_sum") / tokens
        out["staleness/resumed_rows"] = counts.pop("resumed_rows") / max(total["rows"], 1)
        out.update({f"staleness/token_share/{age}": count / tokens for age, count in counts.items()})
    return out


def token_staleness_counts(age_NT: torch.Tensor, mask_NT: torch.Tensor, bound: int) -> dict[str, float]:
    """Sums over the policy's tokens (``mask_NT``) of their ages [N, T] (versions behind the step's policy):
    ``tokens``, ``age_sum``, ``resumed_rows`` (rows whose tokens span more than one version) and, per age
    ``a`` in 0 .. ``bound`` (every age a trained token can have), the tokens of that age under the key ``a``."""
    held = mask_NT > 0
    oldest_N = age_NT.masked_fill(~held, -1).amax(1)
    newest_N = age_NT.masked_fill(~held, bound + 1).amin(1)
    ages = age_NT[held]
    return {"tokens": float(held.sum()), "age_sum": float(ages.sum()),
            "resumed_rows": float((oldest_N != newest_N).sum()),
            **{str(a): float((ages == a).sum()) for a in range(bound + 1)}}
