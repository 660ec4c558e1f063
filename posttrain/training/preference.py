"""Offline preference optimization: every preference preset (DPO, ODPO, SimPO, ORPO, KTO) runs here.

One optimizer step (``train_step``), top to bottom:

0. pairs from the policy (``pairs_from`` policy, or auto on a built-in task: the default
   run), every ``resample_every`` steps: sample
   ``group_size`` completions of each of the task's next ``prompts_per_step x
   resample_every`` prompts from the current policy (rollout temperature), label them
   with the task's answer check and pair a correct completion (chosen) with an
   incorrect one of the same prompt; the steps until the next round train on these
   pairs (iterative, or with ``resample_every`` 1 online, preference optimization);
1. take the next ``pairs_per_step`` examples (pairs; KTO: labelled completions) of a
   shuffled, resumable order;
2. unpaired presets (KTO): score the mismatched pairs, prompt ``i`` with completion
   ``i-1`` cyclic in the step's batch, under the policy and the reference without
   gradient: the input of KTO's reference point ``z``;
3. per micro-batch (``micro_batch_size`` sequences, or examples up to
   ``max_tokens_per_micro_batch`` tokens): ONE forward pass of the policy over the chosen and the rejected
   rows concatenated (KTO: the examples) gives each completion's summed log-prob and
   token count; prompt tokens never enter (``modeling.forward`` scores completion
   tokens only). Only a preset that needs a reference gets the reference's log-probs,
   from a frozen copy without gradient or from the table precomputed at the start.
   The preset's loss, scaled by the micro-batch's share of the step's examples, is
   back-propagated: every preference loss is a mean over examples, so the accumulated
   gradient is the whole batch's whatever the micro-batch size;
4. one guarded optimizer step (``posttrain.training.optim``: a non-finite gradient is skipped);
5. log the preset's loss and metrics on the whole step's detached log-probs.

A preset with ``rpo_alpha`` adds that weight times the chosen (KTO: desirable) completions'
per-token NLL to its loss (RPO), which keeps the right answers likely; on pairs sampled from
the policy it is 1 unless the user set it (``with_policy_pairs_defaults``, decision 87).

``evaluate``: held-out pairwise accuracy under the preset's own implicit reward and,
for a built-in task, greedy generation accuracy on its held-out prompts.

The loop never looks at the preset's name: ``needs_reference``, ``paired``,
``needs_scores`` and ``preference_loss`` decide. Departures and decisions:

1. KTO's ``z`` comes from all the optimizer step's mismatched pairs, not from each
   micro-batch's, so micro-batching changes nothing (TRL: per batch; the paper: a
   batch estimate too).
2. The policy runs in eval mode (no dropout, as TRL's ``disable_dropout``), so the
   policy and the reference agree exactly before the first update.
3. ``micro_batch_size`` counts sequences: a pair is two (at least one example per pass).
4. Held-out pairwise accuracy counts a tie as half a win: before training, the
   reference presets' implicit rewards are all 0 (policy = reference) and score 0.5,
   chance, rather than 0.
5. With ``precompute_reference`` the reference scores every training and held-out
   example once, then is freed; KTO keeps it for its batch-dependent mismatched pairs.
   Held-out examples are always scored by the reference once, at the start (by every
   process, when there are several).
6. With ``W`` processes (``posttrain.parallel.distributed``) the step's examples are split over
   them by length, near-equal tokens each (``balanced_shard``: Karmarkar-Karp), each
   micro-batch's loss weighted by its share of the whole step, and the gradients are summed:
   the update of one process.
   KTO's mismatched pairs are the whole step's (each process scores its share of them),
   and the logged loss and metrics are computed on the whole step's log-probs.
   Pairs sampled from the policy need one process (``validate`` says so).
7. KTO's ``rpo_alpha`` term is the desirable examples' NLL averaged over all the
   step's examples (undesirable ones add 0), a mean over examples like KTO's loss, so
   micro-batches and processes add up to the one-batch value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from posttrain.algorithms.presets import PreferenceAlgorithm
from posttrain.config import Config, ConfigError
from posttrain.data.judge import Judge
from posttrain.data.preference import (
    PreferenceExamples,
    PreferenceTask,
    encode,
    load_rows,
    unpair,
)
from posttrain.data.prompts import PromptSampler, hub_splits
from posttrain.models.batching import in_item_order, item_micro_batches
from posttrain.models.experts import aux_loss_coef
from posttrain.parallel import distributed, fsdp, offload
from posttrain.parallel.distributed import say as _say
from posttrain.rollout.completions import Generator, SamplingParams
from posttrain.rollout.generators import make_generator
from posttrain.training.guards import UpdateCheck
from posttrain.training.optim import apply_gradients
from posttrain.training.preference_passes import (
    chunked_logps,
    dataset_logps,
    example_images,
    example_sequences,
    mismatched_sequences,
    passes,
    sequence_forward,
    sequence_logps,
)
from posttrain.training.policy_pairs import (
    pairs_source,
    sample_pairs,
    with_policy_pairs_defaults,
)
from posttrain.training.session import eos_token_ids
from posttrain.training.setup import (
    Inputs,
    ResumableSession,
    build_optimization,
    fingerprint,
    greedy_accuracy,
    load_policy,
    model_name,
    start_processes,
)
from posttrain.training.workload import make_judge


@dataclass
class PreferenceSession(ResumableSession):
    config: Config
    preset: PreferenceAlgorithm
    policy: Any
    tokenizer: Any
    ref: Any | None  # frozen reference model, only for presets that need one
    optimizer: torch.optim.Optimizer
    scheduler: Any
    train: PreferenceExamples | None  # pairs_from policy: None until the first round is sampled
    test: PreferenceExamples | None  # held-out pairs
    task: PreferenceTask | None  # built-in task: held-out generation accuracy
    generator: Generator | None
    sampler: PromptSampler
    ref_logps: Tensor | None = None  # [K, N] precomputed reference log-probs of the training examples
    test_ref_logps: Tensor | None = None  # [2, M] reference log-probs of the held-out pairs
    step: int = 0
    bad_steps: int = 0
    fingerprint: dict[str, Any] = field(default_factory=dict)
    last_batch: list[int] = field(default_factory=list)
    last_inputs: dict[str, Tensor] = field(default_factory=dict)
    update_check: UpdateCheck = field(init=False)  # an optimizer step that moves no weight is an error
    prompt_sampler: PromptSampler | None = None  # pairs_from policy: the order of the task's prompts
    pair_rows: list[dict[str, Any]] = field(default_factory=list)  # pairs_from policy: this round's pairs
    judge: Judge | None = None  # pairs_from policy with --judge: labels the pairs instead of the answer check

    def __post_init__(self) -> None:
        self.update_check = UpdateCheck(self.policy, lora=bool(self.config.model.lora_r))

    @classmethod
    def create(cls, config: Config, inputs: Inputs = Inputs()) -> "PreferenceSession":
        preset = config.preset()
        if not isinstance(preset, PreferenceAlgorithm):
            raise ConfigError(f"algorithm: {preset.name} is an online preset; the preference trainer runs "
                              "dpo, odpo, simpo, orpo and kto")
        if config.optim.ref_refresh_every:
            raise ConfigError("ref_refresh_every: the preference trainer keeps its reference fixed; set it to 0")
        if config.data.eval_tasks:
            raise ConfigError("eval_tasks: only the online trainer scores other tasks during a run; for a preference "
                              "run, score its final_model/ with posttrain eval --task ...")
        data = config.data
        if inputs.tools or config.episodes.tools or config.episodes.mcp_server:
            raise ConfigError(f"{'mcp_server' if config.episodes.mcp_server else 'tools'}: multi-turn episodes are "
                              "sampled by online presets (grpo, rloo, ...); a preference preset trains on given pairs")
        if inputs.agent is not None or config.episodes.agent:
            raise ConfigError("agent: an agent's episodes are online rollouts (grpo, rloo, ...); a preference preset "
                              "trains on given pairs")
        if inputs.reward_funcs:
            raise ConfigError("reward_funcs: preference presets learn from chosen/rejected pairs, not rewards; "
                              "an online preset (grpo, rloo, ...) takes reward functions")
        train_rows, test_rows, task = load_rows(data.dataset, data.eval_dataset, data.task, paired=preset.paired,
                                                needs_scores=preset.needs_scores, hub=hub_splits(data))
        test_rows = test_rows[:data.eval_size]
        from_policy = pairs_source(config) == "policy"
        if from_policy:
            preset, note = with_policy_pairs_defaults(preset, config)
            _say(f"task {data.task}: training on {note}; held out: {len(test_rows)} of the task's fixed pairs "
                 f"({task.description})" if task else note)
        elif task is not None:
            _say(f"task {data.task}: {task.description} ({len(train_rows)} training pairs, {len(test_rows)} held out)")
        if data.judge is not None and not from_policy:
            raise ConfigError("judge: a preference run uses the judge to label pairs of the policy's own samples "
                              "(pairs_from policy, on a built-in task); the given pairs are labelled already")
        if data.judge is not None and data.judge.startswith(("http://", "https://")):
            raise ConfigError("judge: a judge service scores completions one at a time (online runs); a preference "
                              "run's judge compares two: give a judge model directory")
        validate(config, preset, None if from_policy else len(train_rows), task)
        start_processes(config, needs_reference=preset.needs_reference, name=preset.name)
        name = model_name(config, task.source.default_model if task else None, inputs)
        policy, tokenizer, ref = load_policy(config, name, inputs, needs_reference=preset.needs_reference,
                                             train_mode=False)  # no dropout (decision 2); gradients flow the same
        pc = config.preference
        lengths = dict(max_length=pc.max_length, max_prompt_length=pc.max_prompt_length)
        train = None if from_policy else encode(
            train_rows, tokenizer, paired=preset.paired, with_scores=preset.needs_scores and preset.paired,
            source=data.dataset or f"task {data.task}", **lengths)
        test = encode(test_rows, tokenizer, paired=True, with_scores=preset.needs_scores,
                      source=data.eval_dataset or f"task {data.task} (held-out)", **lengths) if test_rows else None
        if train is not None:
            _say(f"{int(train.truncated.sum())} of {len(train)} training examples truncated "
                 f"(max_length {pc.max_length}, max_prompt_length {pc.max_prompt_length})")
        if task is not None and not from_policy and not data.dataset:
            _say("the built-in fixed pairs are synthetic (the right scratchpad against one with a slip): they teach "
                 "ranking and can lower task accuracy; the default, --pairs-from auto, trains on the policy's own "
                 "samples and improves the task")
        chunk = config.optim.micro_batch_size  # sequences per no-grad forward pass
        pad = tokenizer.pad_token_id
        with offload.resident(ref):
            ref_logps = dataset_logps(ref, train, pad, chunk)[0] if ref is not None and pc.precompute_reference else None
            test_ref_logps = dataset_logps(ref, test, pad, chunk)[0] if ref is not None and test is not None else None
        if ref_logps is not None and preset.paired:
            ref = None  # everything it would score is scored: free it (decision 5)
        policy, optimizer, scheduler = build_optimization(config, policy, [], optimizer_steps=config.run.max_steps)
        generator = None
        if task is not None:
            r = config.rollout
            sampling = SamplingParams(r.max_new_tokens or task.source.max_new_tokens, r.temperature, r.top_p, r.top_k)
            generator = make_generator("hf", policy, tokenizer, sampling, eos_token_ids(policy, tokenizer))
        return cls(config, preset, policy, tokenizer, ref, optimizer, scheduler, train, test, task, generator,
                   PromptSampler(0 if train is None else len(train), config.run.seed), ref_logps, test_ref_logps,
                   fingerprint=fingerprint(name, preset.name, policy),
                   prompt_sampler=PromptSampler(len(task.source.train), config.run.seed) if from_policy else None,
                   judge=make_judge(config) if data.judge is not None else None)

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id

    @property
    def examples_per_pass(self) -> int:
        """Examples per micro-batch: ``micro_batch_size`` sequences, K per example (decision 3)."""
        return max(1, self.config.optim.micro_batch_size // (2 if self.preset.paired else 1))

    # -- the runner's protocol -----------------------------------------------------------------

    def trainer_state(self) -> dict[str, Any]:
        state = super().trainer_state()
        if self.prompt_sampler is not None:
            state["prompt_sampler"] = self.prompt_sampler.state_dict()
        return state

    def extra_state(self) -> dict[str, Any]:
        """pairs_from policy: the round's pairs, which the resumed run trains on until its next round."""
        return {"pair_rows": self.pair_rows} if self.pair_rows else {}

    def load_trainer_state(self, state: dict[str, Any], extra: dict[str, Any]) -> None:
        if extra.get("pair_rows"):
            use_pairs(self, extra["pair_rows"])
        super().load_trainer_state(state, extra)
        if self.prompt_sampler is not None:
            self.prompt_sampler.load_state_dict(state["prompt_sampler"])

    def sample_rows(self, limit: int = 16) -> list[dict[str, Any]]:
        """The last step's first examples with their log-probs, for samples.jsonl."""
        per_example = {k: v for k, v in self.last_inputs.items() if k.endswith("logps") and v.dim() == 1}
        return [{**self.train.rows[i], **{k: float(v[j]) for k, v in per_example.items()}}
                for j, i in enumerate(self.last_batch[:limit])]


