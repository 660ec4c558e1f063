"""Supervised fine-tuning (SFT): the next-token NLL of demonstrations, the first stage of RLHF.

One optimizer step (``train_step``), top to bottom:

1. take the next ``pairs_per_step`` demonstrations of a shuffled, resumable order; the step's
   normaliser is their trained-token count (``posttrain.data.sft``: completion or assistant tokens
   with ``completion_only_loss``, else every token but the first);
2. place them into rows: packed, several to a row of at most ``max_length`` positions with position ids
   restarting per example (attention stays within each), or one per row, right-padded
   (``packing``; ``posttrain.data.sft.arrange``);
3. per micro-batch of ``micro_batch_size`` rows (or of examples up to ``max_tokens_per_micro_batch``
   tokens): one forward pass, the log-prob of each trained token (the LM head folded into the
   log-softmax for the architectures ``modeling.split_head`` knows, so no ``[R, W, V]`` logits
   exist), the summed NLL divided by the step's normaliser
   (``F.nll_loss``), backward: the micro-batches' gradients add up to the whole step's token mean,
   however the step is cut into rows and micro-batches;
4. one guarded optimizer step (``posttrain.training.optim``: a non-finite gradient is skipped);
5. log ``loss`` (= ``nll``, the step's mean NLL per trained token), ``tokens``, ``grad_norm``, ``lr``.

GKD (``objective: gkd``, Agarwal et al. 2024) runs the same step with two changes: at a
``student_fraction`` of the steps (drawn from the seed and the step, so a resumed run draws the same)
the demonstrations' completions are replaced by the student's own samples of their prompts, and the
loss is the generalised JSD to the ``--teacher``'s next-token distribution over the vocabulary
(``F.generalized_jsd``) at every trained position instead of the NLL. Both models' logits over the
vocabulary are computed for the step's rows (the LM head is not folded in), at the rollout's temperature.

``evaluate``: ``eval/nll`` (per trained token) and ``eval/perplexity`` on the held-out demonstrations
(``--eval-dataset``, or a built-in task's held-out prompts with their solutions) and, for a built-in
task, greedy generation accuracy on its held-out prompts with its Wilson interval.

Departures and decisions:

1. The loss is a mean over the step's trained tokens (TRL's default), not over examples: a long
   demonstration weighs more than a short one.
2. The policy runs in eval mode (no dropout), as in the preference trainer.
3. ``micro_batch_size`` counts rows: examples without packing, packed rows with it.
4. Packing is per optimizer step (TRL packs the whole dataset once): a step trains on exactly its
   ``pairs_per_step`` examples whether packed or not, so packing changes no step's loss or gradient
   (to float32 rounding, tested) and resuming needs only the data order. With transformers' SDPA
   attention (the default; ``trim_padding``) a micro-batch's examples run as one row without padding,
   one causal attention call each (``posttrain.models.packing``): rows only decide which examples
   share a micro-batch. With another attention, transformers' block mask of each row's examples, which
   needs a model class whose masks follow restarting position ids (``architecture.SUPPORTED``). A model
   that packing would not keep exact (:func:`packing_unsupported_reason`) gets one example per row, said so.
5. An example with no trained token left (a prompt longer than ``max_length``) is dropped, and said so.
6. With ``W`` processes the step's examples are split over them by length, near-equal tokens each
   (``distributed.balanced_shard``: Karmarkar-Karp), so no process waits on another's longer share;
   every process divides by the whole step's token count and the gradients are summed: the update
   of one process.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor, nn

import posttrain.functional as F
from posttrain.algorithms.presets import SupervisedAlgorithm
from posttrain.config import Config, ConfigError
from posttrain.data.prompts import PromptSampler, encode_prompt, hub_splits
from posttrain.data.rewards import load_reward_function
from posttrain.data.sft import (
    SFTExamples,
    TokenRows,
    arrange,
    encode,
    layout,
    load_rows,
)
from posttrain.data.tasks.task import Task
from posttrain.models.architecture import family, is_supported_class, row_state_reason
from posttrain.models.batching import token_budget_micro_batches
from posttrain.models.modeling import split_head, unwrapped
from posttrain.models.vision import PER_TOKEN, batch_image_inputs, generated_token_type, is_vision_model
from posttrain.models.packing import (
    has_packed_attention,
    packed_forward,
    sequences_layout,
)
from posttrain.parallel import distributed, fsdp, offload
from posttrain.parallel.distributed import say as _say
from posttrain.rollout.completions import Generator, SamplingParams
from posttrain.rollout.episodes import Tools, make_episode_generator, tool_format
from posttrain.rollout.mcp_tools import stop_mcp_servers, with_mcp_tools
from posttrain.rollout.generators import generate_texts, make_generator
from posttrain.training.guards import UpdateCheck
from posttrain.training.optim import apply_gradients
from posttrain.training.session import eos_token_ids, first_given
from posttrain.training.setup import (
    Inputs,
    ResumableSession,
    build_optimization,
    fingerprint,
    greedy_accuracy,
    load_policy,
    load_teacher,
    model_name,
    start_processes,
)


@dataclass
class SFTSession(ResumableSession):
    config: Config
    preset: SupervisedAlgorithm
    policy: Any
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    train: SFTExamples
    test: SFTExamples | None  # held-out demonstrations: eval/nll
    task: Task | None  # built-in task: held-out generation accuracy
    generator: Generator | None
    sampler: PromptSampler
    step: int = 0
    bad_steps: int = 0
    fingerprint: dict[str, Any] = field(default_factory=dict)
    last_nll: list[tuple[int, float, int]] = field(default_factory=list)  # last step: (example, summed NLL, tokens)
    update_check: UpdateCheck = field(init=False)  # an optimizer step that moves no weight is an error
    teacher: Any = None  # GKD's frozen teacher
    last_data: SFTExamples | None = None  # the examples the last step trained on (GKD: maybe the student's samples)
    tools: tuple[Callable, ...] = ()  # rendered into chat prompts as the online trainer renders them; held-out episodes call them

    def __post_init__(self) -> None:
        self.update_check = UpdateCheck(self.policy, lora=bool(self.config.model.lora_r))

    @classmethod
    def create(cls, config: Config, inputs: Inputs = Inputs()) -> "SFTSession":
        preset = config.preset()
        reject_unused(config, preset, inputs)
        data, pc = config.data, config.preference
        train_rows, test_rows, task = load_rows(data.dataset, data.eval_dataset, data.task,
                                                completion_only_loss=preset.completion_only_loss, hub=hub_splits(data))
        test_rows = test_rows[:data.eval_size]
        if task is not None:
            _say(f"task {data.task}: {task.description} ({len(train_rows)} demonstrations, {len(test_rows)} held out)")
        start_processes(config, needs_reference=False, name=preset.name)
        name = model_name(config, task.default_model if task else None, inputs)
        policy, tokenizer, _ = load_policy(config, name, inputs, needs_reference=False,
                                           train_mode=False)  # no dropout (decision 2)
        teacher = load_teacher(config, name, tokenizer, preset.objective == "gkd", preset.name)
        unpackable = packing_unsupported_reason(policy, pc.packing)
        if unpackable:
            _say(f"packing: off for {family(policy)}: {unpackable}; one example per row")
            config = dataclasses.replace(config, preference=dataclasses.replace(pc, packing=False))
            pc = config.preference
        e = config.episodes
        tools = with_mcp_tools(config, (*inputs.tools, *(load_reward_function(spec, "tool") for spec in e.tools),
                                        *(task.tools if task else ())))  # starts the --mcp-server servers
        if tools and preset.objective == "gkd":
            raise ConfigError("tools: gkd's student samples single turns; distil tool use from demonstrations "
                              "with sft, or on-policy with the online preset opd")
        encoded = dict(completion_only_loss=preset.completion_only_loss, max_length=pc.max_length, tools=tools)
        train = usable(encode(train_rows, tokenizer, source=data.dataset or f"task {data.task}", **encoded), "training")
        test = usable(encode(test_rows, tokenizer, source=data.eval_dataset or f"task {data.task} (held-out)",
                             **encoded), "held-out") if test_rows else None
        validate(config, len(train))
        _say(f"{int(train.truncated.sum())} of {len(train)} training examples truncated (max_length {pc.max_length}); "
             f"{int(train.loss_tokens.sum())} trained tokens")
        policy, optimizer, scheduler = build_optimization(config, policy, [], optimizer_steps=config.run.max_steps)
        generator = None
        if task is not None or teacher is not None:  # held-out accuracy; GKD's student samples
            r = config.rollout
            budget = r.max_new_tokens or (task.max_new_tokens if task else 128)
            sampling = SamplingParams(budget, r.temperature, r.top_p, r.top_k)
            generator = make_generator("hf", policy, tokenizer, sampling, eos_token_ids(policy, tokenizer))
            if tools:  # held-out accuracy as the online trainer measures it: episodes that call the tools
                generator = make_episode_generator(
                    "hf", policy, tokenizer, sampling, eos_token_ids(policy, tokenizer),
                    Tools(tools, timeout=first_given(e.tool_timeout, task.tool_timeout if task else None, 10.0)),
                    tool_format(first_given(e.tool_format, task.tool_format if task else None, "auto"), tokenizer),
                    max_turns=e.max_turns)
        return cls(config, preset, policy, tokenizer, optimizer, scheduler, train, test, task, generator,
                   PromptSampler(len(train), config.run.seed), fingerprint=fingerprint(name, preset.name, policy),
                   teacher=teacher, tools=tools)

    # -- the runner's protocol -----------------------------------------------------------------

    def close(self) -> None:
        stop_mcp_servers(self.tools)  # what runs beside the trainer: the --mcp-server servers, if any

    def sample_rows(self, limit: int = 16) -> list[dict[str, Any]]:
        """The last step's first examples with their NLL (GKD: JSD) per trained token, for samples.jsonl."""
        data, key = self.last_data or self.train, "jsd" if self.teacher is not None else "nll"
        return [{**data.rows[i], key: total / max(tokens, 1), "tokens": tokens}
                for i, total, tokens in self.last_nll[:limit]]


