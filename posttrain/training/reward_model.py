"""A Bradley-Terry reward model: the ``reward_model`` preset, the second stage of RLHF.

A scalar head on a language model is trained so that a pair's chosen completion scores above its
rejected one (InstructGPT, arXiv:2203.02155, eq. (1); ``posttrain.functional.bradley_terry_loss``).
The saved ``final_model/`` is a plain ``AutoModelForSequenceClassification`` (``num_labels=1``) that
:class:`posttrain.data.rewards.RewardModel` loads to score completions for an online preset.

One optimizer step (``train_step``), top to bottom:

1. take the next ``pairs_per_step`` pairs of a shuffled, resumable order;
2. per micro-batch (``micro_batch_size`` sequences, or pairs up to ``max_tokens_per_micro_batch``
   tokens): ONE forward pass over the pairs' chosen texts then their rejected texts gives each a
   score (``posttrain.models.reward_head.sequence_scores``: one packed row without padding, by
   default); the Bradley-Terry loss with the
   pairs' ``margin`` column and the preset's ``center_rewards_coefficient``, scaled by the
   micro-batch's share of the step's pairs, is back-propagated: every term of the loss is a mean
   over pairs, so the accumulated gradient is the whole batch's whatever the micro-batch size;
3. one guarded optimizer step (``posttrain.training.optim``: a non-finite gradient is skipped);
4. log the loss and its metrics on the whole step's detached scores.

``evaluate``: held-out pairwise accuracy (with its Wilson interval), mean score difference and mean
scores. The data are TRL's pair columns (``prompt``, ``chosen``, ``rejected``, strings or chat
messages; ``posttrain.data.preference``) or a built-in task's pairs, plus an optional ``margin``.

Decisions:

1. The model scores exactly what ``RewardModel`` scores at RL time (:func:`scored_text`): a string
   prompt followed by its completion as one string, or the chat template over the prompt's messages
   and the assistant reply; tokenized with the tokenizer's special tokens and nothing appended (no
   EOS), as ``RewardModel`` tokenizes it. A score learnt on another rendering would be read on text
   the model never saw.
2. A pair whose chosen or rejected text is longer than ``max_length`` tokens is left out (and
   counted), not truncated: cutting the end moves the token the score is read from, cutting the
   start scores a text ``RewardModel`` never sees. ``max_prompt_length`` plays no part.
3. The model runs in eval mode (no dropout, as TRL's ``disable_dropout``).
4. ``micro_batch_size`` counts sequences: a pair is two (at least one pair per pass).
5. Held-out pairwise accuracy counts a tie as half a win; its interval is Wilson's on that count.
6. With ``W`` processes the step's pairs are split over them by length, near-equal tokens each
   (``distributed.balanced_shard``: Karmarkar-Karp), each micro-batch's loss weighted by its share
   of the whole step, and the gradients are summed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from posttrain.algorithms.presets import SupervisedAlgorithm
from posttrain.config import Config, ConfigError
from posttrain.data.preference import PAIR_COLUMNS, load_rows, pair_margins
from posttrain.data.prompts import (
    DataError,
    PromptSampler,
    hub_splits,
    is_chat,
    require_chat_template,
)
from posttrain.data.rewards import reward_model_text
from posttrain.functional import bradley_terry_loss
from posttrain.models.batching import in_item_order, item_micro_batches
from posttrain.models.compute import (
    checkpoint_layers,
    use_mixed_precision,
    use_packed_attention,
)
from posttrain.models.loading import load_model_and_tokenizer, resolve_mixed_precision
from posttrain.models.modeling import resolve_device
from posttrain.models.reward_head import (
    apply_reward_lora,
    check_reward_model,
    load_reward_model,
    sequence_scores,
)
from posttrain.parallel import distributed, fsdp
from posttrain.parallel.distributed import say as _say
from posttrain.rollout.completions import SamplingParams
from posttrain.rollout.generators import make_generator
from posttrain.tracking.stats import wilson_interval
from posttrain.training.guards import UpdateCheck
from posttrain.training.optim import apply_gradients
from posttrain.training.policy_pairs import pairs_source, sample_pairs
from posttrain.training.session import eos_token_ids
from posttrain.training.setup import (
    Inputs,
    ResumableSession,
    build_optimization,
    fingerprint,
    model_name,
    start_processes,
)

# ---------------------------------------------------------------------------------------
# Data: the texts RewardModel scores, tokenized as it tokenizes them
# ---------------------------------------------------------------------------------------


def scored_text(tokenizer: Any, prompt: Any, completion: Any, where: str = "pair") -> str:
    """The one text the reward model scores for ``(prompt, completion)``: ``RewardModel``'s rendering
    (decision 1). ``where`` names the row in a chat-template error."""
    if is_chat(prompt):
        require_chat_template(tokenizer, where)
    return reward_model_text(tokenizer, prompt, completion)


@dataclass
class ScoredPairs:
    """``N`` preference pairs as the reward model reads them: each completion's whole text, tokenized."""

    rows: list[dict[str, Any]]  # [N] the source rows kept
    chosen_ids: list[Tensor]  # [N] each [L_i]
    rejected_ids: list[Tensor]  # [N] each [L_i]
    margins: Tensor | None  # [N] how much higher the chosen must score; None: no margin column
    too_long: int = 0  # pairs of the source left out for max_length (decision 2)

    def __len__(self) -> int:
        return len(self.rows)