def validate(config: Config, preset: PreferenceAlgorithm, num_examples: int | None,
             task: PreferenceTask | None) -> None:
    """Reject impossible combinations before any model is loaded; say what to change. ``num_examples`` is
    None when the pairs are sampled from the policy."""
    per_step = config.preference.pairs_per_step
    if num_examples is None and (task is None or config.data.dataset is not None):
        raise ConfigError("pairs_from: policy pairs are labelled by a built-in task's answer check; give --task "
                          "(addition, gsm) without --dataset, or use pairs_from dataset")
    if num_examples is None and config.preference.precompute_reference:
        raise ConfigError("precompute_reference: pairs sampled from the policy (the built-in task's default, pairs_from "
                          "auto) change every resample_every steps, so the reference scores them as they come; drop "
                          "precompute_reference, or train on the fixed synthetic pairs with pairs_from dataset")
    if num_examples is None and distributed.world_size() > 1:
        raise ConfigError("pairs_from: policy pairs are sampled in one process; run it without torchrun/accelerate "
                          "or use pairs_from dataset")
    if num_examples is not None and per_step > num_examples:
        raise ConfigError(f"pairs_per_step: {per_step} is more than the {num_examples} training examples; use "
                          f"--pairs-per-step {num_examples} or fewer")
    world = distributed.world_size()
    if per_step % world:
        raise ConfigError(f"pairs_per_step: {per_step} examples do not split evenly over {world} processes; "
                          f"use a multiple of {world}")
    if not preset.paired and per_step < 2:
        raise ConfigError(f"pairs_per_step: {preset.name} pairs each prompt with another example's completion "
                          "for its reference point; use pairs_per_step >= 2")