def reject_unused(config: Config, preset: Any, inputs: Inputs) -> None:
    """Settings SFT would silently ignore are errors that say what to change."""
    if not (isinstance(preset, SupervisedAlgorithm) and preset.objective in ("sft", "gkd")):
        raise ConfigError(f"algorithm: {preset.name} is not an SFT preset; the SFT trainer runs sft and gkd")
    if preset.objective == "gkd" and config.preference.packing:
        raise ConfigError("packing: gkd compares two models' logits row by row; set --no-packing")
    if config.episodes.environment:
        raise ConfigError("environment: SFT trains on given demonstrations; environments are played by online "
                          "presets (grpo, rloo, ...)")
    if inputs.agent is not None or config.episodes.agent:
        raise ConfigError("agent: SFT trains on given demonstrations; an agent's episodes are online rollouts "
                          "(grpo, rloo, ...)")
    if inputs.reward_funcs or config.data.reward or config.data.reward_url:
        raise ConfigError("reward: SFT learns from demonstrations, not rewards; an online preset (grpo, rloo, ...) "
                          "takes reward functions")
    if config.data.eval_tasks:
        raise ConfigError("eval_tasks: only the online trainer scores other tasks during a run; score the SFT run's "
                          "final_model/ with posttrain eval --task ...")
    if config.preference.pairs_from == "policy" or config.preference.precompute_reference:
        raise ConfigError("pairs_from: SFT trains on --dataset's demonstrations (or a task's); pairs_from policy and "
                          "precompute_reference belong to the preference presets")
    if config.optim.ref_refresh_every:
        raise ConfigError("ref_refresh_every: SFT has no reference model; set it to 0")


