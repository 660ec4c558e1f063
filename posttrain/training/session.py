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
from typing import Any, Callable

import torch
from torch import Tensor

from posttrain.algorithms.presets import OnlineAlgorithm
from posttrain.config import Config, ConfigError, DataConfig
from posttrain.data.environments import ENVIRONMENT_REWARD, environment_reward
from posttrain.data.judge import Judge, load_rubric
from posttrain.data.prompts import (
    PromptSampler,
    as_completion,
    check_prompt_rows,
    encode_prompt,
    read_rows,
    within_prompt_budget,
)
from posttrain.data.prompt_variants import ask, ask_each_differently, resolve_variants
from posttrain.data.rewards import RewardModel, load_reward, load_reward_function
from posttrain.data.scoring import RewardPolicy, Scores, score
from posttrain.data.tasks import get_task
from posttrain.data.tasks.task import REASONING_GYM_PREFIX, VERIFIERS_PREFIX
from posttrain.models.experts import replay_unsupported_reason
from posttrain.models.logprobs import probe_logprobs
from posttrain.models.modeling import ValueHead, resolve_device
from posttrain.parallel import distributed
from posttrain.rollout.completions import Completions, SamplingParams
from posttrain.rollout.episodes import (
    EpisodeGenerator,
    Tools,
    make_episode_generator,
    tool_format,
)
from posttrain.rollout.generators import generate_texts, make_generator
from posttrain.rollout.mcp_tools import stop_mcp_servers, with_mcp_tools
from posttrain.tracking.metrics import VARIANT_SEPARATOR
from posttrain.tracking.stats import wilson_interval
from posttrain.training.controllers import EntropyControl
from posttrain.training.groups import Groups
from posttrain.training.guards import BF16_WEIGHTS_TOLERANCE, RewardWatch, SignalWatch, SyncCheck, UpdateCheck
from posttrain.training.optim import apply_gradients
from posttrain.training.rollouts import AsyncRollouts, SyncRollouts
from posttrain.training.setup import (
    Inputs,
    build_optimization,
    fingerprint,
    load_policy,
    load_teacher,
    model_name,
    start_processes,
)


@dataclass
class Workload:
    """What to train on: prompts, reward functions and (for built-in tasks) a correctness check."""

    train_rows: list[dict[str, Any]]
    test_rows: list[dict[str, Any]]
    reward_fns: list[Callable]
    reward_weights: list[float]
    correct: Callable | None  # (prompts, completions, **columns) -> list[bool]
    max_new_tokens: int
    default_model: str | None
    final_answer: Callable[[str], str | None] | None = None  # the task's answer parser (posttrain eval's maj@K)
    tools: tuple[Callable, ...] = ()  # the task's tools (multi-turn episodes)
    tool_format: str | None = None  # how the task's calls are written
    tool_timeout: float | None = None  # the task's limit per call
    environment: Callable[[], Any] | None = None  # the class whose instances play the episodes


def _within_budget(config: Config, work: Workload, prompt_ids: list[Tensor]) -> tuple[Workload, list[Tensor]]:
    """The workload and encoded prompts without those over ``max_prompt_length`` (``long_prompts``)."""
    source, limit = config.data.dataset or f"task {config.data.task}", config.preference.max_prompt_length
    kept = within_prompt_budget(prompt_ids, limit, config.data.long_prompts, source, config.rollout.prompts_per_step)
    if len(kept) == len(prompt_ids):
        return work, prompt_ids
    distributed.say(f"{source}: dropped {len(prompt_ids) - len(kept)} of {len(prompt_ids)} prompts longer than "
                    f"max_prompt_length {limit} tokens (long_prompts drop)")
    return dataclasses.replace(work, train_rows=[work.train_rows[i] for i in kept]), [prompt_ids[i] for i in kept]


