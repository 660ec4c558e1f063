"""What every trainer sets up the same way, and the protocol the run around a loop relies on.

A trainer's session is built in three shared steps, in this order, around what is its own (data,
value head, precomputed reference log-probs):

1. :func:`start_processes`: the checks that need no model, then process group and seeds;
2. :func:`load_policy`: the model and tokenizer (loaded from the config's ``model``, or the objects a
   Python caller passed), LoRA adapters, the frozen reference (a copy, or the base model under LoRA),
   then activation checkpointing (after the copy: the reference never runs with gradient);
3. :func:`build_optimization`: FSDP sharding (after the reference copy, before the optimizer sees the
   parameters), the optimizer and its schedule, and every process starting from rank 0's trainable
   weights (LoRA's random initialisation differs per process otherwise).

:class:`Trainer` is what :func:`posttrain.training.runner.run_training` needs of a session between
steps: checkpoints, resume, samples.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from posttrain.config import Config, ConfigError, absolute_path
from posttrain.data.images import encode_row_prompt
from posttrain.models.architecture import (
    VISION_PASSES,
    family,
    head_unsupported_reason,
    packing_unsupported_reason,
    unbatchable_reason,
)
from posttrain.models.compute import (
    checkpoint_layers,
    use_mixed_precision,
    use_packed_attention,
)
from posttrain.models.loading import load_model_and_tokenizer, resolve_mixed_precision
from posttrain.models.logprobs import check_causal, check_training_path, paths_taken
from posttrain.models.lora import apply_lora, reference_model
from posttrain.models.modeling import frozen_copy, resolve_device, unwrapped
from posttrain.models.vision import freeze_vision, is_vision_model
from posttrain.parallel import distributed, fsdp, offload
from posttrain.parallel.distributed import say
from posttrain.rollout.generators import generate_texts
from posttrain.tracking.stats import wilson_interval
from posttrain.training.optim import build_optimizer


@dataclass(frozen=True)
class Inputs:
    """Objects a Python caller hands over instead of names in the config (:func:`posttrain.train`).

    ``model`` with its ``tokenizer`` replaces loading ``config.model.model``; ``reward_funcs`` (TRL's
    signature) are called before the config's ``reward`` files, weighted by ``reward_weights``. Datasets are never objects here:
    :func:`posttrain.train` writes rows it is given to the run directory, so the config names them and
    the run can be resumed.
    """

    model: nn.Module | None = None
    tokenizer: Any = None
    reward_funcs: tuple[Callable[..., Any], ...] = ()
    reward_weights: tuple[float, ...] = ()
    """One per ``reward_funcs`` entry; empty: 1.0 each."""
    tools: tuple[Callable[..., Any], ...] = ()
    """Tools the policy may call, before the config's ``tools`` files."""
    environment: Callable[[], Any] | None = None
    """An environment class (:mod:`posttrain.data.environments`), instead of the config's ``environment``."""
    agent: Any = None
    """The user's agent (:class:`posttrain.rollout.agents.Agent`), instead of the config's ``agent``."""


class Trainer(Protocol):
    """A trainer's session, as the run around its loop sees it."""

    config: Config
    policy: nn.Module
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    step: int
    fingerprint: dict[str, Any]
    """What a checkpoint must match to be resumed into this session: model, algorithm, parameter count."""

    def checkpoint_modules(self) -> dict[str, nn.Module]:
        """Modules besides the policy that a checkpoint holds for an exact resume (a value head, a
        reference that is refreshed), by name."""
        ...

    def trainer_state(self) -> dict[str, Any]:
        """JSON-able state for an exact resume (weights and optimizer are saved separately)."""
        ...

    def extra_state(self) -> dict[str, Any]:
        """Tensor state for an exact resume; every process calls it."""
        ...

    def load_trainer_state(self, state: dict[str, Any], extra: dict[str, Any]) -> None:
        ...

    def sample_rows(self, limit: int = 16) -> list[dict[str, Any]]:
        """The last step's samples, for ``samples.jsonl``."""
        ...

    def close(self) -> None:
        """Release what the session started (a rollout process); the run calls it however it ends."""
        ...