def validate(config: Config, num_examples: int) -> None:
    """Reject a step size the data or the processes cannot give; say what to change."""
    per_step, world = config.preference.pairs_per_step, distributed.world_size()
    if per_step > num_examples:
        raise ConfigError(f"pairs_per_step: {per_step} is more than the {num_examples} training demonstrations; "
                          f"use --pairs-per-step {num_examples} or fewer")
    if per_step % world:
        raise ConfigError(f"pairs_per_step: {per_step} examples do not split evenly over {world} processes; "
                          f"use a multiple of {world}")


def usable(data: SFTExamples, which: str) -> SFTExamples:
    """``data`` without the examples that have no trained token left after truncation (decision 5)."""
    keep = [i for i, n in enumerate(data.loss_tokens.tolist()) if n > 0]
    if not keep:
        raise ConfigError(f"max_length: none of the {len(data)} {which} examples keeps a trained token within "
                          "max_length tokens; raise max_length")
    if len(keep) < len(data):
        _say(f"{len(data) - len(keep)} of {len(data)} {which} examples have no trained token within max_length "
             "and are left out")
    return data.subset(keep)


def packing_unsupported_reason(model: nn.Module, packing: bool) -> str | None:
    """Why several examples in one row would not each be the model's own forward over it alone (None: they
    would, or ``packing`` is off): layers that carry state along the row, or an attention that neither the
    packed attention nor transformers' block mask keeps within each example."""
    if not packing:
        return None
    if is_vision_model(model):
        return "a vision-language model's examples each run through its own forward with their images"
    base = unwrapped(model)
    reason = row_state_reason(base.config)
    if reason is None and not has_packed_attention(base) and not is_supported_class(base):
        reason = f"its attention ({base.config._attn_implementation}) is not one posttrain keeps within each example"
    return reason