def encode_pairs(rows: list[dict[str, Any]], tokenizer: Any, *, max_length: int, source: str) -> ScoredPairs:
    """Checked pair rows -> their scored texts' token ids; pairs over ``max_length`` tokens left out."""
    margins = pair_margins(rows, source)
    ids = {name: tokenizer([scored_text(tokenizer, row["prompt"], row[name], f"{source}: row {number}")
                            for number, row in enumerate(rows, start=1)])["input_ids"] for name in PAIR_COLUMNS}
    keep = [i for i in range(len(rows)) if max(len(ids[name][i]) for name in PAIR_COLUMNS) <= max_length]
    if not keep:
        shortest = min(max(len(ids[name][i]) for name in PAIR_COLUMNS) for i in range(len(rows)))
        raise DataError(f"{source}: every pair is longer than max_length {max_length} tokens (the shortest pair's "
                        f"longer text has {shortest}); raise max_length")
    chosen, rejected = ([torch.tensor(ids[name][i], dtype=torch.long) for i in keep] for name in PAIR_COLUMNS)
    return ScoredPairs([rows[i] for i in keep], chosen, rejected,
                       None if margins is None else torch.tensor([margins[i] for i in keep]),
                       too_long=len(rows) - len(keep))


# ---------------------------------------------------------------------------------------
# The session
# ---------------------------------------------------------------------------------------