def load_workload(config: Config, inputs: Inputs = Inputs()) -> Workload:
    """The task or dataset named by the config, with its reward functions (``inputs``' first); checks the rows."""
    data = config.data
    env_spec = config.episodes.environment  # verifiers:NAME is a task: it brings its rows and rewards
    own = env_spec if env_spec and env_spec.startswith(VERIFIERS_PREFIX) else None
    if own and data.dataset is not None:
        raise ConfigError(f"environment: {own} brings its own tasks; drop --dataset or the environment")
    if data.dataset is not None:
        train_rows = read_rows(data.dataset, data.dataset_config, data.dataset_split)
        check_prompt_rows(train_rows, data.dataset)
        test_rows = read_rows(data.eval_dataset, data.dataset_config, data.eval_dataset_split) if data.eval_dataset else []
        if test_rows:
            check_prompt_rows(test_rows, data.eval_dataset)
        if not (data.reward or inputs.reward_funcs or data.reward_url or data.reward_model or data.judge):
            raise ConfigError("reward: a --dataset needs at least one --reward NAME or FILE.py:FUNCTION (from "
                              "Python: reward_funcs=[...]), a --reward-url URL, a --reward-model DIR or a --judge "
                              "MODEL")
        task = None
    else:
        task = get_task(own or data.task)  # a fixed split: the built-in models were warm-started on its train part
        train_rows, test_rows = list(task.train), list(task.test)
        distributed.say(f"task {own or data.task}: {task.description} ({len(train_rows)} training prompts, "
                        f"{len(test_rows)} held out)")
    if data.train_prompt_variants:  # each prompt asked one of several ways: the problem, not a phrasing, is learnt
        train_rows = ask_each_differently(train_rows, resolve_variants(data.train_prompt_variants),
                                          config.run.seed, data.dataset or data.task)
    from posttrain.data.remote import is_url, remote_judge, remote_rewards

    if data.reward or inputs.reward_funcs or data.reward_url or data.reward_model is not None or data.judge is not None:
        fns = [*inputs.reward_funcs, *(load_reward(spec) for spec in data.reward), *remote_rewards(data)]
        weights = [*(inputs.reward_weights or [1.0] * len(inputs.reward_funcs)),
                   *(data.reward_weights or [1.0] * len(data.reward)), *[1.0] * len(data.reward_url)]
        if data.reward_model is not None:  # alongside the functions, or instead of the task's rewards
            fns.append(RewardModel(data.reward_model, batch_size=config.optim.micro_batch_size,
                                   normalize=data.reward_model_normalize, device=resolve_device(config.model.device)))
            weights.append(data.reward_model_weight)
        if data.judge is not None:
            fns.append(remote_judge(data) if is_url(data.judge) else make_judge(config))
            weights.append(data.judge_weight)
    else:
        fns, weights = list(task.reward_funcs), list(task.reward_weights)
    environment = inputs.environment or (
        load_reward_function(env_spec, "environment") if env_spec and not own else None)
    environment = environment or (task.environment if task else None)
    if environment is not None and environment_reward not in fns:  # the episode's reward counts, always
        fns, weights = [environment_reward, *fns], [1.0, *weights]
    budget = config.rollout.max_new_tokens or (task.max_new_tokens if task else None)
    if budget is None:
        raise ConfigError("max_new_tokens: set the completion token budget for a dataset run")
    return Workload(train_rows, test_rows[: data.eval_size], fns, weights,
                    task.correct if task else None, budget, task.default_model if task else None,
                    task.final_answer if task else None, task.tools if task else (),
                    task.tool_format if task else None, task.tool_timeout if task else None, environment)


def make_judge(config: Config) -> Judge:
    """The run's ``--judge``, loaded on the training device and batched like the reward model."""
    from posttrain.models.loading import load_model_and_tokenizer

    data = config.data
    model, tokenizer = load_model_and_tokenizer(data.judge, device=config.model.device)
    return Judge(model, tokenizer, rubric=load_rubric(data.judge_rubric, "pointwise"),
                 pairwise_rubric=load_rubric(data.judge_pairwise_rubric, "pairwise"),
                 batch_size=config.optim.micro_batch_size)