# ---------------------------------------------------------------------------------------
# The loss inputs
# ---------------------------------------------------------------------------------------


def pair_inputs(logps_2n: Tensor, lengths_2n: Tensor, ref_2n: Tensor | None,
                scores_2n: Tensor | None) -> dict[str, Tensor]:
    """``preference_loss`` keywords of n pairs; row 0 of each [2, n] is the chosen, row 1 the rejected."""
    inputs = {"chosen_logps": logps_2n[0], "rejected_logps": logps_2n[1],
              "chosen_lengths": lengths_2n[0], "rejected_lengths": lengths_2n[1]}
    if ref_2n is not None:
        inputs.update(ref_chosen_logps=ref_2n[0], ref_rejected_logps=ref_2n[1])
    if scores_2n is not None:
        inputs.update(chosen_scores=scores_2n[0], rejected_scores=scores_2n[1])
    return inputs


def loss_inputs(preset: PreferenceAlgorithm, data: PreferenceExamples, idx: list[int], logps_Kn: Tensor,
                lengths_Kn: Tensor, ref_Kn: Tensor | None) -> dict[str, Tensor]:
    """``preference_loss`` keywords (named as in posttrain.functional) for examples ``idx``."""
    device = logps_Kn.device
    if preset.paired:
        scores = None if data.scores is None else data.scores[:, idx].to(device)
        return pair_inputs(logps_Kn, lengths_Kn, ref_Kn, scores)
    inputs = {"logps": logps_Kn[0], "lengths": lengths_Kn[0], "desirable": data.desirable[idx].to(device)}
    if ref_Kn is not None:
        inputs["ref_logps"] = ref_Kn[0]
    return inputs


