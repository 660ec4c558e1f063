"""The online RL loop: every online preset runs through ``train_step``.

One step, top to bottom:

1. sample ``B`` prompts (SRPO's history resampling leaves solved prompts out, difficulty filtering
   those whose last pass rate was too low or too high); with ``W`` processes each takes its ``B / W``;
2. generate ``G`` completions per prompt and score them with the reward functions;
3. shape the rewards: the preset's binary reward (DAPO's +-1) and overlong penalty, and Kimi k1.5's
   group length penalty where the run sets it; record each prompt's pass rate for the sampler;
4. filter groups: dynamic sampling keeps only groups with reward variance and
   refills (surplus groups wait for the next step); best-of-N keeps each group's best;
5. compute the log-probs the preset needs: the sampling policy's (for several
   updates per rollout, mini-batches, KL in the reward or surplus groups), the
   reference's (KL), and the value head's (GAE);
6. advantages (and returns) from the preset's estimator, on the whole step's batch
   (every process's rows), so batch statistics are the same for any ``W``;
7. ``num_epochs`` passes over the rollout in ``mini_batches`` optimizer steps;
   micro-batches accumulate gradients, and the aggregation's normaliser is the
   optimizer step's (over all processes, whose gradients are summed), so neither
   the micro-batch size nor the process count changes the update;
8. log metrics of the whole step (reduced over processes).

The loop never looks at the algorithm's name: the preset's pieces decide.
Departures from the papers, all documented in docs/decisions.md: PPO's critic is
a linear value head on the policy's backbone; log-probs are computed at the
sampling temperature; with one update per rollout the "old" log-probs are the
detached current ones (ratio exactly 1, no extra forward pass).
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch
from torch import Tensor

import posttrain.functional as F
from posttrain.config import CORRECTIONS, OffPolicyConfig
from posttrain.data.scoring import Scores
from posttrain.functional._value import explained_variance
from posttrain.models.batching import micro_batch_rows
from posttrain.models.experts import aux_loss_coef
from posttrain.models.logprobs import batched_logprobs
from posttrain.models.modeling import collate, forward
from posttrain.parallel import distributed, fsdp, offload
from posttrain.rollout.completions import Completions
from posttrain.rollout.episodes import EpisodeStats
from posttrain.training.groups import Groups, cat_rows, step_tensors
from posttrain.training.guards import has_signal, step_has_signal
from posttrain.training.rollouts import fresh_enough, staleness
from posttrain.training.session import OnlineSession
from posttrain.training.teachers import (
    frozen_logprobs,
    move_self_teacher,
    passes,
    reverse_kl_metrics,
    teacher_logprobs,
    teacher_tasks,
)
from posttrain.training.workload import score_texts

# ---------------------------------------------------------------------------------------
# 1-4: sample, generate, score, shape, filter
# ---------------------------------------------------------------------------------------


def decode(s: OnlineSession, completions: Completions) -> list[str]:
    return s.tokenizer.batch_decode(completions.completion_ids, skip_special_tokens=True)


def score_rows(s: OnlineSession, rows: list[dict], completions: Completions, texts: list[str],
               g: int) -> tuple[Scores, Tensor | None]:
    """Score ``len(rows) * g`` completions (row i's samples at i*g .. i*g + g - 1)."""
    return score_texts(s.work, s.config.data, rows, texts, g, completions.rewards)


EPISODE_COUNT = "episode_count/"  # counts of multi-turn episodes, summed over rounds and processes
SHAPING_SUM = "shaping_sum/"  # a reward-shaping term's sum (and the samples'), for its mean over the step


def rollout(s: OnlineSession, first: bool) -> tuple[Groups, dict[str, float], dict[str, int]]:
    """A generation round's ``G`` completions of each prompt (the step's batch, or a refill), scored, their
    rewards shaped. Also returns the generation and scoring times, and counts: failed rewards by function,
    for multi-turn episodes turns, tool calls, tool errors and inserted tokens, and a shaping term's sum."""
    alg, g = s.alg, s.config.rollout.group_size
    sampled = s.rollouts.first_round(s) if first else s.rollouts.extra_round(s)
    indices, completions = sampled.indices, sampled.completions
    rows = [s.train_rows[i] for i in indices]
    prompt_ids = completions.prompts([s.encoded_prompts[i] for i in indices], g)
    texts = decode(s, completions)
    t1 = time.perf_counter()
    scores, correct = score_rows(s, rows, completions, texts, g)
    s.reward_watch.update(scores.terms, scores.failures)
    rewards = scores.total
    if alg.binary_reward is not None:  # DAPO: +1 for a correct answer, -1 otherwise
        low, high = alg.binary_reward
        rewards = torch.where(correct, torch.tensor(high), torch.tensor(low))
    if alg.overlong_buffer_ratio is not None:  # DAPO eq. (13), soft overlong punishment
        budget = s.max_new_tokens
        rewards = rewards + F.overlong_penalty(
            completions.lengths, max_tokens=budget, buffer=max(1, round(alg.overlong_buffer_ratio * budget))
        )
    length_penalty = None
    d = s.config.data
    if d.group_length_penalty is not None and s.step >= d.group_length_penalty_after:  # Kimi k1.5 sec. 2.3.3
        length_penalty = F.group_length_penalty(completions.lengths.view(-1, g), correct.view(-1, g)).view(-1)
        rewards = rewards + d.group_length_penalty * length_penalty
    if correct is not None:  # every process records every process's pass rates: one sampler state
        rates = correct.view(-1, g).float().mean(-1).tolist()
        s.sampler.record_pass_rates(dict(distributed.concat(list(zip(indices, rates)))))
    groups = Groups(
        list(indices), prompt_ids, completions, texts,
        rewards.view(-1, g), scores.terms, correct,
    )
    if scores.steps is not None:  # a process reward: its steps' rewards on the tokens where they end
        groups.step_rewards, groups.step_ends = step_tensors(s.tokenizer, completions.completion_ids,
                                                             completions.mask, scores.steps)
    # generation: the sampling's own time (the rollout process's, when asynchronous); rollout_wait: what the
    # trainer spent waiting for it (all of it, when synchronous)
    times = {"time/generation": sampled.seconds, "time/rollout_wait": sampled.waited,
             "time/scoring": time.perf_counter() - t1}
    failures = {f"reward_failures/{name}": count for name, count in scores.failures.items()}
    for fn in s.work.reward_fns:  # counts a reward function keeps of its own (a judge's unreadable replies)
        if hasattr(fn, "step_metrics"):
            failures.update(fn.step_metrics())
    failures.update({f"{EPISODE_COUNT}{key}": value for key, value in sampled.episode_counts.items()})
    if length_penalty is not None:  # summed over rounds and processes, then divided: the mean of every sample
        failures.update({f"{SHAPING_SUM}group_length_penalty": float(length_penalty.sum()),
                         f"{SHAPING_SUM}samples": len(length_penalty)})
    failed = scores.failed if completions.dropped is None else scores.failed | completions.dropped
    if failed.any():  # reward_errors=skip, or an agent's episode not recorded: a group with one leaves the update
        groups = groups.select(~failed.view(-1, g).any(-1))
    return groups, times, failures


def collect_groups(s: OnlineSession) -> tuple[Groups, dict[str, float]]:
    """This process's share of the step's groups, ``B / W`` of them; with dynamic sampling, refill
    until they carry signal. All processes generate in the same rounds (so they keep drawing the
    same prompt order) until each holds its share or the rounds run out."""
    alg, b = s.alg, s.config.rollout.prompts_per_step
    share = b // distributed.world_size()
    kept: list[Groups] = [s.surplus] if s.surplus is not None else []
    have = sum(len(p.indices) for p in kept)
    times: dict[str, float] = {"time/generation": 0.0, "time/rollout_wait": 0.0, "time/scoring": 0.0}
    failures: dict[str, float] = {}
    rounds, generated, zero_variance, fresh = 0, 0, 0, []
    tally = dict(s.sampler.tally)  # the difficulty filter's counts before this step's draws
    while rounds < (alg.max_generation_rounds if alg.dynamic_sampling else 1) and distributed.any_true(have < share):
        groups, round_times, round_failures = rollout(s, first=rounds == 0)
        for totals, new in ((times, round_times), (failures, round_failures)):
            for key, value in new.items():
                totals[key] = totals.get(key, 0.0) + value
        signal = has_signal(groups.rewards)
        rounds, generated, zero_variance = rounds + 1, generated + len(signal), zero_variance + int((~signal).sum())
        fresh.append(groups)
        if alg.dynamic_sampling:
            groups = groups.select(signal)
        if s.needs_rollout_logprobs:  # (an empty selection costs no forward pass)
            groups.old_logprobs, groups.old_values = rollout_logprobs(s, groups)
        kept.append(groups)
        have += len(groups.indices)
    if not distributed.any_true(have > 0):
        raise RuntimeError(
            f"no group left to train on after {rounds} generation round(s) of {b} prompts (dynamic sampling "
            "keeps only groups with reward variance; reward_errors=skip drops groups with a failed reward); "
            "raise max_generation_rounds or group_size, start from a policy that is sometimes right, "
            "or fix the reward function"
        )
    # A process whose share came back empty (the others' did not) trains on no rows this step. At most
    # a step's share of groups waits for the next step (one process keeps fewer than B); more happens
    # only when this process generated again for another that was still short.
    batch, surplus = Groups.cat([p for p in kept if p.indices] or kept[-1:]).split(share)
    s.surplus = None if surplus is None else fresh_enough(s, surplus.split(share)[0])
    # The step's metrics: counts summed over processes, times the slowest process's, the rollout's
    # metrics over every process's new groups.
    total = distributed.reduce_values({"generated": generated, "zero_variance": zero_variance,
                                       "groups_trained": len(batch.indices),
                                       "surplus_groups": 0 if s.surplus is None else len(s.surplus.indices)})
    counts = distributed.reduce_values(failures)
    episodes = {key.removeprefix(EPISODE_COUNT): counts.pop(key) for key in list(counts) if key.startswith(EPISODE_COUNT)}
    shaping = {key.removeprefix(SHAPING_SUM): counts.pop(key) for key in list(counts) if key.startswith(SHAPING_SUM)}
    samples = shaping.pop("samples", 0)
    stats = {
        **distributed.reduce_values(times, max),
        **counts,
        **(EpisodeStats.metrics_of(episodes) if episodes else {}),
        **{f"reward/{name}": total / samples for name, total in shaping.items()},
        **(difficulty_metrics(s, tally) if s.sampler.filters_difficulty else {}),
        "generation_rounds": rounds,
        "zero_variance_groups": total["zero_variance"] / max(total["generated"], 1),

        "groups_trained": total["groups_trained"],
        "surplus_groups": total["surplus_groups"],
        **staleness(s, batch),
    }
    generated_metrics = rollout_metrics(Groups.cat(distributed.concat(fresh)))
    stats["reward_signal"] = float(distributed.any_true(any(step_has_signal(p.rewards) for p in fresh)))
    return batch, {**stats, **generated_metrics}


def difficulty_metrics(s: OnlineSession, before: dict[str, float]) -> dict[str, float]:
    """The difficulty filter at this step: the prompts it passed over as too easy and too hard while the step
    drew its prompts (with asynchronous rollouts, the draws for the steps ahead), the completions that saved
    over the run, and the mean pass rate, when last sampled, of the drawn prompts that had one. Every process
    holds the same sampler, so nothing is reduced."""
    now = s.sampler.tally
    step = {key: now[key] - before[key] for key in now}
    out = {"difficulty/skipped_easy": step["skipped_easy"], "difficulty/skipped_hard": step["skipped_hard"],
           "difficulty/completions_saved": (now["skipped_easy"] + now["skipped_hard"]) * s.config.rollout.group_size}
    if step["drawn_with_rate"]:
        out["difficulty/prior_pass_rate"] = step["drawn_rate_sum"] / step["drawn_with_rate"]
    return out


def rollout_metrics(groups: Groups) -> dict[str, float]:
    """Reward, length (overall and by correctness) and truncation of what was generated."""
    lengths = groups.completions.lengths.float()
    out = {
        "reward/mean": groups.rewards.mean().item(),
        "reward/std": groups.rewards.std().item() if groups.rewards.numel() > 1 else 0.0,
        "completion_length/mean": lengths.mean().item(),
        "truncation_rate": groups.completions.truncated.float().mean().item(),
    }
    for name, values in groups.terms.items():
        out[f"reward/{name}"] = values.nanmean().item()
    if groups.correct is not None:
        out["accuracy"] = groups.correct.float().mean().item()
        for label, rows in (("correct", groups.correct), ("incorrect", ~groups.correct)):
            if rows.any():
                out[f"completion_length/{label}"] = lengths[rows].mean().item()
    return out


# ---------------------------------------------------------------------------------------
# 5-7: log-probs, advantages, update
# ---------------------------------------------------------------------------------------


def rollout_logprobs(s: OnlineSession, groups: Groups) -> tuple[Tensor, Tensor | None]:
    """[N, T] the sampling policy's log-probs of the groups' tokens, and its values (PPO) or None."""
    comp = groups.completions
    return batched_logprobs(s.policy, groups.prompt_ids, comp.completion_ids, comp.mask, pad_id=s.pad_id,
                            temperature=s.config.rollout.temperature, value_head=s.value_head, present=comp.present,
                            routing=comp.routing, images=comp.images, **passes(s.config.optim))


def reference_logprobs(s: OnlineSession, groups: Groups) -> Tensor:
    """[N, T] the reference model's log-probs of the groups' tokens."""
    return frozen_logprobs(s, groups, s.ref)


def greedy_rewards(s: OnlineSession, indices: list[int]) -> Tensor:
    """ReMax's baseline: the raw reward of one greedy decode per prompt, [B]."""
    if not indices:  # this process holds no group this step (reward_errors=skip dropped them)
        return torch.zeros(0)
    rows = [s.train_rows[i] for i in indices]
    completions = s.generator.generate([s.encoded_prompts[i] for i in indices], num_samples=1, greedy=True, rows=rows)
    scores, _ = score_rows(s, rows, completions, decode(s, completions), 1)
    return scores.total


def best_of_n(s: OnlineSession, groups: Groups) -> Groups:
    """RAFT: each group's highest-reward sample (ties: the first); groups below min_reward, and (skip_ties)
    groups whose samples all tie, dropped."""
    index, keep = F.best_of_n(groups.rewards, min_reward=s.alg.min_reward, skip_ties=s.alg.skip_ties)
    return groups.pick(index).select(keep)


def maybe_refresh_reference(s: OnlineSession) -> None:
    """Copy the policy into the reference every ``ref_refresh_every`` steps."""
    every = s.config.optim.ref_refresh_every
    if s.ref is not None and every and (s.step + 1) % every == 0:
        state = fsdp.full_state_dict(s.policy)
        with offload.resident(s.ref, write=True):
            s.ref.load_state_dict(state)


def step_normalizer(mask: Tensor, aggregation: str) -> Tensor:
    """The optimizer step's denominator: valid tokens (token_mean) or non-empty sequences,
    summed over processes (each holds its rows of the step; their gradients are summed)."""
    if aggregation == "token_mean":
        return distributed.all_sum(mask.sum())
    return distributed.all_sum((mask.sum(-1) > 0).sum())


# Micro-batch losses are partial sums (the normaliser is the optimizer step's), so they add up
# (over micro-batches and processes) to the step's loss, as do the sums the importance weights'
# effective sample size is made of; every other metric is a per-token mean, averaged weighted by tokens.
ESS_SUMS = ("mismatch_sum/weights", "mismatch_sum/squares", "mismatch_sum/tokens")
ADDITIVE_METRICS = ("loss", "policy_loss", "value_loss", *ESS_SUMS)


def mini_batch_rows(rows: int, mini_batches: int, seed: int, step: int, epoch: int) -> list[Tensor]:
    """This process's rows [k] of each mini-batch: a random split of the whole step's rows (every
    process's, in rank order) drawn from (seed, step, epoch), so every process draws the same split,
    one process splits the same global batch the same way, and a resumed run repeats it.

    ``mini_batches`` of them, or one per row when the step has fewer rows (a small batch, or dynamic
    sampling kept few groups): no optimizer step without data. Every process gets the same number of
    entries (its share of one may be empty), so every process joins every optimizer step.
    """
    counts = [int(n) for n in distributed.gather(rows)] if mini_batches > 1 else [rows]
    start, total = sum(counts[:distributed.rank()]), sum(counts)
    if min(mini_batches, total) <= 1:
        return [torch.arange(rows)]
    generator = torch.Generator().manual_seed(((seed * 1_000_003 + step) * 1_009 + epoch) % 2**63)
    order = torch.randperm(total, generator=generator)
    return [mini[(mini >= start) & (mini < start + rows)] - start
            for mini in order.tensor_split(min(mini_batches, total))]


def update(s: OnlineSession, groups: Groups, advantages: Tensor, returns: Tensor | None,
           ref: Tensor | None) -> dict[str, float]:
    """``num_epochs`` x ``mini_batches`` optimizer steps over one batch of groups."""
    alg, optim = s.alg, s.config.optim
    mask = groups.completions.mask
    entropy_coef = s.entropy_control.coefficient() if s.entropy_control else 0.0  # fixed for the whole step
    weighted: dict[str, float] = {}
    additive: dict[str, float] = {}
    tokens_seen, steps, skipped, grad_norms = 0.0, 0, 0, []
    for epoch in range(alg.num_epochs):
        minis = mini_batch_rows(len(mask), alg.mini_batches, s.config.run.seed, s.step, epoch)
        for mini in minis:
            normalizer = step_normalizer(mask[mini], alg.aggregation)
            tokens_total = step_normalizer(mask[mini], "token_mean")  # a micro-batch's share of the load loss
            seen = groups.completions.present[mini]
            micros = [mini[rows] for rows in micro_batch_rows(
                [groups.prompt_ids[int(r)] for r in mini], seen.sum(-1), rows=optim.micro_batch_size,
                tokens=optim.max_tokens_per_micro_batch, share_prompts=optim.share_prompts) if len(rows)]
            with fsdp.full_parameters(s.policy):
                for i, micro in enumerate(micros):
                    fsdp.sync_gradients(s.policy, i == len(micros) - 1)  # FSDP reduces at the last backward
                    metrics = train_micro_batch(s, groups, micro, advantages, returns, ref, normalizer, entropy_coef,
                                                tokens_total)
                    tokens = float(mask[micro].sum())
                    tokens_seen += tokens
                    for key, value in metrics.items():
                        if key in ADDITIVE_METRICS:
                            additive[key] = additive.get(key, 0.0) + value
                        else:
                            weighted[key] = weighted.get(key, 0.0) + tokens * value
                if not micros:  # no rows here: under FSDP it still joins the gradient reduction
                    fsdp.join_backward(s.policy)
            grad_norms.append(s.optimizer_step())
            steps += 1
            skipped += not math.isfinite(grad_norms[-1])
        for _ in range(alg.mini_batches - len(minis)):
            # fewer rows than mini-batches: no update without data (AdamW's momentum alone would move
            # the weights), but the schedule, which counts the preset's updates, moves on
            s.scheduler.step()
    weighted, additive = distributed.reduce_values(weighted), distributed.reduce_values(additive)
    tokens_seen = distributed.reduce_values({"tokens": tokens_seen})["tokens"]
    out = {key: value / max(tokens_seen, 1.0) for key, value in weighted.items()}
    out.update({key: value / steps for key, value in additive.items()})
    if ESS_SUMS[0] in out:  # of the whole step's tokens: (sum w)^2 / (n sum w^2), whatever the split
        weights, squares, tokens = (out.pop(key) for key in ESS_SUMS)
        out["mismatch/ess"] = weights ** 2 / (tokens * squares) if squares > 0 else 0.0
    out["grad_norm"] = sum(grad_norms) / steps
    out["skipped_steps"] = skipped
    if s.entropy_control:
        s.entropy_control.record(out.get("entropy", 0.0))
        out["entropy_coef"] = entropy_coef
    return out


def step_advantages(s: OnlineSession, groups: Groups, ref: Tensor | None, baseline: Tensor | None,
                    teacher: Tensor | None = None) -> tuple[Tensor, Tensor | None, dict[str, float]]:
    """The preset's advantages (and returns) of this process's rows, computed on the whole step's batch:
    every process's estimator inputs are gathered, so batch statistics (REINFORCE++'s and GAE's
    whitening) are the whole batch's, as in one process. Also their mean and std over valid tokens,
    and the share of valid tokens with a nonzero advantage (0: the step has nothing to learn from)."""
    inputs = {"rewards": groups.rewards, "mask": groups.completions.mask, "logprobs": groups.old_logprobs,
              "ref_logprobs": ref, "values": groups.old_values, "baseline": baseline,
              "step_rewards": groups.step_rewards, "step_ends": groups.step_ends, "teacher_logprobs": teacher,
              "reward_terms": torch.stack(list(groups.terms.values()), -1) if s.alg.takes_reward_terms else None}
    parts = distributed.gather(inputs)
    for name in ("step_rewards", "step_ends"):  # a process whose share had no steps: zeros, if another had some
        if any(part[name] is not None for part in parts):
            for part in parts:
                part[name] = part[name] if part[name] is not None else torch.zeros(part["mask"].shape)
    batch = {name: cat_rows([part[name] for part in parts]) for name in inputs}
    if batch["reward_terms"] is not None:  # GDPO: [N, K] -> [B, G, K], with the functions' weights
        batch["reward_terms"] = batch["reward_terms"].view(*batch["rewards"].shape, -1)
        batch["reward_weights"] = torch.tensor(s.work.reward_weights, dtype=torch.float64)
    advantages, returns = s.alg.advantages_and_returns(batch.pop("rewards"), **batch)
    valid = batch["mask"].bool()
    stats = {"advantage/mean": advantages[valid].mean().item() if valid.any() else 0.0,
             "advantage/std": advantages[valid].std().item() if valid.sum() > 1 else 0.0,
             "advantage/nonzero": (advantages[valid] != 0).float().mean().item() if valid.any() else 0.0}
    if returns is not None and batch["values"] is not None:
        # of the rollout-time values, over the whole batch (a per-micro-batch figure would depend on
        # how the rows are split over micro-batches and processes)
        stats["value/explained_variance"] = explained_variance(batch["values"], returns, valid).item()
    start = sum(len(part["mask"]) for part in parts[:distributed.rank()])
    mine = slice(start, start + len(groups.completions.mask))
    width = groups.completions.mask.shape[1]
    return advantages[mine, :width], None if returns is None else returns[mine, :width], stats


def train_micro_batch(s: OnlineSession, groups: Groups, rows: Tensor, advantages: Tensor,
                      returns: Tensor | None, ref: Tensor | None, normalizer: Tensor,
                      entropy_coef: float = 0.0, tokens_total: Tensor | None = None) -> dict[str, float]:
    """Forward, loss and backward for one micro-batch; returns its metrics. A mixture of experts adds its
    load-balancing loss where its config asks for it (:mod:`posttrain.models.experts`), this micro-batch's
    share of it by tokens (``tokens_total``: the mini-batch's, over processes)."""
    alg, comp = s.alg, groups.completions
    batch = collate([groups.prompt_ids[int(r)] for r in rows], comp.completion_ids[rows], comp.mask[rows],
                    s.pad_id, s.device, comp.present[rows], share_prompts=s.config.optim.share_prompts,
                    trim_padding=s.config.optim.trim_padding, routing=None if comp.routing is None else comp.routing[rows],
                    images=None if comp.images is None else [comp.images[int(r)] for r in rows])
    out = forward(s.policy, batch, temperature=s.config.rollout.temperature, with_entropy=True,
                  value_head=s.value_head, entropy_grad=entropy_coef > 0)
    t = out.logprobs.shape[1]

    def cut(x: Tensor | None) -> Tensor | None:
        return None if x is None else x[rows, :t].to(s.device)

    mask = batch.mask
    old = cut(groups.old_logprobs) if groups.old_logprobs is not None else out.logprobs.detach()
    ref_mb = cut(ref)
    advantages_mb, mismatch = cut(advantages), {}
    if comp.sampling_logprobs is not None:  # the sampler's own log-probs: measure (and correct) the mismatch
        weights, measured, mismatch = rollout_correction(s.config.off_policy, old, cut(comp.sampling_logprobs), mask)
        advantages_mb = advantages_mb * weights  # weights of 1 without a correction
        mismatch.pop("mismatch/ess")  # this micro-batch's; the step's comes from these sums
        mismatch.update(zip(ESS_SUMS, ((measured * mask).sum(), (measured.square() * mask).sum(), mask.sum())))
    loss, metrics = alg.policy_loss(out.logprobs, old, advantages_mb, mask,
                                    ref_logprobs=ref_mb if alg.kl_placement == "loss" else None,
                                    normalizer=normalizer, max_tokens=s.max_new_tokens)
    metrics.update(mismatch)
    if entropy_coef > 0:  # the entropy bonus, aggregated like the policy term over the same step
        loss = loss + F.entropy_bonus(out.entropy, mask, coef=entropy_coef, aggregation=alg.aggregation,
                                      max_tokens=s.max_new_tokens, normalizer=normalizer)
    if s.value_head is not None:
        value_loss, value_metrics = alg.value_loss(out.values, cut(groups.old_values), cut(returns), mask,
                                                   normalizer=normalizer)
        loss = loss + s.config.optim.value_loss_coef * value_loss
        value_metrics.pop("explained_variance")  # the whole batch's, in step_advantages
        metrics = {**metrics, **{f"value/{k}": v for k, v in value_metrics.items()}, "value_loss": value_loss}
    if out.router is not None:
        coef = aux_loss_coef(s.policy)
        if coef:
            loss = loss + coef * out.router.aux_loss * mask.sum() / (mask.sum() if tokens_total is None else tokens_total)
        metrics.update(out.router.metrics)
    loss.backward()
    tokens = mask.sum().clamp(min=1)
    metrics = {**metrics, "loss": loss, "entropy": (out.entropy.detach() * mask).sum() / tokens}
    if ref_mb is not None:  # KL to the reference, k3, whatever the preset puts in its loss
        metrics["kl"] = (F.kl_estimate(out.logprobs.detach(), ref_mb, "k3") * mask).sum() / tokens
    return {k: float(v.detach()) if isinstance(v, Tensor) else float(v) for k, v in metrics.items()}


def rollout_correction(r: OffPolicyConfig, old: Tensor, sampler: Tensor,
                       mask: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """The weights [n, T] the policy-gradient term gets (the mask without a correction), the weights
    whose effective sample size is logged (the raw ratios without one), and the ``mismatch/`` metrics."""
    if r.correction is None:  # measure only: the raw ratios' statistics
        ratios, metrics = F.rollout_correction(old, sampler, mask, high=math.inf)
        return mask, ratios, metrics
    level, mode = CORRECTIONS[r.correction]
    weights, metrics = F.rollout_correction(old, sampler, mask, level=level, mode=mode, high=r.correction_high,
                                            low=r.correction_low)
    return weights, weights, metrics


def train_step(s: OnlineSession) -> dict[str, float]:
    """One optimizer step (several for PPO's epochs): the whole online algorithm."""
    alg = s.alg
    lr = s.scheduler.get_last_lr()[0]  # this step's (the first of PPO's updates); the scheduler then moves on
    with fsdp.full_parameters(s.policy):  # FSDP: gathered once for generation and every pass before the update
        groups, metrics = collect_groups(s)
        t0 = time.perf_counter()
        if alg.trains_on_best_only:  # best-of-N (RAFT): train on the best sample of each group
            groups = best_of_n(s, groups)
        if alg.overlong_filter:  # DAPO: truncated completions keep their reward but leave the loss
            comp = groups.completions
            groups.completions = dataclasses.replace(comp, mask=comp.mask * ~comp.truncated[:, None])
        ref = reference_logprobs(s, groups) if alg.needs_reference else None
        teacher = teacher_logprobs(s, groups) if alg.needs_teacher else None  # distillation
        baseline = greedy_rewards(s, groups.indices) if alg.needs_greedy_baseline else None
    t1 = time.perf_counter()
    advantages, returns, stats = step_advantages(s, groups, ref, baseline, teacher)
    if teacher is not None:
        stats.update(reverse_kl_metrics(groups, teacher, teacher_tasks(s, groups)))
    metrics.update(stats)
    # Nothing to learn: no reward variance, or none left in what the step trains on (best-of-N's
    # selection, dropped groups). Counted before the update, which would only move the KL term. A teacher's
    # log-probs are distillation's signal, whatever the rewards.
    signal = (bool(metrics.pop("reward_signal")) or alg.needs_teacher) and stats["advantage/nonzero"] > 0
    metrics["no_signal_steps"] = s.signal_watch.update(signal, metrics.get("accuracy"))
    metrics.update(update(s, groups, advantages, returns, ref))
    t2 = time.perf_counter()  # training = the reference/greedy passes + the update (forward, backward, steps)
    metrics.update(distributed.reduce_values({"time/training": t2 - t0, "time/update": t2 - t1}, max))
    metrics["lr"] = lr
    if s.sync_check is not None:  # the last weight sync's probe gap (guards.SyncCheck)
        metrics["sync/logprob_gap"] = s.sync_check.last_gap
    maybe_refresh_reference(s)
    move_self_teacher(s)
    s.last_groups = groups
    return metrics
