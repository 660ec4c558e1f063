"""Where rollouts come from, in one place: the backend that samples, the transport that sends a backend the
policy's weights, the episodes around it, and the one check of their combinations.

- **Backends** (:data:`BACKENDS`): ``hf`` (posttrain's decode loop on the policy, or transformers' generate),
  ``vllm`` (a colocated vLLM engine) and ``servers`` (``posttrain serve`` processes, named by
  ``rollout_server``). Each is a :class:`Backend`: a builder, and what it supports (multi-turn episodes, a
  sampling copy of the policy, asynchronous rollouts, recording a mixture of experts' routing).
- **Weight transports** (:data:`TRANSPORTS`): ``filesystem``, ``gloo``, ``nccl``, for a backend that holds its
  own copy of the weights.
- **Episodes**: a backend's sampler wrapped in multi-turn episodes when the run has tools or an environment
  (:func:`posttrain.rollout.episodes.make_episode_generator`).

What a built generator can do at run time is declared on its class
(:class:`posttrain.rollout.completions.Capabilities`): whether it holds its own weights, syncs them, returns
sampler log-probs, samples in other processes. A new backend or transport is a builder and one
:func:`register_backend` or :func:`register_transport` call; :func:`check` then knows it by what it declares.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from posttrain.config import Config, ConfigError
from posttrain.rollout.completions import Generator, SamplingParams


@dataclass(frozen=True)
class Sampling:
    """What a backend's builder gets: the model it samples with (the policy or a sampling copy) and how."""

    model: Any
    tokenizer: Any
    params: SamplingParams
    eos_ids: list[int]
    config: Config
    seed: int = 0
    record_routing: bool = False


@dataclass(frozen=True)
class Backend:
    """A registered sampler: its builder and what it supports, which :func:`check` reads."""

    build: Callable[[Sampling], Generator]
    multi_turn: bool = False
    """It samples turn by turn in this process, so tools and environments can answer between turns."""
    sampling_copy: bool = False
    """It can sample from a copy of the policy (``sampler_noise``, ``sampler_dtype``)."""
    asynchronous: bool = False
    """It can sample ahead of the trainer (``async_rollout``)."""
    records_routing: bool = False
    """It records a mixture of experts' routing (``routing_replay``)."""
    check: Callable[[Config], list[str]] = lambda config: []
    """Problems of its own with a config (its package missing, settings it needs)."""


BACKENDS: dict[str, Backend] = {}
TRANSPORTS: dict[str, Callable[[Config], Any]] = {}


def register_backend(name: str, backend: Backend) -> Backend:
    """Make ``backend`` the sampler ``--backend NAME`` builds."""
    BACKENDS[name] = backend
    return backend


def register_transport(name: str, build: Callable[[Config], Any]) -> Callable[[Config], Any]:
    """Make ``build(config)`` the weight transport ``--weight-transport NAME`` uses."""
    TRANSPORTS[name] = build
    return build


def backend_name(config: Config) -> str:
    """The backend a config names: ``servers`` when it lists rollout servers, else its ``backend``."""
    return "servers" if config.rollout.rollout_server else config.rollout.backend