def reference_logps(s: PreferenceSession, idx: list[int]) -> Tensor | None:
    """[K, n] reference log-probs of examples ``idx`` (precomputed or a no-grad pass), None without a reference."""
    if not s.preset.needs_reference:
        return None
    if s.ref_logps is not None:
        return s.ref_logps[:, idx].to(s.policy.device)
    with torch.no_grad(), offload.resident(s.ref):
        logps, _ = sequence_logps(s.ref, *example_sequences(s.train, idx), s.pad_id,
                                  images=example_images(s.train, idx), **passes(s))
    return logps.view(len(s.train.completion_ids), -1)


def kl_inputs(s: PreferenceSession, idx: list[int]) -> dict[str, Tensor]:
    """KTO: the step's mismatched pairs under policy and reference, no gradient; {} for paired presets.
    ``idx`` is the whole step's examples; each process scores its share of the pairs and gets them all."""
    if s.preset.paired:
        return {}
    prompts, completions = mismatched_sequences(s.train, idx, s.config.preference.max_length)
    images = example_images(s.train, idx, repeats=1)
    mine = (distributed.shard(prompts), distributed.shard(completions))
    chunk, where = s.config.optim.micro_batch_size, {**passes(s), "images": images and distributed.shard(images)}
    with offload.resident(s.ref):
        ref_logps = chunked_logps(s.ref, *mine, s.pad_id, chunk, **where)[0]
    return {"kl_logps": distributed.gather_rows(chunked_logps(s.policy, *mine, s.pad_id, chunk, **where)[0]),
            "kl_ref_logps": distributed.gather_rows(ref_logps)}