class ResumableSession:
    """The part of :class:`Trainer` every session shares: an exact resume needs its data sampler's position and
    its run of skipped steps (``bad_steps``); by default it has no modules besides the policy, no tensor state,
    and nothing running beside it to close. A session that holds more adds it on top (the preference trainer's
    round of pairs; the online trainer's surplus groups and rollout process)."""

    sampler: Any
    bad_steps: int

    def checkpoint_modules(self) -> dict[str, nn.Module]:
        return {}

    def trainer_state(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict(), "bad_steps": self.bad_steps}

    def extra_state(self) -> dict[str, Any]:
        return {}

    def load_trainer_state(self, state: dict[str, Any], extra: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.bad_steps = state["bad_steps"]

    def close(self) -> None:
        """Nothing runs beside the trainer."""


def start_processes(config: Config, *, needs_reference: bool, name: str) -> None:
    """The checks that need no model (FSDP's, offloading's), then the process group and the seeds."""
    fsdp.check(config)
    offload.check(config.model.offload_reference,
                  needs_reference or bool(config.model.teacher or config.model.teachers), name)
    distributed.init(config.model.device)
    distributed.seed(config.run.seed)


def model_name(config: Config, default: str | None, inputs: Inputs) -> str:
    """The model a run trains: the config's, else the task's built-in one (an object: its name or path)."""
    if inputs.model is not None:
        return getattr(getattr(inputs.model, "config", None), "name_or_path", None) or type(inputs.model).__name__
    name = config.model.model or default
    if name is None:
        raise ConfigError("model: give --model PATH (a local Hugging Face model directory)")
    return name


def load_policy(config: Config, name: str, inputs: Inputs, *, needs_reference: bool,
                train_mode: bool) -> tuple[nn.Module, Any, nn.Module | None]:
    """(policy, tokenizer, frozen reference or None), in the module docstring's order."""
    m = config.model
    if inputs.model is not None:
        if inputs.tokenizer is None:
            raise ConfigError("tokenizer: a model object needs its tokenizer (posttrain.train(model, tokenizer=...))")
        policy, tokenizer = inputs.model.to(resolve_device(m.device)), inputs.tokenizer
        if tokenizer.pad_token_id is None:  # as loading does: padding needs an id, and EOS ends every completion
            tokenizer.pad_token = tokenizer.eos_token
        if resolve_mixed_precision(m.mixed_precision, m.dtype, policy.device) == "bf16":
            use_mixed_precision(policy)
    else:
        policy, tokenizer = load_model_and_tokenizer(name, dtype=m.dtype, device=m.device,
                                                     mixed_precision=m.mixed_precision,
                                                     trust_remote_code=m.trust_remote_code)
    if m.lora_r:
        policy = apply_lora(policy, m)  # base weights frozen; the reference is the base model
    elif is_vision_model(policy):
        freeze_vision(policy, m.train_vision)
    if is_vision_model(policy):
        vision = {"none": "the vision tower and the projector frozen", "projector": "the projector trained, the vision "
                  "tower frozen", "tower": "the vision tower and the projector trained"}[m.train_vision]
        say(f"vision-language model: {vision} (train_vision {m.train_vision}), "
            f"{'LoRA adapters on the language model' if m.lora_r else 'the language model trained whole'}")
    policy.train(train_mode)
    if config.optim.trim_padding:  # packed training passes where they are the model's own forward (models.packing)
        use_packed_attention(policy)
    check_model(policy, config)
    reference = reference_model(policy, m.offload_reference) if needs_reference else None
    if m.gradient_checkpointing:
        checkpoint_layers(policy)
    return policy, tokenizer, reference


def check_model(policy: nn.Module, config: Config) -> None:
    """Say which fast paths the model declines and why (one line each), then check that it is causal and that the
    training passes, with the run's settings, give its own forward's log-probs (:mod:`posttrain.models.logprobs`:
    a family computed wrongly stops here, before the first step)."""
    o = config.optim
    for line in path_notices(policy, trim_padding=o.trim_padding):
        say(line)
    unbatchable = unbatchable_reason(policy)
    if unbatchable:
        raise ConfigError(f"model: posttrain cannot train {family(policy)} exactly: {unbatchable}")
    vocab = unwrapped(policy).config.get_text_config().vocab_size
    check_causal(policy, vocab)
    gap = check_training_path(policy, vocab, share_prompts=o.share_prompts, trim_padding=o.trim_padding,
                              max_tokens_per_micro_batch=o.max_tokens_per_micro_batch,
                              micro_batch_size=o.micro_batch_size)
    say(f"training passes checked against {family(policy)}'s own forward: {gap:.1g} nats per token apart "
        f"({paths_taken(policy, share_prompts=o.share_prompts, trim_padding=o.trim_padding)})")


def path_notices(policy: nn.Module, *, trim_padding: bool) -> list[str]:
    """One line per fast path that ``policy`` does not take, with why and what runs instead."""
    lines = []
    packing = packing_unsupported_reason(policy)
    if packing == VISION_PASSES:  # one line says it: both fast paths step aside for the model's own forward
        return [f"packed passes, shared prompts and the folded LM head: off for {family(policy)}: {packing}"]
    if trim_padding and packing is not None:
        lines.append(f"packed passes: off for {family(policy)}: {packing}; rows grouped by length instead")
    head = head_unsupported_reason(policy)
    if head is not None:
        lines.append(f"folded LM head: off for {family(policy)}: {head}; the model's own head, at the completion's "
                     "positions only")
    return lines


def load_teacher(config: Config, name: str, student_tokenizer: Any, needs_teacher: bool, algorithm: str) -> nn.Module | None:
    """On-policy distillation's frozen teacher, on the student's device (offloaded with ``offload_reference``),
    or None. Its tokenizer must be the student's: the two score the same token ids."""
    teacher = config.model.teacher
    if config.model.teachers:
        raise ConfigError(f"teachers: {algorithm} takes no teacher per task; drop --teachers, or use --algorithm "
                          "multi_teacher_distill" + (" (one teacher: --teacher MODEL)" if needs_teacher else ""))
    if needs_teacher != bool(teacher):
        raise ConfigError(f"teacher: {algorithm} distils from a teacher model: give --teacher MODEL" if needs_teacher
                          else f"teacher: {algorithm} uses no teacher; drop --teacher, or choose a distillation "
                          "preset (on_policy_distill, gkd)")
    return _frozen_teacher(config, teacher, name, student_tokenizer) if teacher else None


def load_task_teachers(config: Config, name: str, student_tokenizer: Any) -> dict[str, nn.Module]:
    """Multi-teacher distillation's frozen teachers by task (``--teachers TASK=MODEL``, checked against the rows
    before: :func:`posttrain.training.session.training_row_tasks`), each loaded once and checked and kept as
    :func:`load_teacher` keeps its one."""
    return {task: _frozen_teacher(config, path, name, student_tokenizer)
            for task, path in config.model.teacher_by_task().items()}


def _frozen_teacher(config: Config, teacher: str, name: str, student_tokenizer: Any) -> nn.Module:
    model, tokenizer = load_model_and_tokenizer(teacher, dtype=config.model.dtype, device=config.model.device,
                                                mixed_precision=config.model.mixed_precision,
                                                trust_remote_code=config.model.trust_remote_code)
    if tokenizer.get_vocab() != student_tokenizer.get_vocab():
        ours, theirs = len(student_tokenizer.get_vocab()), len(tokenizer.get_vocab())
        raise ConfigError(f"teacher: {teacher} has another tokenizer than the student {name} ({theirs} and {ours} "
                          "tokens, ids that differ): distillation compares the two models' log-probs of the same "
                          "token ids; use a teacher of the student's family, with the same tokenizer")
    model.requires_grad_(False).eval()
    return offload.offload(model) if config.model.offload_reference else model


def copy_teacher(policy: nn.Module, offloaded: bool) -> nn.Module:
    """Self-distillation's teacher (sdft): a frozen copy of the policy, adapters and all under LoRA, taken before
    FSDP shards the policy; the step moves it toward the policy. ``offloaded``: kept out of memory between passes
    (``offload_reference``)."""
    teacher = frozen_copy(policy)
    return offload.offload(teacher) if offloaded else teacher


def build_optimization(config: Config, policy: nn.Module, extra: list[nn.Parameter],
                       optimizer_steps: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """(policy, sharded under FSDP; optimizer; scheduler) over the policy's trainable parameters and ``extra``."""
    if fsdp.requested(config):
        policy = fsdp.shard(policy)
    params = [p for p in policy.parameters() if p.requires_grad] + extra
    optimizer, scheduler = build_optimizer(params, config.optim, optimizer_steps)
    distributed.broadcast_parameters(params)
    return policy, optimizer, scheduler


def fingerprint(name: str, algorithm: str, policy: nn.Module) -> dict[str, Any]:
    """What a checkpoint must match to be resumed: the model, the algorithm, the parameter count."""
    return {"model": absolute_path(name), "algorithm": algorithm,
            "parameters": sum(p.numel() for p in policy.parameters())}


def greedy_accuracy(generator: Any, tokenizer: Any, correct: Callable[..., list[bool]],
                    rows: list[dict[str, Any]], tools: Sequence[Callable] = ()) -> dict[str, float]:
    """``eval/accuracy`` (with its 95% Wilson interval, ``_low``/``_high``): the share of ``rows`` whose greedy
    completion the task's ``correct(prompts, completions, **columns)`` accepts, for the offline trainers
    (prompts rendered with the ``tools`` the generator's episodes call)."""
    prompts = [encode_row_prompt(tokenizer, r, "held-out prompts", tools=tools)[0] for r in rows]
    texts, _ = generate_texts(generator, tokenizer, prompts, greedy=True, rows=rows)
    columns = {key: [r[key] for r in rows] for key in rows[0] if key != "prompt"}
    right = sum(correct([r["prompt"] for r in rows], texts, **columns))
    low, high = wilson_interval(right, len(rows))
    return {"eval/accuracy": right / len(rows), "eval/accuracy_low": low, "eval/accuracy_high": high}