# ---------------------------------------------------------------------------------------
# Log-probs of packed rows
# ---------------------------------------------------------------------------------------


def token_logprobs(model: nn.Module, batch: TokenRows) -> Tensor:
    """[R, W] log p(target | the position's example up to it), 0 where the target is not trained on.

    With the packed attention (``posttrain.models.packing``; the default, ``trim_padding``) the batch's
    examples run as one row without padding, one causal attention call each. Otherwise no attention mask
    is passed: transformers builds the causal mask of each packed example (and of the padding) from the
    restarting position ids."""
    mask_RW = batch.loss_mask
    parts = split_head(model)
    stack = parts[0] if parts is not None else model
    if batch.images is not None:  # a vision-language model: one example per row, its images with it
        out, trained = image_forward(model, batch), mask_RW
    elif has_packed_attention(stack):
        real_RW = batch.example >= 0
        lengths = torch.bincount(batch.example[real_RW], minlength=len(batch.examples)).tolist()
        layout = sequences_layout(lengths).to(batch.input_ids.device)
        out = packed_forward(stack, batch.input_ids[real_RW][None], batch.position_ids[real_RW][None], layout)
        trained = mask_RW[real_RW]  # [S]: the packed row's positions in the rows' order
    else:
        out = stack(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False)
        trained = mask_RW
    if parts is not None:
        hidden_MD = out.last_hidden_state.flatten(0, 1)[trained.flatten()]
        logp_M, _ = F.linear_log_softmax(hidden_MD.to(parts[1].weight.dtype), parts[1].weight,
                                         batch.targets[mask_RW], bias=parts[1].bias)
    else:
        logits_MV = out.logits.flatten(0, 1)[trained.flatten()]
        logp_M = F.selective_log_softmax(logits_MV[None], batch.targets[mask_RW][None])[0]
    return logp_M.new_zeros(mask_RW.shape).masked_scatter(mask_RW, logp_M)


def image_forward(model: nn.Module, batch: TokenRows) -> Any:
    """A vision-language model's own forward over right-padded rows of one example each, with their images
    (its own position ids: a Qwen-VL's rope reads the image grid)."""
    real_RW = batch.example >= 0
    prompt_lengths = [next((v.shape[1] for k, v in row.items() if k in PER_TOKEN), 0) for row in batch.images]
    width = batch.input_ids.shape[1]
    images = batch_image_inputs(batch.images, prompt_lengths, width, width, right_padded=True,
                                completion_type=generated_token_type(model))
    dtype = next(p.dtype for p in unwrapped(model).parameters() if p.is_floating_point())
    images = {k: v.to(batch.input_ids.device, dtype) if v.is_floating_point() else v.to(batch.input_ids.device)
              for k, v in images.items()}
    return model(input_ids=batch.input_ids, attention_mask=real_RW.long(), use_cache=False, **images)