# ---------------------------------------------------------------------------------------
# Pairs sampled from the policy (pairs_from policy)
# ---------------------------------------------------------------------------------------


def sample_policy_pairs(s: PreferenceSession) -> dict[str, float]:
    """A new round of pairs from the current policy, and its metrics: ``group_size`` completions of each
    of the task's next ``prompts_per_step x resample_every`` prompts, a correct one chosen over an
    incorrect one of the same prompt (``posttrain.training.policy_pairs``)."""
    r, source = s.config.rollout, s.task.source
    rows = [source.train[i] for i in s.prompt_sampler.next(r.prompts_per_step * s.config.preference.resample_every)]
    pairs, metrics = sample_pairs(s.generator, s.tokenizer, source, rows, r.group_size, chunk=r.prompts_per_step,
                                  judge=s.judge)
    if s.judge is not None:
        metrics.update(s.judge.step_metrics())
    use_pairs(s, pairs)
    return metrics


def use_pairs(s: PreferenceSession, rows: list[dict[str, Any]]) -> None:
    """Train on the pair ``rows`` from now on: tokenized (KTO: unpaired), in a shuffled order of their own
    (seeded by the round, so a resumed run takes the same order)."""
    pc = s.config.preference
    s.pair_rows = rows
    s.train = encode(rows if s.preset.paired else unpair(rows), s.tokenizer, paired=s.preset.paired,
                     with_scores=s.preset.needs_scores and s.preset.paired, source="pairs sampled from the policy",
                     max_length=pc.max_length, max_prompt_length=pc.max_prompt_length)
    s.sampler = PromptSampler(len(s.train), s.config.run.seed + 1_000_003 * (s.step // pc.resample_every + 1))


# ---------------------------------------------------------------------------------------
# The step
# ---------------------------------------------------------------------------------------


def example_tokens(data: PreferenceExamples, idx: list[int], share_prompts: bool) -> list[int]:
    """The tokens a pass over each of examples ``idx`` computes: its completions, and its prompt once
    (``share_prompts``) or once per completion."""
    k = len(data.completion_ids)
    return [len(data.prompt_ids[i]) * (1 if share_prompts else k) + sum(len(column[i]) for column in data.completion_ids)
            for i in idx]


def train_micro_batch(s: PreferenceSession, idx: list[int], share: float,
                      kl: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, float]]:
    """One forward pass over the examples' K * n sequences, the loss (with a mixture of experts' load-balancing
    loss where the model's config asks for it), backward; returns the detached inputs and the routing's
    metrics weighted by ``share``."""
    k, n = len(s.train.completion_ids), len(idx)
    logps, lengths, router = sequence_forward(s.policy, *example_sequences(s.train, idx), s.pad_id,
                                              images=example_images(s.train, idx), **passes(s))
    inputs = loss_inputs(s.preset, s.train, idx, logps.view(k, n), lengths.view(k, n), reference_logps(s, idx))
    loss, _ = s.preset.preference_loss(**inputs, **kl)
    if router is not None:
        loss = loss + aux_loss_coef(s.policy) * router.aux_loss
    (loss * share).backward()  # a mean over n examples, weighted n / N: the step's mean over N
    routing = {} if router is None else {name: value * share for name, value in router.metrics.items()}
    return {name: value.detach() for name, value in inputs.items()}, routing


def train_step(s: PreferenceSession) -> dict[str, float]:
    """One optimizer step of the preset's preference loss over ``pairs_per_step`` examples."""
    round_metrics = {}
    if s.prompt_sampler is not None and s.step % s.config.preference.resample_every == 0:
        round_metrics = sample_policy_pairs(s)  # pairs_from policy: a new round from the current policy
    idx = s.sampler.next(s.config.preference.pairs_per_step)  # the whole step's, the same on every process
    lr = s.scheduler.get_last_lr()[0]  # this step's; apply_gradients moves the scheduler on
    tokens = dict(zip(idx, example_tokens(s.train, idx, s.config.optim.share_prompts)))
    mine, in_step_order = distributed.balanced_shard(idx, [tokens[i] for i in idx])  # near-equal tokens each
    micros = item_micro_batches([tokens[i] for i in mine], per_pass=s.examples_per_pass,
                                budget=s.config.optim.max_tokens_per_micro_batch)
    with fsdp.full_parameters(s.policy):  # FSDP: gathered once for the step's passes
        kl = kl_inputs(s, idx)
        parts, routing = [], {}
        for k, micro in enumerate(micros):
            fsdp.sync_gradients(s.policy, k == len(micros) - 1)  # FSDP reduces at the last backward
            part, shares = train_micro_batch(s, [mine[j] for j in micro], len(micro) / len(idx), kl)
            parts.append(part)
            for name, value in shares.items():
                routing[name] = routing.get(name, 0.0) + value
    before = s.update_check.before_step()
    grad_norm, s.bad_steps = apply_gradients(s.optimizer, s.scheduler, s.config.optim, s.bad_steps)
    s.update_check.after_step(before, grad_norm, lr)
    # every process's log-probs, in the order of idx
    order = in_item_order(micros)
    inputs = {name: distributed.gather_rows(torch.cat([part[name] for part in parts])[order])[in_step_order]
              for name in parts[0]}
    with torch.no_grad():
        loss, metrics = s.preset.preference_loss(**inputs, **kl)  # the step's loss, from its log-probs
    if not s.preset.paired:  # F.kto_loss reports rewards; show each kind's log-probs as the pairs do
        desirable = inputs["desirable"]
        for name, rows in (("desirable", desirable), ("undesirable", ~desirable)):
            if rows.any():
                metrics[f"logps/{name}"] = inputs["logps"][rows].mean()
    s.last_batch, s.last_inputs = idx, inputs
    return {
        "loss": float(loss),
        **{name: float(value) for name, value in metrics.items()},
        "grad_norm": grad_norm,
        "skipped_steps": float(not math.isfinite(grad_norm)),
        "lr": lr,
        "data/truncated": float(s.train.truncated[idx].sum()),
        **distributed.reduce_values(routing),  # each process's shares of the step: summed, the step's mean
        **round_metrics,
    }


# ---------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------


def implicit_rewards(preset: PreferenceAlgorithm, logps_2M: Tensor, lengths_2M: Tensor, ref_2M: Tensor | None,
                     scores_2M: Tensor | None) -> Tensor:
    """[2, M] (chosen, rejected) implicit reward of each pair under the preset's own definition.

    Read from the preset's loss metrics one pair at a time (the loss reports batch means), so the
    definition is the loss's: beta * (pi - ref) for DPO, ODPO and KTO (a pair is then a desirable and
    an undesirable example), beta * pi / |y| for SimPO, the log-odds of the mean token log-prob for ORPO.
    """
    names = ("rewards/chosen", "rewards/rejected") if preset.paired else ("rewards/desirable", "rewards/undesirable")
    rewards = []
    for m in range(logps_2M.shape[1]):
        one = slice(m, m + 1)
        if preset.paired:
            inputs = pair_inputs(logps_2M[:, one], lengths_2M[:, one], None if ref_2M is None else ref_2M[:, one],
                                 None if scores_2M is None else scores_2M[:, one])
        else:
            inputs = {"logps": logps_2M[:, m], "lengths": lengths_2M[:, m], "ref_logps": ref_2M[:, m],
                      "desirable": torch.tensor([True, False]), "kl_logps": torch.zeros(1),
                      "kl_ref_logps": torch.zeros(1)}
        _, metrics = preset.preference_loss(**inputs)
        rewards.append([float(metrics[name]) for name in names])
    return torch.tensor(rewards).T


@torch.no_grad()
def evaluate(s: PreferenceSession, limit: int | None = None) -> dict[str, float]:
    """Held-out pairwise accuracy (ties count half), reward margin and log-probs; generation accuracy on
    the first ``limit`` (None: all) of the ``eval_size`` held-out prompts."""
    out: dict[str, float] = {}
    if s.test is not None:
        logps, lengths = dataset_logps(s.policy, s.test, s.pad_id, s.config.optim.micro_batch_size)
        chosen, rejected = implicit_rewards(s.preset, logps, lengths, s.test_ref_logps, s.test.scores)
        wins = (chosen > rejected).float() + 0.5 * (chosen == rejected).float()
        out.update({
            "eval/pairwise_accuracy": wins.mean().item(),
            "eval/reward_margin": (chosen - rejected).mean().item(),
            "eval/logps_chosen": logps[0].mean().item(),
            "eval/logps_rejected": logps[1].mean().item(),
        })
    if s.task is not None and s.config.data.eval_size:
        rows = s.task.source.test[:s.config.data.eval_size][:limit]
        out.update(greedy_accuracy(s.generator, s.tokenizer, s.task.source.correct, rows))
    return out