@dataclass
class RewardModelSession(ResumableSession):
    config: Config
    preset: SupervisedAlgorithm
    policy: nn.Module  # the reward model being trained (the runner's name for the trained model)
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    train: ScoredPairs
    test: ScoredPairs | None  # held-out pairs
    sampler: PromptSampler  # the order of the training pairs
    step: int = 0
    bad_steps: int = 0
    fingerprint: dict[str, Any] = field(default_factory=dict)
    last_batch: list[int] = field(default_factory=list)
    last_scores: Tensor | None = None  # [2, N] the last step's (chosen, rejected) scores
    update_check: UpdateCheck = field(init=False)  # an optimizer step that moves no weight is an error

    def __post_init__(self) -> None:
        self.update_check = UpdateCheck(self.policy, lora=bool(self.config.model.lora_r))

    @classmethod
    def create(cls, config: Config, inputs: Inputs = Inputs()) -> "RewardModelSession":
        preset = config.preset()
        validate(config, preset, inputs)
        data = config.data
        train_rows, test_rows, task = load_rows(data.dataset, data.eval_dataset, data.task, paired=True,
                                                needs_scores=False, hub=hub_splits(data))
        start_processes(config, needs_reference=False, name=preset.name)
        name = model_name(config, task.source.default_model if task else None, inputs)
        source = data.dataset or f"task {data.task}"
        if pairs_source(config) == "policy":
            train_rows, test_rows = policy_pairs(config, name, task)
            source = f"pairs sampled from {name}"
        policy, tokenizer = load_scorer(config, name, inputs)
        max_length = config.preference.max_length
        train = encode_pairs(train_rows, tokenizer, max_length=max_length, source=source)
        test = encode_pairs(test_rows[:data.eval_size], tokenizer, max_length=max_length,
                            source=data.eval_dataset or f"{source} (held-out)") if test_rows else None
        for what, pairs in (("training", train), ("held-out", test)):
            if pairs is not None:
                _say(f"{len(pairs)} {what} pairs ({pairs.too_long} longer than max_length {max_length} left out)")
        check_pairs_per_step(config, len(train))
        policy, optimizer, scheduler = build_optimization(config, policy, [], optimizer_steps=config.run.max_steps)
        return cls(config, preset, policy, tokenizer, optimizer, scheduler, train, test,
                   PromptSampler(len(train), config.run.seed), fingerprint=fingerprint(name, preset.name, policy))

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id

    @property
    def pairs_per_pass(self) -> int:
        """Pairs per micro-batch: ``micro_batch_size`` sequences, two per pair (decision 4)."""
        return max(1, self.config.optim.micro_batch_size // 2)

    # -- the runner's protocol -----------------------------------------------------------------

    def sample_rows(self, limit: int = 16) -> list[dict[str, Any]]:
        """The last step's first pairs with their scores, for samples.jsonl."""
        if self.last_scores is None:
            return []
        chosen, rejected = self.last_scores.tolist()
        return [{**self.train.rows[i], "reward_chosen": c, "reward_rejected": r}
                for i, c, r in zip(self.last_batch[:limit], chosen, rejected)]


def policy_pairs(config: Config, name: str, task: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training, held-out) pairs of the starting model's own samples on the built-in task's training and
    held-out prompts (``posttrain.training.policy_pairs``): enough training prompts, in a seeded order, for
    ``max_steps x pairs_per_step`` pairs (or all of them), and every held-out prompt. The causal model that
    samples them is freed before the reward model loads."""
    r, m = config.rollout, config.model
    sampler_model, tokenizer = load_model_and_tokenizer(name, dtype=m.dtype, device=m.device,
                                                        mixed_precision=m.mixed_precision)
    sampling = SamplingParams(r.max_new_tokens or task.source.max_new_tokens, r.temperature, r.top_p, r.top_k)
    generator = make_generator("hf", sampler_model, tokenizer, sampling, eos_token_ids(sampler_model, tokenizer))
    order = PromptSampler(len(task.source.train), config.run.seed).next(len(task.source.train))
    wanted = config.run.max_steps * config.preference.pairs_per_step
    train, metrics = sample_pairs(generator, tokenizer, task.source, [task.source.train[i] for i in order],
                                  r.group_size, chunk=r.prompts_per_step * config.preference.resample_every,
                                  wanted=wanted)
    _say(f"sampled {len(train)} training pairs from {name}: {r.group_size} completions per prompt, sample accuracy "
         f"{metrics['pairs/sample_accuracy']:.3f}, {metrics['pairs/prompts_with_a_pair']:.0%} of prompts with a pair")
    test, _ = sample_pairs(generator, tokenizer, task.source, task.source.test, r.group_size,
                           chunk=r.prompts_per_step * config.preference.resample_every)
    return train, test


def validate(config: Config, preset: Any, inputs: Inputs) -> None:
    """Reject what the reward-model trainer does not do before any model is loaded; say what to change."""
    if not (isinstance(preset, SupervisedAlgorithm) and preset.objective == "reward_model"):
        raise ConfigError(f"algorithm: {preset.name} is not a reward-model preset; the reward-model trainer runs "
                          "presets with objective reward_model")
    if pairs_source(config) == "policy" and (config.data.dataset or inputs.model is not None):
        raise ConfigError("pairs_from: the reward model samples pairs from a built-in task's model by name; with "
                          "--dataset or a model object, give the pairs and set pairs_from dataset")
    if pairs_source(config) == "policy" and distributed.world_size() > 1:
        raise ConfigError("pairs_from: pairs of the starting model's samples are drawn in one process; run it "
                          "without torchrun/accelerate, or give the pairs (--dataset) or the task's fixed ones "
                          "(pairs_from dataset)")
    if inputs.reward_funcs or config.data.reward or config.data.reward_model or config.data.reward_url:
        raise ConfigError("reward: a reward model learns from chosen/rejected pairs, not from rewards; drop --reward, "
                          "--reward-url and --reward-model (an online preset takes the trained final_model/ as "
                          "--reward-model)")
    if inputs.tools or config.episodes.tools or config.episodes.mcp_server or inputs.agent or config.episodes.agent:
        raise ConfigError("tools: a reward model scores given pairs; tools, MCP servers and agents belong to online "
                          "presets' episodes")
    if config.data.eval_tasks:
        raise ConfigError("eval_tasks: a reward model is evaluated on held-out pairs (--eval-dataset or the task's "
                          "held-out split); drop eval_tasks")


def check_pairs_per_step(config: Config, num_pairs: int) -> None:
    """A step's pairs must exist and split evenly over the processes."""
    per_step, world = config.preference.pairs_per_step, distributed.world_size()
    if per_step > num_pairs:
        raise ConfigError(f"pairs_per_step: {per_step} is more than the {num_pairs} training pairs; use "
                          f"--pairs-per-step {num_pairs} or fewer")
    if per_step % world:
        raise ConfigError(f"pairs_per_step: {per_step} pairs do not split evenly over {world} processes; "
                          f"use a multiple of {world}")


def load_scorer(config: Config, name: str, inputs: Inputs) -> tuple[nn.Module, Any]:
    """(reward model, tokenizer): loaded from ``name`` with a fresh score head, or the caller's objects;
    LoRA adapters, eval mode (decision 3), then activation checkpointing."""
    m = config.model
    if inputs.model is not None:
        if inputs.tokenizer is None:
            raise ConfigError("tokenizer: a model object needs its tokenizer (posttrain.train(model, tokenizer=...))")
        model, tokenizer = inputs.model.to(resolve_device(m.device)), inputs.tokenizer
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        check_reward_model(model, tokenizer)
        if resolve_mixed_precision(m.mixed_precision, m.dtype, resolve_device(m.device)) == "bf16":
            use_mixed_precision(model)
    else:
        model, tokenizer = load_reward_model(name, dtype=m.dtype, device=m.device, mixed_precision=m.mixed_precision)
    if config.optim.trim_padding:  # pairs scored in packed passes where the attention allows (models.packing)
        use_packed_attention(model)
    if m.lora_r:
        model = apply_reward_lora(model, m)
    model.train(False)
    if m.gradient_checkpointing:
        checkpoint_layers(model)
    return model, tokenizer


# ---------------------------------------------------------------------------------------
# Scores and the step
# ---------------------------------------------------------------------------------------


def pair_scores(model: nn.Module, pairs: ScoredPairs, idx: list[int], pad_id: int) -> Tensor:
    """[2, n] the (chosen, rejected) scores of pairs ``idx``, from one forward pass over the 2n texts."""
    sequences = [pairs.chosen_ids[i] for i in idx] + [pairs.rejected_ids[i] for i in idx]
    return sequence_scores(model, sequences, pad_id).view(2, len(idx))


@torch.no_grad()
def leading_pair_scores(model: nn.Module, pairs: ScoredPairs, count: int, pad_id: int, pairs_per_pass: int) -> Tensor:
    """[2, count] the scores of the first ``count`` pairs, ``pairs_per_pass`` pairs per forward pass, on the CPU."""
    parts = [pair_scores(model, pairs, list(range(start, min(start + pairs_per_pass, count))), pad_id).cpu()
             for start in range(0, count, pairs_per_pass)]
    return torch.cat(parts, dim=1)


def step_loss(s: RewardModelSession, scores_2n: Tensor, idx: list[int]) -> tuple[Tensor, dict[str, Tensor]]:
    """The Bradley-Terry loss of pairs ``idx`` from their [2, n] scores, with their margins and the preset's
    centring."""
    margin = None if s.train.margins is None else s.train.margins[idx].to(scores_2n.device)
    return bradley_terry_loss(scores_2n[0], scores_2n[1], margin=margin,
                              center_coefficient=s.preset.center_rewards_coefficient or 0.0)


def train_micro_batch(s: RewardModelSession, idx: list[int], share: float) -> Tensor:
    """One forward pass over pairs ``idx``, the loss, backward; returns the detached [2, n] scores."""
    scores_2n = pair_scores(s.policy, s.train, idx, s.pad_id)
    loss, _ = step_loss(s, scores_2n, idx)
    (loss * share).backward()  # a mean over n pairs, weighted n / N: the step's mean over N
    return scores_2n.detach()


def train_step(s: RewardModelSession) -> dict[str, float]:
    """One optimizer step of the Bradley-Terry loss over ``pairs_per_step`` pairs."""
    idx = s.sampler.next(s.config.preference.pairs_per_step)  # the whole step's, the same on every process
    lr = s.scheduler.get_last_lr()[0]  # this step's; apply_gradients moves the scheduler on
    tokens = {i: len(s.train.chosen_ids[i]) + len(s.train.rejected_ids[i]) for i in idx}
    mine, in_step_order = distributed.balanced_shard(idx, [tokens[i] for i in idx])  # near-equal tokens each
    micros = item_micro_batches([tokens[i] for i in mine], per_pass=s.pairs_per_pass,
                                budget=s.config.optim.max_tokens_per_micro_batch)
    with fsdp.full_parameters(s.policy):  # FSDP: gathered once for the step's passes
        parts = []
        for k, micro in enumerate(micros):
            fsdp.sync_gradients(s.policy, k == len(micros) - 1)  # FSDP reduces at the last backward
            parts.append(train_micro_batch(s, [mine[j] for j in micro], len(micro) / len(idx)))
    before = s.update_check.before_step()
    grad_norm, s.bad_steps = apply_gradients(s.optimizer, s.scheduler, s.config.optim, s.bad_steps)
    s.update_check.after_step(before, grad_norm, lr)
    scores_n2 = torch.cat(parts, dim=1).T[in_item_order(micros)]  # this process's, in the order of mine
    scores_2N = distributed.gather_rows(scores_n2)[in_step_order].T  # every process's, in the order of idx
    with torch.no_grad():
        loss, metrics = step_loss(s, scores_2N, idx)  # the step's loss, from its scores
    s.last_batch, s.last_scores = idx, scores_2N.cpu()
    return {
        "loss": float(loss),
        **{name: float(value) for name, value in metrics.items()},
        "grad_norm": grad_norm,
        "skipped_steps": float(not math.isfinite(grad_norm)),
        "lr": lr,
    }


# ---------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------


def evaluate(s: RewardModelSession, limit: int | None = None) -> dict[str, float]:
    """On the first ``limit`` held-out pairs (None: all): pairwise accuracy (ties count half) with its
    Wilson interval, the mean score difference, the mean chosen and rejected scores, and the loss."""
    if s.test is None:
        return {}
    n = len(s.test) if limit is None else min(limit, len(s.test))
    scores_2n = leading_pair_scores(s.policy, s.test, n, s.pad_id, s.pairs_per_pass)
    margin = None if s.test.margins is None else s.test.margins[:n]
    loss, metrics = bradley_terry_loss(scores_2n[0], scores_2n[1], margin=margin,
                                       center_coefficient=s.preset.center_rewards_coefficient or 0.0)
    accuracy = float(metrics["accuracy"])
    low, high = wilson_interval(accuracy * n, n)
    return {
        "eval/pairwise_accuracy": accuracy,
        "eval/pairwise_accuracy_low": low,
        "eval/pairwise_accuracy_high": high,
        "eval/margin": float(metrics["margin"]),
        "eval/rewards_chosen": float(metrics["rewards/chosen"]),
        "eval/rewards_rejected": float(metrics["rewards/rejected"]),
        "eval/loss": float(loss),
    }