def problems(config: Config, *, episodes: bool, on_gpu: bool) -> list[str]:
    """Every problem of the config's rollout combination, each naming a field and what to change. ``episodes``:
    the run has tools or an environment (the config's or the task's); ``on_gpu``: it trains on a GPU."""
    r, o, name = config.rollout, config.off_policy, backend_name(config)
    if r.rollout_server and r.backend != "hf":
        return [f"rollout_server: the servers sample the rollouts; drop --backend {r.backend} (a colocated engine)"]
    if name not in BACKENDS:
        return [f"backend: got {r.backend!r}; use {_choices([n for n in BACKENDS if n != 'servers'])}"]
    backend, found = BACKENDS[name], []
    where = "the rollout servers" if name == "servers" else f"the {name} backend"
    if episodes and not backend.multi_turn:
        found.append(f"{'tools' if config.episodes.tools else 'environment'}: multi-turn episodes (tools, environments) "
                     f"sample turn by turn in this process, which {where} does not; use backend hf without "
                     "rollout servers")
    if o.sampling_copy and not backend.sampling_copy:
        found.append(f"{'sampler_noise' if o.sampler_noise else 'sampler_dtype'}: a sampling copy of the policy runs "
                     f"on the hf backend, not on {where}; set backend hf")
    if o.async_rollout and not backend.asynchronous:
        found.append(f"async_rollout: the rollout process samples with posttrain's decode loop; {where} cannot run "
                     "there (set backend hf; vLLM runs its own engine beside the trainer, synchronously)")
    if o.sampling_copy and config.model.fsdp:
        found.append("sampler_noise, sampler_dtype: the sampling copy is a whole model in every process; set fsdp off")
    if o.async_rollout and config.model.fsdp:
        found.append("async_rollout: the rollout process holds a whole copy of the model; set fsdp off")
    if o.routing_replay:
        if not backend.records_routing:
            found.append(f"routing_replay: the experts are recorded by posttrain's own sampler (--backend hf); "
                         f"{where} do not return them; drop --routing-replay")
        elif episodes:
            found.append("routing_replay: multi-turn episodes (tools, environments) are not recorded; drop "
                         "--routing-replay or the tools")
        if config.model.gradient_checkpointing:
            found.append("routing_replay: a recomputed layer would route by itself in the backward; drop "
                         "--gradient-checkpointing or --routing-replay")
    if name == "servers":
        if r.weight_transport not in TRANSPORTS:
            found.append(f"weight_transport: got {r.weight_transport!r}; use {_choices(list(TRANSPORTS))}")
        elif r.weight_transport == "nccl" and not on_gpu:
            found.append("weight_transport: nccl sends the weights from the trainer's GPU; train on a GPU "
                         "(--device cuda) or use gloo")
    return found + backend.check(config)


def _choices(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def check(config: Config, *, episodes: bool) -> None:
    """:func:`problems` of a run on this machine, raised together as one ConfigError (before any model loads)."""
    m = config.model
    on_gpu = m.device == "cuda" or (m.device == "auto" and torch.cuda.is_available())
    found = problems(config, episodes=episodes, on_gpu=on_gpu)
    if found:
        raise ConfigError(*found)


def build(sampling: Sampling) -> Generator:
    """The config's backend's sampler, with ``sampling``."""
    return BACKENDS[backend_name(sampling.config)].build(sampling)


# ---------------------------------------------------------------------------------------
# The built-in backends and transports
# ---------------------------------------------------------------------------------------


def _hf(s: Sampling) -> Generator:
    from posttrain.rollout.generators import make_generator

    return make_generator("hf", s.model, s.tokenizer, s.params, s.eos_ids, seed=s.seed, record_routing=s.record_routing)


def _vllm(s: Sampling) -> Generator:
    from posttrain.rollout.generators import make_generator

    return make_generator("vllm", s.model, s.tokenizer, s.params, s.eos_ids, seed=s.seed,
                          model_path=s.model.config.name_or_path)


def _vllm_problems(config: Config) -> list[str]:
    from posttrain.rollout.vllm import check_vllm_available

    try:
        check_vllm_available()
    except RuntimeError as error:
        return [f"backend: {error}"]
    return []


def _servers(s: Sampling) -> Generator:
    from posttrain.rollout.remote import RemoteGenerator

    r = s.config.rollout
    return RemoteGenerator(s.model, s.tokenizer, s.params, s.eos_ids, list(r.rollout_server),
                           TRANSPORTS[r.weight_transport](s.config), timeout_s=r.rollout_timeout)


def _filesystem(config: Config) -> Any:
    from posttrain.rollout.remote import FilesystemWeights

    return FilesystemWeights(Path(config.rollout.weight_sync_dir or Path(config.run.output) / "weights"))


def _collective(backend: str) -> Callable[[Config], Any]:
    def build_transport(config: Config) -> Any:
        from posttrain.rollout.remote import CollectiveWeights

        host, _, port = config.rollout.weight_sync_address.partition(":")
        return CollectiveWeights(backend, host, int(port or 0))

    return build_transport


register_backend("hf", Backend(_hf, multi_turn=True, sampling_copy=True, asynchronous=True, records_routing=True))
register_backend("vllm", Backend(_vllm, check=_vllm_problems))
register_backend("servers", Backend(_servers, sampling_copy=True, asynchronous=True))
register_transport("filesystem", _filesystem)
register_transport("gloo", _collective("gloo"))
register_transport("nccl", _collective("nccl"))