def eval_label(task: str) -> str:
    """The metric name of an ``eval_tasks`` entry: a built-in task's name, or a reasoning-gym spec's
    families joined by ``+`` (``reasoning-gym:gsm_symbolic`` -> ``gsm_symbolic``)."""
    if not task.startswith(REASONING_GYM_PREFIX):
        return task
    from posttrain.data.tasks.reasoning_gym import (
        parse_spec,  # the optional reasoning-gym package
    )

    return "+".join(c.family for c in parse_spec(task))


def load_eval_workloads(config: Config, max_new_tokens: int) -> dict[str, Workload]:
    """The ``eval_tasks`` by label: each task's held-out rows (up to ``eval_size``), rewards and check,
    generated with the run's token budget; with ``eval_prompt_variants``, one per task and variant,
    labelled ``LABEL@VARIANT``."""
    data = config.data
    variants = resolve_variants(data.eval_prompt_variants) if data.eval_prompt_variants else [None]
    workloads: dict[str, Workload] = {}
    for spec in data.eval_tasks:
        label = eval_label(spec)
        if label in workloads:
            raise ConfigError(f"eval_tasks: two entries are both labelled {label!r}; give each task once")
        try:
            task = get_task(spec)
        except ConfigError:
            raise
        except ValueError as error:  # an unknown built-in task
            raise ConfigError(f"eval_tasks: {error}") from None
        if not task.test:
            raise ConfigError(f"eval_tasks: {spec!r} has no held-out problems")
        rows = list(task.test)[: data.eval_size]
        for variant in variants:
            workloads[label if variant is None else f"{label}{VARIANT_SEPARATOR}{variant.name}"] = Workload(
                [], rows if variant is None else ask(rows, variant, spec), list(task.reward_funcs),
                list(task.reward_weights), task.correct, max_new_tokens, task.default_model, task.final_answer)
    return workloads


def score_texts(work: Workload, data: DataConfig, rows: list[dict], texts: list[str],
                g: int, environment_rewards: Tensor | None = None) -> tuple[Scores, Tensor | None]:
    """The workload's rewards of ``len(rows) * g`` completion texts (row i's at i*g .. i*g + g - 1), and
    the task's verdicts ([N] bool; None when the workload has no correctness check). An environment's
    episode rewards ([N]) reach the reward functions and the check as the ``environment_reward`` column."""
    prompts = [row["prompt"] for row in rows for _ in range(g)]
    completions = [as_completion(p, t) for p, t in zip(prompts, texts)]
    columns = {k: [row.get(k) for row in rows for _ in range(g)] for k in rows[0] if k != "prompt"}
    if environment_rewards is not None:
        columns[ENVIRONMENT_REWARD] = environment_rewards.tolist()
    scores = score(work.reward_fns, work.reward_weights, prompts, completions, columns,
                   RewardPolicy(data.reward_timeout, data.reward_errors))
    correct = None
    if work.correct is not None:
        correct = torch.tensor(work.correct(prompts=prompts, completions=completions, **columns), dtype=torch.bool)
    return scores, correct