def per_example(batch: TokenRows, values_RW: Tensor) -> Tensor:
    """[n] the sum of ``values_RW`` over each of the batch's examples' positions (n = len(batch.examples))."""
    mine = batch.example >= 0
    return values_RW.new_zeros(len(batch.examples)).index_add_(0, batch.example[mine], values_RW[mine])


def micro_batches(s: SFTSession, data: SFTExamples, idx: list[int]) -> list[list[list[int]]]:
    """The rows of examples ``idx`` (packed or one each) of each micro-batch: ``micro_batch_size`` rows at a
    time, or (``max_tokens_per_micro_batch``) the examples placed by length, best-fit decreasing, into
    micro-batches of at most that many tokens, then arranged into rows."""
    pc, budget = s.config.preference, s.config.optim.max_tokens_per_micro_batch
    if budget is not None:
        items = [([i], len(data.input_ids[i]) - 1) for i in idx]
        return [arrange(data, part, packing=pc.packing, max_length=pc.max_length)
                for part in token_budget_micro_batches(items, budget)]
    rows = arrange(data, idx, packing=pc.packing, max_length=pc.max_length)
    m = s.config.optim.micro_batch_size
    return [rows[start:start + m] for start in range(0, len(rows), m)]


@torch.no_grad()
def example_logps(s: SFTSession, data: SFTExamples, idx: list[int]) -> tuple[Tensor, Tensor]:
    """Summed log-probs of the trained tokens of examples ``idx`` and their counts, on the CPU: ([n], [n])."""
    totals, order = [], []
    for rows in micro_batches(s, data, idx):
        batch = layout(data, rows, s.tokenizer.pad_token_id).to(s.policy.device)
        totals.append(per_example(batch, token_logprobs(s.policy, batch)).cpu())
        order += batch.examples
    position = {i: k for k, i in enumerate(order)}
    summed = torch.cat(totals)[[position[i] for i in idx]]
    return summed, data.loss_tokens[idx]


# ---------------------------------------------------------------------------------------
# The step
# ---------------------------------------------------------------------------------------


def train_micro_batch(s: SFTSession, data: SFTExamples, rows: list[list[int]],
                      normalizer: int) -> tuple[Tensor, TokenRows, Tensor]:
    """One forward pass over ``rows``, the loss (divided by the step's trained tokens), backward. Returns the
    detached loss, the batch, and its examples' summed NLL [n] (GKD: their summed JSD)."""
    batch = layout(data, rows, s.tokenizer.pad_token_id).to(s.policy.device)
    if s.teacher is not None:
        per_token_RW = jsd_to_teacher(s, batch)
        loss = per_token_RW.sum() / max(normalizer, 1)
        loss.backward()
        return loss.detach(), batch, per_example(batch, per_token_RW.detach())
    logp_RW = token_logprobs(s.policy, batch)
    loss, _ = F.nll_loss(logp_RW, batch.loss_mask, aggregation="token_mean", normalizer=normalizer)
    loss.backward()  # sum_i,t -logp / (the step's tokens): the micro-batches add up to the step's mean
    return loss.detach(), batch, -per_example(batch, logp_RW.detach())


