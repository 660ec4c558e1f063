"""Where rollouts come from, in one place: the backend that samples, the transport that sends a backend the
policy's weights, the episodes around it, and the one check of their combinations.

- **Backends** (:data:`BACKENDS`): ``hf`` (posttrain's decode loop on the policy, or transformers' generate),
  ``vllm`` (a colocated vLLM engine) and ``servers`` (``posttrain serve`` processes, named by
  ``rollout_server``). Each is a :class:`Backend`: a builder, and what it supports (multi-turn episodes, a
  sampling copy of the policy, asynchronous rollouts, recording a mixture of experts' routing).
- **Weight transports** (:data:`TRANSPORTS`): ``filesystem``, ``gloo``, ``nccl``, for a backend that holds its
  own copy of the weights.
- **Episodes**: a backend's sampler wrapped in multi-turn episodes when the run has tools or an environment
  (:func:`posttrain.rollout.episodes.make_episode_generator`), or answering the calls of the user's agent
  (:class:`posttrain.rollout.agents.AgentGenerator`, which works on every backend: it samples whole answers).

What a built generator can do at run time is declared on its class
(:class:`posttrain.rollout.completions.Capabilities`): whether it holds its own weights, syncs them, returns
sampler log-probs, samples in other processes. A new backend or transport is a builder and one
:func:`register_backend` or :func:`register_transport` call; :func:`check` then knows it by what it declares.
"""

from __future__ import annotations

import dataclasses
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
    partial: bool = False
    """Its rollouts can be interrupted in flight and continued under newer weights (``partial_rollouts``)."""
    check: Callable[[Config], list[str]] = lambda config: []
    """Problems of its own with a config (its package missing, settings it needs)."""


@dataclass(frozen=True)
class Episodes:
    """What plays the episodes around a backend's sampler: tools (and their format) or an environment, turn by
    turn (``multi_turn`` backends), or the user's agent, whose calls the sampler answers."""

    tools: Any = None  # posttrain.rollout.episodes.Tools
    fmt: Any = None  # the tool format
    environment: Callable[[], Any] | None = None
    agent: Any = None  # posttrain.rollout.agents.Agent
    max_turns: int = 1
    on_error: str = "feedback"
    agent_timeout: float = 0.0


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


def problems(config: Config, *, episodes: bool, on_gpu: bool, agent: bool = False,
             installed: bool = True) -> list[str]:
    """Every problem of the config's rollout combination, each naming a field and what to change. ``episodes``:
    the run has tools or an environment (the config's or the task's); ``agent``: the user's agent plays them;
    ``on_gpu``: it trains on a GPU; ``installed``: the backend's own checks too (its package installed here),
    which a config read for another environment (``.venv-vllm``) leaves out."""
    r, o, name = config.rollout, config.off_policy, backend_name(config)
    if agent and episodes:
        return ["agent: the agent calls its own tools and plays its own environment; drop --tools, --mcp-server "
                "and --environment (or the task's tools: use a task without them, or a --dataset)"]
    if agent and o.routing_replay:
        return ["routing_replay: an agent's episodes are not recorded with their routing; drop --routing-replay"]
    if agent and o.partial_rollouts:
        return ["partial_rollouts: an agent's episodes are sampled whole, not continued under newer weights; drop "
                "--partial-rollouts"]
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
    if o.partial_rollouts and not backend.partial:
        found.append(f"partial_rollouts: a request is interrupted in posttrain's own sampler or on rollout servers, "
                     f"and {where} cannot be; use backend hf (with or without rollout servers), or drop "
                     "--partial-rollouts")
    elif o.partial_rollouts and episodes:
        found.append("partial_rollouts: multi-turn episodes (tools, environments) are not continued under newer "
                     "weights; drop --partial-rollouts or the tools and environment")
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
    return found + (backend.check(config) if installed else [])


def _choices(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def check(config: Config, *, episodes: bool, agent: bool = False) -> None:
    """:func:`problems` of a run on this machine, raised together as one ConfigError (before any model loads)."""
    m = config.model
    on_gpu = m.device == "cuda" or (m.device == "auto" and torch.cuda.is_available())
    found = problems(config, episodes=episodes, on_gpu=on_gpu, agent=agent)
    if found:
        raise ConfigError(*found)


def build(sampling: Sampling, episodes: Episodes | None = None) -> Generator:
    """The config's backend's sampler, with ``sampling``; around it, ``episodes``' agent, or its tools and
    environment turn by turn."""
    vision = vision_problems(sampling, episodes)
    if vision:
        raise ConfigError(*vision)
    if episodes is not None and episodes.agent is not None:
        from posttrain.rollout.agents import AgentGenerator
        from posttrain.rollout.tool_formats import ChatTemplateCalls

        fmt, tokenizer, stops = episodes.fmt, sampling.tokenizer, list(sampling.eos_ids)
        if isinstance(fmt, ChatTemplateCalls):  # a call ends the turn: at the family's end-of-turn tokens too
            stops += [i for i in fmt.turn_end_ids(tokenizer) if i not in stops]
        turn_ends = list(stops)
        if fmt is not None and fmt.call_end is not None:  # a mid-turn call: the turn stops where it closes
            stops.append(tokenizer.encode(fmt.call_end, add_special_tokens=False)[-1])
        sampler = BACKENDS[backend_name(sampling.config)].build(dataclasses.replace(sampling, eos_ids=stops))
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else sampling.eos_ids[0]
        return AgentGenerator(episodes.agent, sampler, tokenizer, fmt, sampling.params, eos_ids=turn_ends,
                              pad_id=pad_id, timeout=episodes.agent_timeout)
    if episodes is not None and (episodes.tools is not None or episodes.environment is not None):
        from posttrain.rollout.episodes import make_episode_generator

        return make_episode_generator(sampling.config.rollout.backend, sampling.model, sampling.tokenizer,
                                      sampling.params, sampling.eos_ids, episodes.tools, episodes.fmt,
                                      max_turns=episodes.max_turns, seed=sampling.seed,
                                      environment=episodes.environment, on_error=episodes.on_error)
    return BACKENDS[backend_name(sampling.config)].build(sampling)


def vision_problems(sampling: Sampling, episodes: Episodes | None) -> list[str]:
    """What a vision-language policy's rollouts cannot do yet: its images go through transformers' ``generate``
    in this process, with the prompt's images only."""
    from posttrain.models.vision import is_vision_model

    if not is_vision_model(sampling.model):
        return []
    found, c = [], sampling.config
    if backend_name(c) != "hf":
        found.append(f"backend: a vision-language model samples with its images through transformers' generate; "
                     f"use --backend hf{' without rollout servers' if c.rollout.rollout_server else ''}")
    if c.off_policy.async_rollout or c.off_policy.sampling_copy:
        found.append("async_rollout, partial_rollouts, sampler_dtype, sampler_noise: a vision-language model samples "
                     "with the policy itself; drop them")
    if episodes is not None and (episodes.agent is not None or episodes.tools is not None
                                 or episodes.environment is not None):
        found.append("agent, tools, environment: episodes of a vision-language model are not built (its images are "
                     "the prompt's); train it on single-turn rows")
    return found


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


register_backend("hf", Backend(_hf, multi_turn=True, sampling_copy=True, asynchronous=True, records_routing=True,
                               partial=True))
register_backend("vllm", Backend(_vllm, check=_vllm_problems))
register_backend("servers", Backend(_servers, sampling_copy=True, asynchronous=True, partial=True))
register_transport("filesystem", _filesystem)
register_transport("gloo", _collective("gloo"))
register_transport("nccl", _collective("nccl"))
