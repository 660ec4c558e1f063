"""Everything one online run holds, and the small operations the loop asks of it.

``OnlineSession.create(config)`` validates the whole config first (before any
model is loaded), then loads the task or dataset, the reward functions, the
policy, and only the extra pieces the preset needs: a frozen reference model
when it uses a KL term, a value head for GAE. The loop itself is in
``posttrain/training/online.py``. Under ``torchrun`` every process builds the same
session and joins the process group (``posttrain.parallel.distributed``).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Any, Callable

import torch
from torch import Tensor

from posttrain.algorithms.presets import OnlineAlgorithm
from posttrain.config import Config, ConfigError, DataConfig
from posttrain.data.images import encode_row_prompt, has_images, row_images
from posttrain.data.privileged import (
    check_privileged_rows,
    context_text,
    encode_teacher_prompts,
    privileged_column,
)
from posttrain.data.prompts import PromptSampler
from posttrain.data.row_tasks import row_tasks
from posttrain.data.rewards import load_reward_function
from posttrain.models.experts import replay_unsupported_reason
from posttrain.models.loading import resolve_mixed_precision
from posttrain.models.logprobs import probe_logprobs
from posttrain.models.modeling import ValueHead
from posttrain.parallel import distributed
from posttrain.rollout import factory as rollout_factory
from posttrain.rollout.agents import AgentGenerator
from posttrain.rollout.completions import Completions, SamplingParams
from posttrain.rollout.episodes import (
    EpisodeGenerator,
    Tools,
    tool_format,
)
from posttrain.rollout.generators import generate_texts
from posttrain.rollout.mcp_tools import stop_mcp_servers, with_mcp_tools
from posttrain.tracking.metrics import VARIANT_SEPARATOR
from posttrain.tracking.stats import wilson_interval
from posttrain.training.controllers import EntropyControl
from posttrain.training.groups import Groups
from posttrain.training.guards import (
    BF16_WEIGHTS_TOLERANCE,
    SELF_TEACHER_PROBE_ROWS,
    RewardWatch,
    SignalWatch,
    SyncCheck,
    UpdateCheck,
    self_teacher_probe,
)
from posttrain.training.optim import apply_gradients
from posttrain.training.rollouts import AsyncRollouts, SyncRollouts
from posttrain.training.setup import (
    Inputs,
    build_optimization,
    copy_teacher,
    fingerprint,
    load_policy,
    load_task_teachers,
    load_teacher,
    model_name,
    start_processes,
)
from posttrain.training.workload import (
    Workload,
    load_eval_workloads,
    load_workload,
    rewards_as_given,
    score_texts,
    within_budget,
)


def validate(config: Config, alg: OnlineAlgorithm, work: Workload) -> None:
    """Reject impossible combinations before any model is loaded; say what to change."""
    r = config.rollout
    if alg.is_group_estimator and r.group_size < 2:
        raise ConfigError(f"group_size: {alg.name}'s {alg.advantage!r} advantages compare samples of a group; "
                          f"use group_size >= 2 (got {r.group_size})")
    if work.correct is None and alg.binary_reward is not None:  # only when given: the preset's is dropped
        raise ConfigError(f"binary_reward: {alg.binary_reward} maps a task's answer check to (incorrect, correct) "
                          "rewards, and your reward functions have none; pass --binary-reward none (YAML: "
                          "binary_reward: null) to train on their values")
    if work.correct is None and alg.history_resampling:
        raise ConfigError("history_resampling: leaves out prompts whose every completion was correct, which needs "
                          "a task that checks answers (a built-in --task); pass --no-history-resampling to train "
                          "on your reward functions")
    d = config.data
    if work.correct is None and (d.difficulty_filter_low is not None or d.difficulty_filter_high is not None):
        raise ConfigError("difficulty_filter_low, difficulty_filter_high: skip prompts by the share of their "
                          "completions judged correct, which needs a task that checks answers (a built-in --task); "
                          "drop them to train on your reward functions")
    if work.correct is None and d.group_length_penalty is not None:
        # Without an answer check every sample would count as correct, and a short wrong answer would earn
        # the bonus that Kimi k1.5 keeps from it (min(0, lambda) for incorrect samples).
        raise ConfigError("group_length_penalty: Kimi k1.5's length penalty rewards brevity only in correct "
                          "answers, which needs a task that checks answers (a built-in --task); to shape length "
                          "with your reward functions, add --reward 'length_penalty(max_chars=N)' instead")
    if r.prompts_per_step > len(work.train_rows):
        raise ConfigError(f"prompts_per_step: {r.prompts_per_step} is more than the {len(work.train_rows)} prompts")
    # where rollouts come from: the backend, its transport, episodes, a sampling copy, asynchronous rollouts
    rollout_factory.check(config, episodes=bool(config.episodes.tools or config.episodes.mcp_server
                                                or config.episodes.environment or work.tools
                                                or work.environment), agent=work.agent is not None)
    check_self_teacher(config, alg, work)
    training_row_tasks(config, alg, work)  # a row without a teacher, or a teacher without rows, before loading
    world = distributed.world_size()
    if r.prompts_per_step % world:
        raise ConfigError(f"prompts_per_step: {r.prompts_per_step} prompts do not split evenly over {world} "
                          f"processes (each samples prompts_per_step / {world} prompts and all their completions); "
                          f"use a multiple of {world}")


def distillation_teachers(config: Config, alg: OnlineAlgorithm, name: str, policy: Any,
                          tokenizer: Any) -> tuple[Any | None, dict[str, Any] | None]:
    """(a distillation preset's teacher, or None; its teachers by task, or None): sdft's copy of the policy,
    multi_teacher_distill's --teachers, or on_policy_distill's --teacher (None for every other preset)."""
    if alg.teaches_itself:
        return copy_teacher(policy, config.model.offload_reference), None
    if alg.teacher_per_task:
        return None, load_task_teachers(config, name, tokenizer)
    return load_teacher(config, name, tokenizer, alg.needs_teacher_model, alg.name), None


def self_teacher_prompts(config: Config, alg: OnlineAlgorithm, policy: Any, tokenizer: Any, work: Workload,
                         prompt_ids: list[Tensor], tools: Sequence[Any]) -> list[Tensor] | None:
    """sdft's teacher prompts, one per training row (each with its privileged context), after saying whether the
    teacher reads them (:func:`say_self_teacher_probe`); None for every other preset."""
    if not alg.teaches_itself:
        return None
    teacher_prompts = encode_teacher_prompts(tokenizer, work.train_rows, config.data, tools)
    say_self_teacher_probe(policy, tokenizer, work, config, prompt_ids, teacher_prompts)
    return teacher_prompts


def say_self_teacher_probe(policy: Any, tokenizer: Any, work: Workload, config: Config, prompt_ids: list[Tensor],
                           teacher_prompts: list[Tensor]) -> None:
    """Say whether sdft's teacher reads its privileged context (guards.SelfTeacherProbe), on the first rows."""
    rows = work.train_rows[:SELF_TEACHER_PROBE_ROWS]
    column = privileged_column(config.data)
    contexts = [torch.tensor(tokenizer(context_text(row[column]), add_special_tokens=False).input_ids or
                             [tokenizer.eos_token_id]) for row in rows]
    probe = self_teacher_probe(policy, prompt_ids[:len(rows)], teacher_prompts[:len(rows)], contexts,
                               pad_id=tokenizer.pad_token_id)
    distributed.say(probe.line())


def check_self_teacher(config: Config, alg: OnlineAlgorithm, work: Workload) -> None:
    """Self-distillation (sdft) loads no --teacher and needs every training row's privileged context; the
    privileged-context settings belong to it alone."""
    data = config.data
    if not alg.teaches_itself:
        defaults = DataConfig()
        for name in ("privileged_column", "teacher_prompt_template"):
            # the value, not config.given: a resumed run's saved config gives every field
            if getattr(data, name) != getattr(defaults, name):
                raise ConfigError(f"{name}: only a self-distilling teacher (sdft) reads a privileged context; "
                                  f"{alg.name} has none, so drop --{name.replace('_', '-')} or use --algorithm sdft")
        return
    if config.model.teacher or config.model.teachers:
        raise ConfigError(f"teacher: {alg.name}'s teacher is the policy itself, reading each row's privileged "
                          "context after its prompt; drop --teacher and --teachers (or set self_teacher_ema none "
                          "to distil from a --teacher model that reads the student's prompt)")
    check_privileged_rows(work.train_rows, privileged_column(data), data.dataset or f"task {data.task}")


def episodes_of(config: Config, inputs: Inputs, work: Workload,
                tokenizer: Any) -> tuple[tuple[Callable, ...], rollout_factory.Episodes]:
    """The run's tools (the --mcp-server servers started) and how its episodes run: tool calls, the tool
    format, an environment or an agent, each from the config where given, else from the workload."""
    e = config.episodes
    tools = with_mcp_tools(config, (*inputs.tools, *(load_reward_function(spec, "tool") for spec in e.tools),
                                    *work.tools))
    on_error = "raise" if e.tool_errors == "error" else "feedback"
    return tools, rollout_factory.Episodes(
        Tools(tools, timeout=first_given(e.tool_timeout, work.tool_timeout, 10.0), on_error=on_error)
        if tools else None,
        tool_format(first_given(e.tool_format, work.tool_format, "auto"), tokenizer)
        if tools or work.agent else None,
        work.environment, work.agent, e.max_turns, on_error, e.agent_timeout)


def training_row_tasks(config: Config, alg: OnlineAlgorithm, work: Workload) -> list[str] | None:
    """Each training row's task, whose teacher scores it (multi-teacher distillation), checked against the
    ``--teachers`` (:func:`posttrain.data.row_tasks.row_tasks`); None for a preset with one teacher or none,
    which takes no ``task_column``."""
    if not alg.teacher_per_task:
        if config.data.task_column is not None:
            raise ConfigError(f"task_column: only multi-teacher distillation picks a row's teacher by its task; "
                              f"{alg.name} has none, so drop --task-column or use --algorithm multi_teacher_distill")
        return None
    if config.model.teacher:
        raise ConfigError(f"teacher: {alg.name} distils from a teacher per task; give --teachers TASK=MODEL for "
                          "each task instead of --teacher")
    if not config.model.teachers:
        raise ConfigError(f"teachers: {alg.name} distils from a teacher per task: give --teachers TASK=MODEL for "
                          "each task of the mixture")
    return row_tasks(work.train_rows, config.data, config.model.teacher_by_task(),
                     config.data.dataset or f"task {config.data.task}")


@dataclass
class OnlineSession:
    config: Config
    alg: OnlineAlgorithm
    work: Workload
    policy: Any
    tokenizer: Any
    ref: Any | None
    value_head: ValueHead | None
    optimizer: torch.optim.Optimizer
    scheduler: Any
    generator: Any
    encoded_prompts: list[Tensor]
    sampler: PromptSampler
    eos_ids: list[int]
    step: int = 0
    surplus: Any = None  # dynamic sampling's groups with signal waiting for the next step
    last_groups: Any = None
    bad_steps: int = 0
    fingerprint: dict[str, Any] = field(default_factory=dict)
    eval_workloads: dict[str, Workload] = field(default_factory=dict)  # config.data.eval_tasks, by label
    episodes: EpisodeGenerator | AgentGenerator | None = None  # multi-turn: the generator, whose stats the step logs
    tools: tuple[Callable, ...] = ()  # rendered into chat prompts by the tokenizer's template
    sampling_copy: Any | None = None  # sampler_noise/_dtype: the copy of the policy that samples the rollouts
    sync_check: SyncCheck | None = None  # a sampler with weights of its own samples the trained ones (guards)
    teacher: Any | None = None  # on-policy distillation's teacher: a frozen --teacher, or the policy's copy (sdft)
    task_teachers: dict[str, Any] | None = None  # multi-teacher distillation: a frozen teacher by task (--teachers)
    row_tasks: list[str] | None = None  # multi-teacher distillation: each training row's task
    teacher_prompts: list[Tensor] | None = None  # sdft: each training row's prompt with its privileged context
    eval_generator: Any = None  # with a sampler copy: held-out evaluation's generator, on the policy itself
    rollouts: SyncRollouts | AsyncRollouts = field(default_factory=SyncRollouts)  # where each round comes from
    heldout_samples: list[dict[str, Any]] = field(default_factory=list)  # image tasks: the last evaluation's few
    # the guards against runs that learn nothing (posttrain.training.guards)
    signal_watch: SignalWatch = field(init=False)
    reward_watch: RewardWatch = field(init=False)
    update_check: UpdateCheck = field(init=False)
    entropy_control: EntropyControl | None = field(init=False)  # the preset's entropy bonus, if it has one

    def __post_init__(self) -> None:
        self.entropy_control = EntropyControl.of(self.alg)
        self.signal_watch = SignalWatch(self.config.rollout.max_no_signal_steps)
        self.reward_watch = RewardWatch()
        self.update_check = UpdateCheck(self.policy, lora=bool(self.config.model.lora_r))

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def create(cls, config: Config, inputs: Inputs = Inputs()) -> "OnlineSession":
        alg = config.preset()
        if not isinstance(alg, OnlineAlgorithm):
            raise ConfigError(f"algorithm: {alg.name} is an offline preference preset; the online trainer "
                              "runs online presets (posttrain train routes it to the preference trainer)")
        work = load_workload(config, inputs)
        alg = rewards_as_given(config, alg, work)
        validate(config, alg, work)
        eval_workloads = load_eval_workloads(config, work.max_new_tokens)  # their errors before the model loads
        if config.model.lora_r and config.optim.ref_refresh_every:
            raise ConfigError("ref_refresh_every: with LoRA the reference is the policy with its adapters off "
                              "and cannot be refreshed; set ref_refresh_every 0, or lora_r 0 to train all weights")
        start_processes(config, needs_reference=alg.needs_reference or alg.teaches_itself, name=alg.name)
        name = model_name(config, work.default_model, inputs)
        policy, tokenizer, ref = load_policy(config, name, inputs, needs_reference=alg.needs_reference,
                                             train_mode=True)
        if config.off_policy.routing_replay and replay_unsupported_reason(policy):
            raise ConfigError(f"routing_replay: {replay_unsupported_reason(policy)}; drop --routing-replay")
        teacher, task_teachers = distillation_teachers(config, alg, name, policy, tokenizer)
        value_head = ValueHead(policy.config.hidden_size).to(policy.device) if alg.needs_value_model else None
        policy, optimizer, scheduler = build_optimization(
            config, policy, list(value_head.parameters()) if value_head else [],
            optimizer_steps=config.run.max_steps * alg.num_epochs * alg.mini_batches)
        eos_ids = eos_token_ids(policy, tokenizer)
        r = config.rollout
        params = SamplingParams(work.max_new_tokens, r.temperature, r.top_p, r.top_k)
        seed = config.run.seed + distributed.rank()
        tools, episodes_spec = episodes_of(config, inputs, work, tokenizer)

        def generator_of(model: Any) -> Any:
            return rollout_factory.build(rollout_factory.Sampling(
                model, tokenizer, params, eos_ids, config, seed, record_routing=config.off_policy.routing_replay),
                episodes_spec)

        # sampler_noise/_dtype: a copy samples the rollouts (refresh_sampler); evaluation samples the policy
        sampling_copy = None
        if config.off_policy.sampling_copy:
            sampling_copy = copy.deepcopy(policy).requires_grad_(False)
            if config.off_policy.sampler_dtype:
                sampling_copy.to(getattr(torch, config.off_policy.sampler_dtype))
        generator = generator_of(sampling_copy if sampling_copy is not None else policy)
        episodes = generator if isinstance(generator, (EpisodeGenerator, AgentGenerator)) else None
        work, prompt_ids = within_budget(config, work, [
            encode_row_prompt(tokenizer, row, f"training prompts: row {number}", tools=tools)[0]
            for number, row in enumerate(work.train_rows, start=1)])
        separate = (sampling_copy is not None or config.off_policy.async_rollout
                    or generator.capabilities.own_weights)
        sync_check = SyncCheck.of(prompt_ids[0], policy, sampling_copy, generator,
                                  resolve_mixed_precision(config.model.mixed_precision, config.model.dtype, policy.device),
                                  separate and not config.off_policy.sampler_noise)  # noise: different on purpose
        if sync_check is not None and r.rollout_server:  # a server may hold bf16 weights (posttrain serve --dtype)
            sync_check.tolerance = max(sync_check.tolerance, BF16_WEIGHTS_TOLERANCE)
        return cls(
            config, alg, work, policy, tokenizer, ref, value_head, optimizer, scheduler, generator, prompt_ids,
            PromptSampler(len(work.train_rows), config.run.seed, alg.history_resampling,
                          config.data.difficulty_filter_low, config.data.difficulty_filter_high),
            eos_ids,
            fingerprint=fingerprint(name, alg.name, policy),
            eval_workloads=eval_workloads,
            episodes=episodes,
            tools=tools,
            sampling_copy=sampling_copy,
            teacher=teacher,
            task_teachers=task_teachers,
            row_tasks=training_row_tasks(config, alg, work),  # the rows left within the prompt budget
            teacher_prompts=self_teacher_prompts(config, alg, policy, tokenizer, work, prompt_ids, tools),
            eval_generator=None if sampling_copy is None else generator_of(policy),
            rollouts=AsyncRollouts(config.off_policy.max_staleness, config.off_policy.rollout_threads,
                                   config.off_policy.partial_rollouts)
            if config.off_policy.async_rollout else SyncRollouts(),
            sync_check=sync_check,
        )

    # -- what the loop asks ------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.policy.device

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id

    @property
    def max_new_tokens(self) -> int:
        return self.work.max_new_tokens

    @property
    def train_rows(self) -> list[dict[str, Any]]:
        return self.work.train_rows

    @property
    def needs_rollout_logprobs(self) -> bool:
        """Whether log-probs (and values) of the sampling policy must be recorded at rollout time:
        several updates or mini-batches per rollout (the policy moves before the last one),
        KL in the reward (it needs the sampling policy's log-probs), PPO's values, distillation, or
        dynamic sampling's surplus groups (trained one step later)."""
        a = self.alg
        kl_in_reward = a.needs_reference and a.kl_placement != "loss"
        return a.needs_old_logprobs or kl_in_reward or a.needs_value_model or a.needs_teacher

    def refresh_sampler(self, for_step: int | None = None) -> None:
        """The sampling copy becomes the policy's current weights (in ``sampler_dtype``), times
        ``1 + sampler_noise * N(0, 1)``, the noise drawn from (seed, the step that trains on its samples:
        this one unless sampled ahead), so a resumed run draws it again."""
        if self.sampling_copy is None:
            return
        step = self.step if for_step is None else for_step
        generator = torch.Generator().manual_seed(self.config.run.seed * 1_000_003 + step)
        noise = self.config.off_policy.sampler_noise
        with torch.no_grad():
            for copy_, weight in zip(self.sampling_copy.parameters(), self.policy.parameters(), strict=True):
                if noise:
                    factor = 1 + noise * torch.randn(weight.shape, generator=generator)
                    copy_.copy_(weight * factor.to(weight.device, weight.dtype))  # cast to the copy's dtype
                else:
                    copy_.copy_(weight)
        if self.sync_check is not None:
            probe = self.sync_check.probe_ids
            self.sync_check.verify(probe_logprobs(self.policy, probe), probe_logprobs(self.sampling_copy, probe),
                                   "the sampling copy", f"step {step}")

    def optimizer_step(self) -> float:
        """Clip and apply the accumulated gradient; a non-finite one is dropped, not applied."""
        before, lr = self.update_check.before_step(), self.scheduler.get_last_lr()[0]
        grad_norm, self.bad_steps = apply_gradients(self.optimizer, self.scheduler, self.config.optim, self.bad_steps)
        self.update_check.after_step(before, grad_norm, lr)
        return grad_norm

    # -- checkpoint state --------------------------------------------------------------------

    def checkpoint_modules(self) -> dict[str, torch.nn.Module]:
        """PPO's value head, and a reference that is refreshed during the run (it is no longer the start)."""
        modules: dict[str, torch.nn.Module] = {}
        if self.value_head is not None:
            modules["value_head"] = self.value_head
        if self.ref is not None and self.config.optim.ref_refresh_every:
            modules["reference"] = self.ref
        if self.alg.self_teacher_ema:  # sdft's teacher has moved away from the starting weights
            modules["teacher"] = self.teacher
        return modules

    def trainer_state(self) -> dict[str, Any]:
        """JSON-able state for an exact resume (weights and optimizer are saved separately)."""
        return {"sampler": self.sampler.state_dict(), "bad_steps": self.bad_steps,
                "no_signal_steps": self.signal_watch.streak,
                **({"entropy_control": self.entropy_control.state_dict()} if self.entropy_control else {})}

    def extra_state(self) -> dict[str, Any]:
        """Tensor state: dynamic sampling's surplus groups of every process, which train at the next step, and
        the batches asynchronous rollouts sampled ahead (every process must call it)."""
        parts = [groups for groups in distributed.gather(self.surplus) if groups is not None]
        return {"surplus": dataclasses.asdict(Groups.cat(parts)) if parts else None,
                "rollouts": self.rollouts.state(self)}

    def load_trainer_state(self, state: dict[str, Any], extra: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.bad_steps = state["bad_steps"]
        self.signal_watch.streak = state.get("no_signal_steps", 0)  # absent from checkpoints before the guard
        if self.entropy_control and "entropy_control" in state:
            self.entropy_control.load_state_dict(state["entropy_control"])
        surplus = extra.get("surplus")  # every process's: each takes its share, whatever the process count
        self.surplus = None if surplus is None else Groups(**{
            **surplus, "completions": Completions(**surplus["completions"])}).shard()
        self.rollouts.load(extra.get("rollouts"))

    def close(self) -> None:
        """Stop the rollout process, the MCP servers and the agent endpoint, if any."""
        self.rollouts.close()
        stop_mcp_servers(self.tools)
        if isinstance(self.generator, AgentGenerator):
            self.generator.close()

    def sample_rows(self, limit: int = 16) -> list[dict[str, Any]]:
        """The last step's first completions with their rewards, for samples.jsonl."""
        g = self.last_groups
        if g is None:
            return []
        rows = []
        for i in range(min(limit, len(g.texts))):
            group = i // g.group_size
            row = {"prompt": self.train_rows[g.indices[group]]["prompt"], "completion": g.texts[i],
                   "reward": float(g.rewards.view(-1)[i]), "length": int(g.completions.lengths[i])}
            row.update({f"reward/{k}": float(v[i]) for k, v in g.terms.items()})
            if g.correct is not None:
                row["correct"] = bool(g.correct[i])
            rows.append(row)
        return rows

HELDOUT_SAMPLES = 6
"""Held-out image rows whose greedy answers a run keeps at each full evaluation (heldout_samples.jsonl)."""


def first_given(*values: Any) -> Any:
    """The first value that is not None (a run's setting, else its task's, else the default)."""
    return next(v for v in values if v is not None)


def eos_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """EOS ids from the generation config (chat models end turns with their own token) and tokenizer."""
    ids = model.generation_config.eos_token_id if model.generation_config is not None else None
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise ConfigError("model: the tokenizer defines no EOS token, so completions could never end")
    return ids


@torch.no_grad()
def evaluate(s: OnlineSession, limit: int | None = None) -> dict[str, float]:
    """Greedy decodes of the first ``limit`` held-out prompts (None: all): accuracy (when the task
    checks answers) with its 95% interval, reward, length; the same for the first ``limit`` of each
    ``eval_tasks`` entry, under ``eval/LABEL/``."""
    out = _evaluate_workload(s, s.work, limit, "eval/")
    by_task: dict[str, list[float]] = {}
    for label, work in s.eval_workloads.items():  # eval_tasks: other tasks' held-out problems, same policy
        out.update(_evaluate_workload(s, work, limit, f"eval/{label}/"))
        task, separator, _ = label.partition(VARIANT_SEPARATOR)
        if separator and f"eval/{label}/accuracy" in out:
            by_task.setdefault(task, []).append(out[f"eval/{label}/accuracy"])
    for task, accuracies in by_task.items():  # the same problems asked every way: how the skill holds up
        out[f"eval/{task}/variants_mean"] = sum(accuracies) / len(accuracies)
        out[f"eval/{task}/variants_worst"] = min(accuracies)
    return out


def _evaluate_workload(s: OnlineSession, work: Workload, limit: int | None, prefix: str) -> dict[str, float]:
    rows = work.test_rows[:limit]
    if not rows:
        return {}
    texts, completions = generate_texts(s.eval_generator or s.generator, s.tokenizer,
                                        [encode_row_prompt(s.tokenizer, r, "held-out prompts", tools=s.tools)[0]
                                         for r in rows],
                                        greedy=True, rows=rows)
    scores, correct = score_texts(work, s.config.data, rows, texts, 1, completions.rewards)
    if prefix == "eval/" and has_images(rows[0]):  # a few to look at, the images with the answers (the report's)
        s.heldout_samples = [{"row": i, "prompt": rows[i]["prompt"], "answer": rows[i].get("answer"),
                              "completion": texts[i], "correct": None if correct is None else bool(correct[i]),
                              "images": row_images(rows[i], f"held-out row {i + 1}")}
                             for i in range(min(HELDOUT_SAMPLES, len(rows)))]
    out = {f"{prefix}reward": scores.total.mean().item(),
           f"{prefix}completion_length": completions.lengths.float().mean().item()}
    if correct is not None:
        out[f"{prefix}accuracy"] = correct.float().mean().item()
        out[f"{prefix}accuracy_low"], out[f"{prefix}accuracy_high"] = wilson_interval(int(correct.sum()), len(correct))
    check = s.config.run.divergence_check  # a reward function the user named as the check: its own mean
    if check in scores.terms:
        out[f"{prefix}reward/{check}"] = scores.terms[check].nanmean().item()
    return out