def jsd_to_teacher(s: SFTSession, batch: TokenRows) -> Tensor:
    """[R, W] GKD's generalised JSD between the teacher's and the student's next-token distributions at each
    trained position, 0 elsewhere."""
    mask_RW = batch.loss_mask
    if batch.images is not None:
        raise ConfigError("gkd: distilling on rows with images is not built (the teacher's forward would need the "
                          "images too); train the vision-language student with sft, or distill on text rows")
    student = s.policy(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits[mask_RW]
    with torch.no_grad(), offload.resident(s.teacher):
        teacher = s.teacher(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits[mask_RW]
    jsd_M = F.generalized_jsd(student, teacher, beta=s.preset.jsd_beta, temperature=s.config.rollout.temperature)
    return jsd_M.new_zeros(mask_RW.shape).masked_scatter(mask_RW, jsd_M)


def on_policy(s: SFTSession) -> bool:
    """GKD: whether this step trains on the student's samples, drawn from (seed, step) so a resume draws the same."""
    if s.teacher is None or not s.preset.student_fraction:
        return False
    draw = torch.rand((), generator=torch.Generator().manual_seed(s.config.run.seed * 1_000_003 + s.step))
    return bool(draw < s.preset.student_fraction)


def student_samples(s: SFTSession, idx: list[int]) -> tuple[SFTExamples, list[int]]:
    """The examples ``idx`` with their completions replaced by the student's samples of their prompts."""
    rows = [s.train.rows[i] for i in idx]
    if any("prompt" not in row or "completion" not in row for row in rows):
        raise ConfigError("student_fraction: gkd samples the student on each example's prompt, which needs prompt + "
                          "completion data; set --student-fraction 0 for messages or text data")
    prompts = [encode_prompt(s.tokenizer, row["prompt"]) for row in rows]
    texts, _ = generate_texts(s.generator, s.tokenizer, prompts, greedy=False)
    sampled = [{**row, "completion": text} for row, text in zip(rows, texts)]
    data = encode(sampled, s.tokenizer, completion_only_loss=True, max_length=s.config.preference.max_length,
                  source="the student's samples")
    return data, list(range(len(idx)))


def train_step(s: SFTSession) -> dict[str, float]:
    """One optimizer step of the NLL of ``pairs_per_step`` demonstrations."""
    idx = s.sampler.next(s.config.preference.pairs_per_step)  # the whole step's, the same on every process
    mine, _ = distributed.balanced_shard(idx, [len(s.train.input_ids[i]) - 1 for i in idx])
    data, sampled = s.train, on_policy(s)
    if sampled:  # GKD: the student's own samples of this process's prompts
        data, mine = student_samples(s, mine)
    tokens = int(distributed.all_sum(data.loss_tokens[mine].sum()))  # the step's normaliser, on every process
    lr = s.scheduler.get_last_lr()[0]  # this step's; apply_gradients moves the scheduler on
    parts = micro_batches(s, data, mine)
    loss = torch.zeros((), device=s.policy.device)
    s.last_nll, s.last_data = [], data
    with fsdp.full_parameters(s.policy):  # FSDP: gathered once for the step's passes
        for k, rows in enumerate(parts):
            fsdp.sync_gradients(s.policy, k == len(parts) - 1)  # FSDP reduces at the last backward
            part_loss, batch, nll_n = train_micro_batch(s, data, rows, tokens)
            loss += part_loss
            s.last_nll += [(i, float(v), int(data.loss_tokens[i])) for i, v in zip(batch.examples, nll_n)]
    before = s.update_check.before_step()
    grad_norm, s.bad_steps = apply_gradients(s.optimizer, s.scheduler, s.config.optim, s.bad_steps)
    s.update_check.after_step(before, grad_norm, lr)
    nll = float(distributed.all_sum(loss))  # every process's share of the step's mean
    gkd = {"jsd": nll, "on_policy": float(sampled)} if s.teacher is not None else {"nll": nll}
    return {
        "loss": nll,
        **gkd,
        "tokens": float(tokens),
        "grad_norm": grad_norm,
        "skipped_steps": float(not math.isfinite(grad_norm)),
        "lr": lr,
        "data/truncated": float(distributed.all_sum(data.truncated[mine].sum())),
    }


# ---------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(s: SFTSession, limit: int | None = None) -> dict[str, float]:
    """Held-out NLL per trained token and perplexity; generation accuracy on the first ``limit`` (None: all)
    of the task's ``eval_size`` held-out prompts."""
    out: dict[str, float] = {}
    if s.test is not None:
        summed, counts = example_logps(s, s.test, list(range(len(s.test))))
        nll = -float(summed.sum()) / int(counts.sum())
        out["eval/nll"], out["eval/perplexity"] = nll, math.exp(nll)
    if s.task is not None and s.config.data.eval_size:
        rows = s.task.test[:s.config.data.eval_size][:limit]
        out.update(greedy_accuracy(s.generator, s.tokenizer, s.task.correct, rows, s.tools))
    return out