def rewards_as_given(config: Config, alg: OnlineAlgorithm, work: Workload) -> OnlineAlgorithm:
    """The preset for rewards without an answer check (``--reward`` functions, a reward model): a preset's
    own ``binary_reward`` (DAPO's +-1 for a correct answer) is dropped, so the rewards train as they are and
    dynamic sampling drops the groups whose rewards are all equal. One the user gave is kept (``validate``
    refuses it)."""
    if work.correct is not None or alg.binary_reward is None or "binary_reward" in config.overrides:
        return alg
    distributed.say(f"{alg.name}: your rewards train as they are (binary_reward {alg.binary_reward} maps a "
                    "task's answer check, which they have none of)")
    return dataclasses.replace(alg, binary_reward=None)


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
    if r.prompts_per_step > len(work.train_rows):
        raise ConfigError(f"prompts_per_step: {r.prompts_per_step} is more than the {len(work.train_rows)} prompts")
    if r.rollout_server and (config.episodes.tools or config.episodes.environment or work.tools or work.environment):
        raise ConfigError("rollout_server: multi-turn episodes (tools, environments) sample on this process; drop "
                          "--rollout-server or the tools")
    on_gpu = config.model.device == "cuda" or (config.model.device == "auto" and torch.cuda.is_available())
    if r.rollout_server and r.weight_transport == "nccl" and not on_gpu:
        raise ConfigError("weight_transport: nccl sends the weights from the trainer's GPU; train on a GPU "
                          "(--device cuda) or use gloo")
    if config.off_policy.routing_replay:
        sampled_elsewhere = "rollout servers" if r.rollout_server else "vLLM" if r.backend == "vllm" else None
        if sampled_elsewhere:
            raise ConfigError(f"routing_replay: the experts are recorded by posttrain's own sampler (--backend hf); "
                              f"{sampled_elsewhere} do not return them; drop --routing-replay")
        if config.episodes.tools or config.episodes.environment or work.tools or work.environment:
            raise ConfigError("routing_replay: multi-turn episodes (tools, environments) are not recorded; drop "
                              "--routing-replay or the tools")
        if config.model.gradient_checkpointing:
            raise ConfigError("routing_replay: a recomputed layer would route by itself in the backward; drop "
                              "--gradient-checkpointing or --routing-replay")
    if r.rollout_server and r.backend == "vllm":
        raise ConfigError("rollout_server: the servers sample the rollouts; drop --backend vllm (a colocated engine)")
    if r.backend == "vllm":
        from posttrain.rollout.vllm import check_vllm_available

        try:
            check_vllm_available()
        except RuntimeError as error:
            raise ConfigError(f"backend: {error}") from None
    if config.off_policy.sampling_copy and config.model.fsdp:
        raise ConfigError("sampler_noise, sampler_dtype: the sampling copy is a whole model in every process; "
                          "set fsdp off")
    world = distributed.world_size()
    if r.prompts_per_step % world:
        raise ConfigError(f"prompts_per_step: {r.prompts_per_step} prompts do not split evenly over {world} "
                          f"processes (each samples prompts_per_step / {world} prompts and all their completions); "
                          f"use a multiple of {world}")


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
    episodes: EpisodeGenerator | None = None  # with tools or an environment: the generator, whose stats the step logs
    tools: tuple[Callable, ...] = ()  # rendered into chat prompts by the tokenizer's template
    sampling_copy: Any | None = None  # sampler_noise/_dtype: the copy of the policy that samples the rollouts
    sync_check: SyncCheck | None = None  # a sampler with weights of its own samples the trained ones (guards)
    teacher: Any | None = None  # on-policy distillation's frozen teacher (setup.load_teacher)
    eval_generator: Any = None  # with a sampler copy: held-out evaluation's generator, on the policy itself
    rollouts: SyncRollouts | AsyncRollouts = field(default_factory=SyncRollouts)  # where each round comes from
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
        start_processes(config, needs_reference=alg.needs_reference, name=alg.name)
        name = model_name(config, work.default_model, inputs)
        policy, tokenizer, ref = load_policy(config, name, inputs, needs_reference=alg.needs_reference,
                                             train_mode=True)
        if config.off_policy.routing_replay and replay_unsupported_reason(policy):
            raise ConfigError(f"routing_replay: {replay_unsupported_reason(policy)}; drop --routing-replay")
        teacher = load_teacher(config, name, tokenizer, alg.needs_teacher, alg.name)
        value_head = ValueHead(policy.config.hidden_size).to(policy.device) if alg.needs_value_model else None
        policy, optimizer, scheduler = build_optimization(
            config, policy, list(value_head.parameters()) if value_head else [],
            optimizer_steps=config.run.max_steps * alg.num_epochs * alg.mini_batches)
        eos_ids = eos_token_ids(policy, tokenizer)
        r, e = config.rollout, config.episodes
        params = SamplingParams(work.max_new_tokens, r.temperature, r.top_p, r.top_k)
        seed = config.run.seed + distributed.rank()
        tools = with_mcp_tools(config, (*inputs.tools, *(load_reward_function(spec, "tool") for spec in e.tools),
                                        *work.tools))  # starts the --mcp-server servers
        on_error = "raise" if e.tool_errors == "error" else "feedback"

        def generator_of(model: Any) -> Any:
            if tools or work.environment:
                return make_episode_generator(
                    r.backend, model, tokenizer, params, eos_ids,
                    Tools(tools, timeout=first_given(e.tool_timeout, work.tool_timeout, 10.0), on_error=on_error)
                    if tools else None,
                    tool_format(first_given(e.tool_format, work.tool_format, "auto"), tokenizer) if tools else None,
                    max_turns=e.max_turns, seed=seed, environment=work.environment, on_error=on_error)
            if r.rollout_server:
                from pathlib import Path

                from posttrain.rollout.remote import CollectiveWeights, FilesystemWeights, RemoteGenerator

                if r.weight_transport == "filesystem":
                    transport: Any = FilesystemWeights(Path(r.weight_sync_dir or Path(config.run.output) / "weights"))
                else:
                    host, _, port = r.weight_sync_address.partition(":")
                    transport = CollectiveWeights(r.weight_transport, host, int(port or 0))
                return RemoteGenerator(model, tokenizer, params, eos_ids, list(r.rollout_server), transport,
                                       timeout_s=r.rollout_timeout)
            return make_generator(r.backend, model, tokenizer, params, eos_ids,
                                  model_path=policy.config.name_or_path, seed=seed,
                                  record_routing=config.off_policy.routing_replay)

        # sampler_noise/_dtype: a copy samples the rollouts (refresh_sampler); evaluation samples the policy
        sampling_copy = None
        if config.off_policy.sampling_copy:
            sampling_copy = copy.deepcopy(policy).requires_grad_(False)
            if config.off_policy.sampler_dtype:
                sampling_copy.to(getattr(torch, config.off_policy.sampler_dtype))
        generator = generator_of(sampling_copy if sampling_copy is not None else policy)
        episodes = generator if isinstance(generator, EpisodeGenerator) else None
        work, prompt_ids = _within_budget(config, work, [
            encode_prompt(tokenizer, row["prompt"], f"training prompts: row {number}", tools=tools)
            for number, row in enumerate(work.train_rows, start=1)])
        separate = (sampling_copy is not None or config.off_policy.async_rollout or r.backend == "vllm"
                    or bool(r.rollout_server))
        sync_check = SyncCheck.of(prompt_ids[0], policy, sampling_copy, generator, config.model.mixed_precision,
                                  separate and not config.off_policy.sampler_noise)  # noise: different on purpose
        if sync_check is not None and r.rollout_server:  # a server may hold bf16 weights (posttrain serve --dtype)
            sync_check.tolerance = max(sync_check.tolerance, BF16_WEIGHTS_TOLERANCE)
        return cls(
            config, alg, work, policy, tokenizer, ref, value_head, optimizer, scheduler, generator, prompt_ids,
            PromptSampler(len(work.train_rows), config.run.seed, alg.history_resampling),
            eos_ids,
            fingerprint=fingerprint(name, alg.name, policy),
            eval_workloads=eval_workloads,
            episodes=episodes,
            tools=tools,
            sampling_copy=sampling_copy,
            teacher=teacher,
            eval_generator=None if sampling_copy is None else generator_of(policy),
            rollouts=AsyncRollouts(config.off_policy.max_staleness, config.off_policy.rollout_threads)
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
        """Stop the rollout process and the MCP servers, if any."""
        self.rollouts.close()
        stop_mcp_servers(self.tools)

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
                                        [encode_prompt(s.tokenizer, r["prompt"], tools=s.tools) for r in rows],
                                        greedy=True, rows=rows)
    scores, correct = score_texts(work, s.config.data, rows, texts, 1, completions.rewards)
    out = {f"{prefix}reward": scores.total.mean().item(),
           f"{prefix}completion_length": completions.lengths.float().mean().item()}
    if correct is not None:
        out[f"{prefix}accuracy"] = correct.float().mean().item()
        out[f"{prefix}accuracy_low"], out[f"{prefix}accuracy_high"] = wilson_interval(int(correct.sum()), len(correct))
    check = s.config.run.divergence_check  # a reward function the user named as the check: its own mean
    if check in scores.terms:
        out[f"{prefix}reward/{check}"] = scores.terms[check].nanmean().item()
    return out
