"""What every logged metric means: the name (or pattern) of each key a trainer writes to ``metrics.jsonl``,
its meaning, and when it is logged.

The trainers build their metrics where they compute them (``posttrain.functional``'s losses, the online
step, the preference, SFT and reward-model steps, the evaluations); this table is the one place that says
what they mean. ``docs/reference/metrics.md`` is generated from it, and ``tests/test_reference_docs.py``
runs every trainer kind for a few steps and fails on a logged key that no entry here matches, so the table
cannot fall behind a new metric.

A pattern's ``<...>`` part stands for one name segment chosen at run time: ``reward/<function>`` matches
``reward/correctness``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TRAINERS = ("online", "preference", "sft", "reward_model")
"""The trainer kinds: online RL presets, preference presets, ``--algorithm sft`` and ``--algorithm reward_model``."""


@dataclass(frozen=True)
class MetricEntry:
    pattern: str
    """The key, with ``<...>`` for a segment named at run time."""
    meaning: str
    when: str
    """When it is logged: every step, at evaluations, or under which setting."""
    trainers: tuple[str, ...]
    """The trainer kinds (:data:`TRAINERS`) that log it."""

    def matches(self, name: str) -> bool:
        return _regex(self.pattern).fullmatch(name) is not None


def _regex(pattern: str) -> re.Pattern[str]:
    parts = re.split(r"<[^>]+>", pattern)
    return re.compile(r"[^/]+".join(map(re.escape, parts)))


ALL, ONLINE, PREFERENCE, SFT, REWARD_MODEL = TRAINERS, ("online",), ("preference",), ("sft",), ("reward_model",)
GENERATING = ("online", "preference", "sft")  # the trainers whose model writes completions to evaluate
EVERY_STEP = "every step"
PAIRED_STEPS = "every step: paired preference presets (not KTO) and reward_model"
EVALUATIONS = "at step 0, every `eval_every` steps and at the end"
MOE_STEP = "every step, when the model is a mixture of experts"
PARTIAL_STEP = "every step, with `partial_rollouts`"
EVALUATIONS_WITH_CHECK = EVALUATIONS + ", when the task checks answers (a built-in task)"

GLOSSARY: tuple[MetricEntry, ...] = (
    # --- every trainer -------------------------------------------------------------------------------
    MetricEntry("loss", "The loss the optimizer step minimised (the policy loss plus the KL and value terms the "
                "preset adds; the preference, NLL or Bradley-Terry loss offline).", EVERY_STEP, ALL),
    MetricEntry("lr", "The learning rate of the step, after the schedule.", EVERY_STEP, ALL),
    MetricEntry("grad_norm", "The gradient's norm before clipping (`max_grad_norm`); not finite on a skipped step.",
                EVERY_STEP, ALL),
    MetricEntry("skipped_steps", "1 when the step's gradient norm was not finite and the update was not applied "
                "(`max_bad_steps` in a row stop the run).", EVERY_STEP, ALL),
    MetricEntry("time/step", "Seconds the whole step took (generation, scoring and update; evaluations excluded).",
                EVERY_STEP, ALL),
    MetricEntry("eval/accuracy", "Greedy accuracy on the held-out prompts.", EVALUATIONS_WITH_CHECK, GENERATING),
    MetricEntry("eval/accuracy_low", "Lower end of `eval/accuracy`'s 95% Wilson interval.", EVALUATIONS_WITH_CHECK,
                GENERATING),
    MetricEntry("eval/accuracy_high", "Upper end of `eval/accuracy`'s 95% Wilson interval.", EVALUATIONS_WITH_CHECK,
                GENERATING),
    # --- online: what was sampled --------------------------------------------------------------------
    MetricEntry("reward/mean", "Mean total reward of the step's newly sampled completions (after the preset's "
                "reward shaping).", EVERY_STEP, ONLINE),
    MetricEntry("reward/std", "Standard deviation of that reward over the step's samples.", EVERY_STEP, ONLINE),
    MetricEntry("reward/<function>", "Mean of one reward function's values (unweighted; `None` values left out); "
                "the task's built-in reward is `reward/accuracy`, a reward model `reward/reward_model`.",
                EVERY_STEP, ONLINE),
    MetricEntry("reward/group_length_penalty", "Mean of Kimi k1.5's length penalty over the step's samples "
                "(before its weight): in [-0.5, 0.5], below 0 where the group's longer samples dominate.",
                "every step, with `group_length_penalty`", ONLINE),
    MetricEntry("reward_failures/<function>", "Samples for which that reward function raised or returned no "
                "number, under `reward_errors skip` (their groups leave the update).", EVERY_STEP, ONLINE),
    MetricEntry("accuracy", "Share of the step's samples the task's answer check accepts (online); the share of "
                "training pairs the reward model ranks right (reward_model).",
                "every step; online when the task checks answers", ("online", "reward_model")),
    MetricEntry("completion_length/mean", "Mean completion length of the step's samples, in tokens.", EVERY_STEP,
                ONLINE),
    MetricEntry("completion_length/correct", "Mean length of the samples the answer check accepts.",
                "every step with a correct sample, when the task checks answers", ONLINE),
    MetricEntry("completion_length/incorrect", "Mean length of the samples it rejects: GRPO's length bias shows "
                "as growing incorrect answers.", "every step with an incorrect sample, when the task checks answers",
                ONLINE),
    MetricEntry("truncation_rate", "Share of samples that reached `max_new_tokens` without ending.", EVERY_STEP,
                ONLINE),
    MetricEntry("zero_variance_groups", "Share of sampled groups whose rewards are all equal (all right or all "
                "wrong): their advantages are zero and they carry no gradient.", EVERY_STEP, ONLINE),
    MetricEntry("no_signal_steps", "The current streak of steps with no group that carries a learning signal; "
                "the run warns at 5 and stops at `max_no_signal_steps`.", EVERY_STEP, ONLINE),
    MetricEntry("difficulty/skipped_easy", "Prompts the difficulty filter passed over while the step drew its "
                "prompts because their last pass rate was at or above `difficulty_filter_high`.",
                "every step, with `difficulty_filter_low` or `difficulty_filter_high`", ONLINE),
    MetricEntry("difficulty/skipped_hard", "Prompts it passed over because their last pass rate was at or below "
                "`difficulty_filter_low`.", "every step, with `difficulty_filter_low` or `difficulty_filter_high`",
                ONLINE),
    MetricEntry("difficulty/completions_saved", "Completions not generated for the skipped prompts so far in the "
                "run: skipped prompts x `group_size`.",
                "every step, with `difficulty_filter_low` or `difficulty_filter_high`", ONLINE),
    MetricEntry("difficulty/prior_pass_rate", "Mean pass rate, when last sampled, of the step's prompts that had "
                "been sampled before: the difficulty the filter judged them by.",
                "with a difficulty filter, once a drawn prompt has a pass rate", ONLINE),
    MetricEntry("generation_rounds", "Generation rounds the step took: 1, more when dynamic sampling (DAPO) "
                "refills the batch with groups that carry signal.", EVERY_STEP, ONLINE),
    MetricEntry("groups_trained", "Prompt groups the step trained on, over all processes.", EVERY_STEP, ONLINE),
    MetricEntry("surplus_groups", "Groups with signal sampled beyond the batch, kept for the next step (dynamic "
                "sampling).", EVERY_STEP, ONLINE),
    MetricEntry("staleness/mean", "Mean number of policy versions between the weights that sampled a trained "
                "completion and the policy the step updates (0 unless rollouts are asynchronous).", EVERY_STEP,
                ONLINE),
    MetricEntry("staleness/max", "The largest such gap in the step (never above `max_staleness`).", EVERY_STEP,
                ONLINE),
    MetricEntry("staleness/token_mean", "Mean number of policy versions between the weights that sampled each "
                "trained token and the policy the step updates: below `staleness/mean` (which counts each "
                "completion's oldest token) when partial rollouts continued completions under newer weights.",
                PARTIAL_STEP, ONLINE),
    MetricEntry("staleness/resumed_rows", "Share of the trained completions whose tokens were sampled by more "
                "than one policy version: interrupted by a weight update and continued under the new weights.",
                PARTIAL_STEP, ONLINE),
    MetricEntry("staleness/token_share/<age>", "Share of the trained tokens sampled `<age>` versions behind the "
                "policy the step updates, for every age from 0 to `max_staleness`: the staleness distribution.",
                PARTIAL_STEP, ONLINE),
    MetricEntry("eval/divergence_streak", "The reward-hacking guard: evaluations in a row with the check (held-out "
                "accuracy, or `divergence_check`) below its best beyond its interval while the proxy (`eval/reward`) "
                "stands above its value at that best.", "at evaluations, when the reward is a proxy", ONLINE),
    MetricEntry("eval/diverged", "1 at the evaluation where the guard's streak reached `divergence_evals`: it warned, "
                "and with `stop_on_divergence` stopped the run.", "when the guard fires", ONLINE),
    MetricEntry("sync/logprob_gap", "Mean absolute gap between the sampler's and the trainer's log-probs of a fixed "
                "probe sequence after the last weight sync (a sampling copy, the asynchronous rollout process, a vLLM "
                "engine): about 0 in float32; over the dtype's tolerance the run stops.",
                "every step, when a sampler holds its own weights", ONLINE),
    MetricEntry("time/generation", "Seconds spent sampling (the rollout process's own time when asynchronous).",
                EVERY_STEP, ONLINE),
    MetricEntry("time/rollout_wait", "Seconds the trainer waited for the samples (all of generation when "
                "synchronous).", EVERY_STEP, ONLINE),
    MetricEntry("time/scoring", "Seconds spent computing rewards.", EVERY_STEP, ONLINE),
    MetricEntry("time/training", "Seconds of the training phase: log-probs, advantages and the updates.",
                EVERY_STEP, ONLINE),
    MetricEntry("time/update", "Seconds of the forward, backward and optimizer steps within training.", EVERY_STEP,
                ONLINE),
    # --- online: the update --------------------------------------------------------------------------
    MetricEntry("advantage/mean", "Mean advantage over the completion tokens trained on.", EVERY_STEP, ONLINE),
    MetricEntry("advantage/std", "Standard deviation of the advantages.", EVERY_STEP, ONLINE),
    MetricEntry("advantage/nonzero", "Share of completion tokens with a nonzero advantage (the tokens that carry "
                "signal).", EVERY_STEP, ONLINE),
    MetricEntry("policy_loss", "The clipped policy-gradient term of the loss, without KL or value terms.",
                "every step, for presets with a policy loss (not best_of_n)", ONLINE),
    MetricEntry("entropy", "Mean per-token entropy of the policy's distribution on the sampled tokens, in nats.",
                "every step, for presets with a policy loss", ONLINE),
    MetricEntry("kl", "KL of the policy from the reference, per token (k3 estimator); for KTO, the batch's "
                "KL reference point `z`.", "every step, for presets with a reference model (a KL term, "
                "or KTO)", ("online", "preference")),
    MetricEntry("distill/reverse_kl", "Reverse KL of the student from its teacher at the step's start, per token "
                "(k1: log pi_student - log pi_teacher of the sampled tokens, token mean over the step's "
                "completions); it falls as the student learns the teacher.",
                "every step, for distillation presets (on_policy_distill, multi_teacher_distill, sdft)", ONLINE),
    MetricEntry("distill/reverse_kl/<task>", "`distill/reverse_kl` over one task's completions only, to its own "
                "teacher (`--teachers TASK=MODEL`).",
                "every step, per task with completions in the step, for multi_teacher_distill", ONLINE),
    MetricEntry("clip_fraction", "Share of tokens whose clipped branch is active (for GSPO: tokens in clipped "
                "sequences); 0 while each rollout gets one update.", "every step, for presets with a policy loss",
                ONLINE),
    MetricEntry("dual_clip_fraction", "Share of negative-advantage tokens bounded by the dual clip.",
                "every step, when the preset sets `dual_clip`", ONLINE),
    MetricEntry("zero_gradient_fraction", "Share of tokens with a nonzero advantage but no gradient (dropped by "
                "PPO-style clipping; 0 for CISPO, whose clip bounds a detached weight).",
                "every step, for presets with a policy loss", ONLINE),
    MetricEntry("ratio_mean", "Mean importance ratio between the policy and the policy that sampled (1 on the first "
                "update of a rollout).", "every step, for presets with a policy loss", ONLINE),
    MetricEntry("empty_batch", "1 when the step held no completion token to train on.",
                "every step, for presets with a policy loss", ONLINE),
    MetricEntry("value_loss", "PPO's value-function loss (clipped), before its coefficient.",
                "every step, for presets with a value model (ppo)", ONLINE),
    MetricEntry("value/explained_variance", "How much of the returns' variance the value model explains (1 is "
                "perfect, 0 no better than their mean).", "every step, for presets with a value model", ONLINE),
    MetricEntry("value/value_clip_fraction", "Share of tokens whose value prediction was clipped.",
                "every step, for presets with a value model", ONLINE),
    MetricEntry("mismatch/kl_k1", "KL of the sampler from the trainer on the sampled tokens, per token (k1): "
                "about 1e-13 when posttrain's own decode loop samples the policy.", EVERY_STEP, ONLINE),
    MetricEntry("mismatch/kl_k3", "The same KL by the k3 estimator.", EVERY_STEP, ONLINE),
    MetricEntry("mismatch/ess", "Effective sample size of the sampler-to-trainer importance weights, as a share "
                "(1: no mismatch).", EVERY_STEP, ONLINE),
    MetricEntry("mismatch/truncated_fraction", "Share of tokens (or sequences) whose importance weight "
                "`correction` truncated.", EVERY_STEP, ONLINE),
    MetricEntry("mismatch/masked_fraction", "Share of tokens (or sequences) `correction` masked out.", EVERY_STEP,
                ONLINE),
    # --- a mixture of experts ------------------------------------------------------------------------
    MetricEntry("moe/aux_loss", "The load-balancing loss of the step's training passes (Switch Transformer's, as "
                "transformers computes it: `top_k` when the experts are evenly loaded); added to the loss times the "
                "config's `router_aux_loss_coef` when the config sets `output_router_logits`.", MOE_STEP,
                ("online", "preference")),
    MetricEntry("moe/expert_load_max", "The most loaded expert's share of the token slots times the number of "
                "experts, averaged over layers: 1 when the experts are evenly loaded, E when one takes every token.",
                MOE_STEP, ("online", "preference")),
    MetricEntry("moe/dead_experts", "The share of (layer, expert) pairs that no real token of the step's training "
                "passes was routed to.", MOE_STEP, ("online", "preference")),
    # --- online: multi-turn episodes -----------------------------------------------------------------
    MetricEntry("episode/turns", "Mean policy turns per episode.", "every step, with `tools` or `environment`",
                ONLINE),
    MetricEntry("episode/tool_calls", "Mean tool calls per episode.", "every step, with `tools` or `environment`",
                ONLINE),
    MetricEntry("episode/tool_errors", "Mean faulty tool calls per episode (unknown tool, malformed call, a tool "
                "that raised, hung or returned no text).", "every step, with `tools` or `environment`", ONLINE),
    MetricEntry("episode/tool_errors/<kind>", "The same, for one kind of fault.",
                "every step in which that kind of fault happened", ONLINE),
    MetricEntry("episode/inserted_tokens", "Mean tokens per episode inserted from tool results and environment "
                "observations (context, never trained on).", "every step, with `tools` or `environment`", ONLINE),
    MetricEntry("episode/environment_errors", "Mean episodes ended by an environment that raised.",
                "every step in which an environment raised", ONLINE),
    # --- online: evaluation --------------------------------------------------------------------------
    MetricEntry("eval/reward", "Mean total reward of the greedy completions of the held-out prompts (a reward "
                "model's score, with `reward_model`).", EVALUATIONS, ONLINE),
    MetricEntry("eval/completion_length", "Mean length of the greedy held-out completions, in tokens.",
                EVALUATIONS, ONLINE),
    MetricEntry("eval/<task>/<metric>", "`accuracy` (with `accuracy_low` and `accuracy_high`), `reward` and "
                "`completion_length`, as above, on one of `eval_tasks`.", EVALUATIONS + ", with `eval_tasks`",
                ONLINE),
    MetricEntry("eval/<task>@<variant>/<metric>", "The same, on one of `eval_tasks` asked under one prompt variant "
                "of `eval_prompt_variants`.", EVALUATIONS + ", with `eval_prompt_variants`", ONLINE),
    MetricEntry("eval/<task>/variants_mean", "Greedy accuracy on one of `eval_tasks` averaged over the prompt "
                "variants of `eval_prompt_variants`: whether a skill holds however it is asked.",
                EVALUATIONS + ", with `eval_prompt_variants`", ONLINE),
    MetricEntry("eval/<task>/variants_worst", "The lowest of those accuracies: a gain that holds only under the "
                "training prompt shows here.", EVALUATIONS + ", with `eval_prompt_variants`", ONLINE),
    # --- preference ----------------------------------------------------------------------------------
    MetricEntry("rewards/chosen", "Mean implicit reward of the chosen completions (DPO: beta * (log pi - log "
                "ref); SimPO: beta * mean token log-prob; ORPO: log-odds); the reward model's mean score of "
                "them (reward_model).", PAIRED_STEPS, ("preference", "reward_model")),
    MetricEntry("rewards/rejected", "The same for the rejected completions.", PAIRED_STEPS,
                ("preference", "reward_model")),
    MetricEntry("rewards/margin", "Mean of chosen minus rejected implicit reward.", "every step, paired presets",
                PREFERENCE),
    MetricEntry("rewards/accuracy", "Share of training pairs whose chosen completion has the higher implicit "
                "reward.", "every step, paired presets", PREFERENCE),
    MetricEntry("rewards/desirable", "KTO: mean implicit reward of the desirable examples.",
                "every step, KTO, when the batch holds one", PREFERENCE),
    MetricEntry("rewards/undesirable", "KTO: mean implicit reward of the undesirable examples.",
                "every step, KTO, when the batch holds one", PREFERENCE),
    MetricEntry("logps/chosen", "Mean sequence log-prob of the chosen completions under the policy.",
                "every step, paired presets", PREFERENCE),
    MetricEntry("logps/rejected", "The same for the rejected completions.", "every step, paired presets",
                PREFERENCE),
    MetricEntry("logps/desirable", "KTO: mean sequence log-prob of the desirable examples.",
                "every step, KTO, when the batch holds one", PREFERENCE),
    MetricEntry("logps/undesirable", "KTO: mean sequence log-prob of the undesirable examples.",
                "every step, KTO, when the batch holds one", PREFERENCE),
    MetricEntry("nll", "Mean per-token NLL of the chosen completions (ORPO's term, or `rpo_alpha`'s); of the "
                "trained tokens (sft).", "every step: ORPO, presets with `rpo_alpha`, sft", ("preference", "sft")),
    MetricEntry("odds_ratio_loss", "ORPO's odds-ratio term, before its weight.", "every step, ORPO", PREFERENCE),
    MetricEntry("data/truncated", "Examples in the step cut to `max_length` (the prompt's end and the "
                "completion's start are kept).", EVERY_STEP, ("preference", "sft")),
    MetricEntry("pairs/count", "Pairs built from the policy's own samples in this round.",
                "at each new round, with `pairs_from policy`", PREFERENCE),
    MetricEntry("pairs/sample_accuracy", "Share of the round's samples the task's answer check accepts.",
                "at each new round, with `pairs_from policy`", PREFERENCE),
    MetricEntry("pairs/prompts_with_a_pair", "Share of the round's prompts with both a correct and an incorrect "
                "sample.", "at each new round, with `pairs_from policy`", PREFERENCE),
    MetricEntry("eval/pairwise_accuracy", "Share of held-out pairs ranked right by the implicit reward (ties count "
                "half; 0.5 at step 0 for presets measured against the reference); by the reward model's score "
                "(reward_model).", EVALUATIONS + ", with held-out pairs", ("preference", "reward_model")),
    MetricEntry("eval/reward_margin", "Mean implicit-reward margin on the held-out pairs.",
                EVALUATIONS + ", with held-out pairs", PREFERENCE),
    MetricEntry("eval/logps_chosen", "Mean log-prob of the held-out chosen completions.",
                EVALUATIONS + ", with held-out pairs", PREFERENCE),
    MetricEntry("eval/logps_rejected", "Mean log-prob of the held-out rejected completions.",
                EVALUATIONS + ", with held-out pairs", PREFERENCE),
    # --- sft -----------------------------------------------------------------------------------------
    MetricEntry("tokens", "Tokens trained on in the step (the normaliser of its mean NLL).", EVERY_STEP, SFT),
    MetricEntry("eval/nll", "Mean per-token NLL of the held-out demonstrations.", EVALUATIONS, SFT),
    MetricEntry("eval/perplexity", "exp(`eval/nll`).", EVALUATIONS, SFT),
    # --- reward model --------------------------------------------------------------------------------
    MetricEntry("margin", "Mean score difference, chosen minus rejected, on the step's pairs.", EVERY_STEP,
                REWARD_MODEL),
    MetricEntry("eval/pairwise_accuracy_low", "Lower end of `eval/pairwise_accuracy`'s 95% Wilson interval.",
                EVALUATIONS, REWARD_MODEL),
    MetricEntry("eval/pairwise_accuracy_high", "Upper end of its 95% Wilson interval.", EVALUATIONS, REWARD_MODEL),
    MetricEntry("eval/margin", "Mean score difference on the held-out pairs.", EVALUATIONS, REWARD_MODEL),
    MetricEntry("eval/rewards_chosen", "Mean score of the held-out chosen completions.", EVALUATIONS, REWARD_MODEL),
    MetricEntry("eval/rewards_rejected", "Mean score of the held-out rejected completions.", EVALUATIONS,
                REWARD_MODEL),
    MetricEntry("eval/loss", "Bradley-Terry loss on the held-out pairs.", EVALUATIONS, REWARD_MODEL),
)


def describe(name: str) -> MetricEntry | None:
    """The entry that documents metric ``name``: its exact entry, else the first pattern that matches it."""
    exact = [entry for entry in GLOSSARY if entry.pattern == name]
    return (exact or [entry for entry in GLOSSARY if entry.matches(name)] or [None])[0]
