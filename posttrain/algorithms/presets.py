"""The named presets: every method of the lineage as a record of pieces (docs/algorithms.md, "Presets").

`ALGORITHMS` holds them by name; `algorithm(name, **overrides)` returns one with fields replaced, and
`register_algorithm(preset)` adds one. What a preset is, and how it hands its fields to the math:
:mod:`posttrain.algorithms.records`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Sequence
from typing import Any

from posttrain.algorithms.offline import PreferenceAlgorithm, SupervisedAlgorithm
from posttrain.algorithms.records import (
    DESCRIPTIVE_FIELDS,
    OnlineAlgorithm,
    field_help,
    setting_names,
)

__all__ = ["AFTER_THE_SEED", "ALGORITHMS", "DESCRIPTIVE_FIELDS", "OnlineAlgorithm", "POLICY_PAIRS_RPO_ALPHA", "Preset",
           "PreferenceAlgorithm", "SupervisedAlgorithm", "algorithm", "field_help", "register_algorithm",
           "setting_names"]

Preset = OnlineAlgorithm | PreferenceAlgorithm | SupervisedAlgorithm

# Presets (docs/algorithms.md, "Presets"). Unset fields take the defaults above: PPO's
# token-level clipped surrogate with eps 0.2 / 0.2, no KL, one epoch.
_GROUP_NO_KL = dict(advantage="group", kl_placement="none", beta=0.0)
_REWARD_KL = dict(kl_placement="token_reward", kl_estimator="k1", beta=0.01)
_SEQUENCE_KL = dict(kl_placement="sequence_reward", kl_estimator="k1", beta=0.01)
# DeepSeek-V3.2 states no delta for its off-policy mask. On the built-in task with 8 updates per rollout (30 steps,
# seed 0), delta 1e-4 and 1e-3 dropped about a quarter of all completions at every step, half the negative ones,
# as a wrong answer's duplicates later in the rollout have already been pushed down; 1e-2 drops 4-15%, the tail
# that drifted furthest, which is what the mask is for (benchmarks/RESULTS.md)
OFF_POLICY_DELTA = 1e-2
_ONLINE = [
    OnlineAlgorithm(
        "ppo", "Proximal Policy Optimization Algorithms (Schulman et al., 2017) https://arxiv.org/abs/1707.06347; "
        "for LLM RLHF: Training language models to follow instructions with human feedback (Ouyang et al., 2022) "
        "https://arxiv.org/abs/2203.02155",
        "Clipped surrogate with a learned value model and GAE; for LLMs, a per-token k1 KL penalty in the reward.",
        advantage="gae", aggregation="sequence_mean", **_REWARD_KL, value_clip=0.2, gamma=1.0, lam=0.95,
        mini_batches=8, num_epochs=1, update_structure="InstructGPT (arXiv:2203.02155) App. C.4: batches of 512 "
        "episodes, each randomly split into 8 minibatches of 64 and trained on for a single inner epoch"),
    OnlineAlgorithm(
        "remax", "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method for Aligning Large "
        "Language Models (Li et al., 2023) https://arxiv.org/abs/2310.10505",
        "PPO without the value model: the reward of the prompt's greedy decode is the baseline.",
        advantage="greedy_baseline", aggregation="sequence_mean", **_SEQUENCE_KL,
        update_structure="one update per rollout: the paper states no mini-batch count; its REINFORCE estimator "
        "is on-policy, and its code (liziniu/ReMax, run_llama2_7b.sh) trains once per generation batch"),
    OnlineAlgorithm(
        "rloo", "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human Feedback in LLMs "
        "(Ahmadian et al., 2024) https://arxiv.org/abs/2402.14740",
        "PPO without the value model: the baseline is the mean reward of the prompt's other G - 1 samples.",
        advantage="rloo", aggregation="sequence_mean", **_SEQUENCE_KL,
        update_structure="one update per rollout: the paper states no mini-batch or epoch count; its REINFORCE "
        "estimator is on-policy, as is ReMax's, its closest baseline"),
    OnlineAlgorithm(
        "grpo", "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models "
        "(Shao et al., 2024) https://arxiv.org/abs/2402.03300",
        "PPO without the value model: group-normalised rewards as advantages; the KL (k3) moves into the loss.",
        advantage="group", aggregation="sequence_mean", kl_placement="loss", kl_estimator="k3", beta=0.04,
        update_structure="DeepSeekMath (arXiv:2402.03300) sec. 4.2: the policy model only has a single update "
        "following each exploration stage"),
    OnlineAlgorithm(
        "reinforce_pp", "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models "
        "(Hu et al., 2025) https://arxiv.org/abs/2501.03262",
        "PPO without the value model: KL-shaped token returns whitened over the whole batch; rewards clipped.",
        advantage="reinforce_pp", aggregation="token_mean", **_REWARD_KL, reward_clip=10.0, mini_batches=8,
        update_structure="PPO's (InstructGPT: 8 mini-batches, 1 epoch): the paper states no mini-batch count; "
        "REINFORCE++ is PPO's clipped update without the critic"),
    OnlineAlgorithm(
        "reinforce_pp_baseline", "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models "
        "(Hu et al., 2025) https://arxiv.org/abs/2501.03262",
        "REINFORCE++ with the group mean subtracted from each reward before batch whitening (G > 1 per prompt).",
        advantage="reinforce_pp_baseline", aggregation="token_mean", **_REWARD_KL, mini_batches=8,
        update_structure="PPO's (InstructGPT: 8 mini-batches, 1 epoch): the paper states no mini-batch count, "
        "as for reinforce_pp"),
    OnlineAlgorithm(
        "dapo", "DAPO: An Open-Source LLM Reinforcement Learning System at Scale (Yu et al., 2025) "
        "https://arxiv.org/abs/2503.14476",
        "GRPO without KL: clip-higher, token-mean loss, dynamic sampling, soft overlong punishment, +-1 reward.",
        **_GROUP_NO_KL, eps_high=0.28, aggregation="token_mean", dynamic_sampling=True,
        overlong_buffer_ratio=0.2, binary_reward=(-1.0, 1.0), mini_batches=16,
        update_structure="DAPO (arXiv:2503.14476) sec. 4.1: 512 prompts x 16 responses per rollout, mini-batch "
        "512, i.e. 16 gradient updates for each rollout step"),
    OnlineAlgorithm(
        "dr_grpo", "Understanding R1-Zero-Like Training: A Critical Perspective (Liu et al., 2025) "
        "https://arxiv.org/abs/2503.20783",
        "GRPO without its biases: no std division in the advantage, no per-length normalisation, no KL.",
        advantage="group_mean", aggregation="constant", kl_placement="none", beta=0.0, mini_batches=8,
        update_structure="Dr.GRPO (arXiv:2503.20783) Table 6: inner proximal update epoch 1; its code "
        "(sail-sg/understand-r1-zero) trains 128 prompts x 8 responses in mini-batches of 128: 8 updates"),
    OnlineAlgorithm(
        "cispo", "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention (MiniMax, 2025) "
        "https://arxiv.org/abs/2506.13585",
        "GRPO/DAPO clipping the detached IS weight instead of the update: no token loses its gradient.",
        **_GROUP_NO_KL, clip="is_weight", eps_low=None, eps_high=4.0, aggregation="token_mean", mini_batches=16,
        update_structure="MiniMax-M1 (arXiv:2506.13585) sec. 3.1: 16 rounds of off-policy updates per "
        "generation batch",
        # 16 updates per rollout with no lower bound on the weight keep pushing down the tokens of wrong
        # answers: at 1e-4 the built-in task's sampled accuracy fell from 0.17 to 0.03 in four rollouts
        default_learning_rate=3e-5),
    OnlineAlgorithm(
        "gspo", "Group Sequence Policy Optimization (Zheng et al., 2025) https://arxiv.org/abs/2507.18071",
        "GRPO with a length-normalised sequence-level ratio, clipped per sequence; no KL.",
        **_GROUP_NO_KL, ratio="sequence", eps_low=3e-4, eps_high=4e-4, aggregation="sequence_mean",
        mini_batches=4, update_structure="GSPO (arXiv:2507.18071) sec. 5.1: each batch of rollout data is "
        "partitioned into four minibatches for gradient updates"),
    OnlineAlgorithm(
        "gspo_token", "Group Sequence Policy Optimization (Zheng et al., 2025) https://arxiv.org/abs/2507.18071",
        "GSPO as a per-token surrogate whose ratio equals the sequence ratio, so advantages may vary by token.",
        **_GROUP_NO_KL, ratio="sequence_token", eps_low=3e-4, eps_high=4e-4, aggregation="sequence_mean",
        mini_batches=4, update_structure="GSPO's (sec. 5.1, four minibatches); GSPO-token (sec. 4.3) states "
        "no settings of its own"),
    OnlineAlgorithm(
        "best_of_n", "RAFT: Reward rAnked FineTuning for Generative Foundation Model Alignment (Dong et al., 2023) "
        "https://arxiv.org/abs/2304.06767",
        "No policy gradient: fine-tune (NLL) on the highest-reward completion of each prompt.",
        advantage="best_of_n", clip="none", eps_low=None, eps_high=None, aggregation="token_mean", loss="nll",
        skip_ties=True,
        update_structure="one update per rollout: RAFT fine-tunes on each round's selected samples and states no "
        "mini-batch count here; the NLL of the best sample has no ratio to go off-policy with"),
]
_AFTER_THE_SEED = [
    OnlineAlgorithm(
        "sapo", "Soft Adaptive Policy Optimization (Gao et al., 2025) https://arxiv.org/abs/2511.20347",
        "GRPO with the hard clip replaced by a soft gate (4/tau) sigmoid(tau (r - 1)), steeper for A < 0.",
        **_GROUP_NO_KL, clip="sapo", eps_low=None, eps_high=None, tau_pos=1.0, tau_neg=1.05,
        aggregation="sequence_mean", mini_batches=4,
        update_structure="GSPO's four minibatches: SAPO (arXiv:2511.20347) is measured against GSPO and GRPO by the "
        "same team in GSPO's setting, and the text read here states no count of its own"),
    OnlineAlgorithm(
        "dppo", "Rethinking the Trust Region in LLM Reinforcement Learning (Qi et al., 2026) "
        "https://arxiv.org/abs/2602.04879",
        "PPO's ratio band replaced by a bound on how far each token's probability moves from the sampler's (TV).",
        **_GROUP_NO_KL, clip="dppo_tv", eps_low=None, eps_high=None, divergence_bound=0.15, aggregation="constant",
        mini_batches=8,
        update_structure="Dr.GRPO's 8 updates per rollout (sail-sg/understand-r1-zero, the same authors' code base): "
        "DPPO is a trust region for off-policy updates and states no count in the text read here"),
    OnlineAlgorithm(
        "gmpo", "Geometric-Mean Policy Optimization (Zhao et al., 2025) https://arxiv.org/abs/2507.20673",
        "GRPO maximising the geometric mean of the token ratios, clipped per token in log space to (e^-0.4, e^0.4).",
        **_GROUP_NO_KL, clip="geometric", eps_low=1 - math.exp(-0.4), eps_high=math.exp(0.4) - 1,
        aggregation="sequence_mean", mini_batches=8,
        update_structure="GMPO (arXiv:2507.20673) sec. 4.1: 1,024 rollouts per round, 8 updates of batch 128"),
    OnlineAlgorithm(
        "lite_ppo", "Part I: Tricks or Traps? A Deep Dive into RL for LLM Reasoning (Liu et al., 2025) "
        "https://arxiv.org/abs/2508.08221",
        "GRPO's critic-free PPO with two tricks only: group-mean, batch-std advantages and a token-level loss.",
        **{**_GROUP_NO_KL, "advantage": "group_batch_std"}, aggregation="token_mean",
        update_structure="one update per rollout, GRPO's: Lite PPO (arXiv:2508.08221) changes only the advantage's "
        "normalisation and the loss's aggregation"),
    OnlineAlgorithm(
        "gdpo", "GDPO: Group reward-Decoupled Normalization Policy Optimization for Multi-reward RL Optimization "
        "(Liu et al., 2026) https://arxiv.org/abs/2601.05242",
        "GRPO with each reward function normalised within its group before the weighted sum (then over the batch).",
        advantage="gdpo", aggregation="sequence_mean", kl_placement="loss", kl_estimator="k3", beta=0.04,
        update_structure="one update per rollout, GRPO's: GDPO (arXiv:2601.05242) changes only how the rewards "
        "become advantages"),
    OnlineAlgorithm(
        "maxrl", "Maximum Likelihood Reinforcement Learning (Tajwar et al., 2026) https://arxiv.org/abs/2602.02710",
        "GRPO with the group's reward minus its mean divided by the mean (the pass rate), not the std: an unbiased "
        "gradient of the log pass rate, weighing hard prompts by 1/p.",
        advantage="maxrl", aggregation="sequence_mean", kl_placement="loss", kl_estimator="k3", beta=0.04,
        update_structure="one update per rollout, GRPO's: MaxRL (arXiv:2602.02710) changes only the advantage's "
        "normalisation, and the rest is GRPO's here so that the lineage compares the two on the estimator alone"),
    OnlineAlgorithm(
        "clip_cov", "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models (Cui et al., 2025) "
        "https://arxiv.org/abs/2505.22617",
        "GRPO whose few tokens of highest advantage x log-prob covariance get no gradient, holding entropy up.",
        **_GROUP_NO_KL, clip="clip_cov", eps_low=None, eps_high=1.0, cov_fraction=2e-4, cov_bounds=(1.0, 5.0),
        aggregation="token_mean", mini_batches=8,
        update_structure="8 updates per rollout: Cui et al. (arXiv:2505.22617) train several mini-batches per "
        "rollout (the count here is Dr.GRPO's, not read from their recipe); their clip band [0, 2] (no lower bound) "
        "leaves Clip-Cov as the main clip"),
    OnlineAlgorithm(
        "kl_cov", "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models (Cui et al., 2025) "
        "https://arxiv.org/abs/2505.22617",
        "GRPO without a clip whose tokens of highest advantage x log-prob covariance get a |log r| penalty.",
        **_GROUP_NO_KL, clip="kl_cov", eps_low=None, eps_high=None, cov_fraction=2e-3, kl_cov_coef=1.0,
        aggregation="token_mean", mini_batches=8,
        update_structure="8 updates per rollout, as clip_cov (arXiv:2505.22617): the penalty |log r| acts only once "
        "updates have moved the policy off the sampler"),
    OnlineAlgorithm(
        "entropy_control", "Skywork Open Reasoner 1 Technical Report (He et al., 2025) https://arxiv.org/abs/2505.22312",
        "GRPO without KL plus an entropy bonus whose weight is adapted to hold the entropy at a target (0.2).",
        **_GROUP_NO_KL, aggregation="token_mean", entropy_coef=0.0, entropy_target=0.2, entropy_coef_step=0.005,
        update_structure="one update per rollout: Skywork-OR1 (arXiv:2505.22312) finds that more updates per "
        "rollout speed up entropy collapse, and trains on-policy"),
    OnlineAlgorithm(
        "deepseek_v32", "DeepSeek-V3.2: Pushing the Frontier of Open Large Language Models (DeepSeek-AI, 2025) "
        "https://arxiv.org/abs/2512.02556",
        "GRPO as DeepSeek-V3.2 scales it: no std in the advantage, the k3 KL weighted by pi / pi_old (unbiased), "
        "and completions with A < 0 that drifted off the sampler masked out.",
        advantage="group_mean", aggregation="sequence_mean", kl_placement="loss", kl_estimator="k3", beta=0.04,
        kl_importance_weighted=True, off_policy_mask=OFF_POLICY_DELTA, mini_batches=8,
        update_structure="8 updates per rollout: DeepSeek-V3.2 (arXiv:2512.02556) sec. 3.1 splits each rollout "
        "into several mini-batches (its mask exists for the drift that follows) and states no count; 8 is "
        "Dr.GRPO's. The paper states no beta or delta either: beta is GRPO's, delta was measured here"),
    OnlineAlgorithm(
        "on_policy_distill", "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes "
        "(Agarwal et al., 2024) https://arxiv.org/abs/2306.13649",
        "The student samples; each token's advantage is the teacher's minus the student's log-prob (reverse KL); "
        "needs --teacher.",
        advantage="reverse_kl", kl_placement="none", beta=0.0, clip="none", eps_low=None, eps_high=None,
        aggregation="token_mean",
        update_structure="one update per rollout: on-policy distillation (arXiv:2306.13649) trains on the "
        "student's fresh samples, and the per-token advantage needs no ratio to go off-policy with",
        # from a student at 33% held-out accuracy (tiny-addition-base after 240 SFT steps), 250 steps at 1e-4 gained
        # +9 points and at 3e-4 +42; from one at 5%, 1e-3 raised the KL to the teacher (benchmarks/RESULTS.md)
        default_learning_rate=3e-4),
    OnlineAlgorithm(
        "multi_teacher_distill", "MiMo-V2-Flash Technical Report (Xiaomi LLM-Core, 2026) "
        "https://arxiv.org/abs/2601.02780",
        "On-policy distillation from a teacher per task of a mixture (MOPD): each token's advantage is its own "
        "task's teacher's minus the student's log-prob; needs --teachers TASK=MODEL.",
        advantage="reverse_kl", kl_placement="none", beta=0.0, clip="none", eps_low=None, eps_high=None,
        aggregation="token_mean", teacher_per_task=True,
        update_structure="one update per rollout, on_policy_distill's: MOPD (arXiv:2601.02780) is on-policy "
        "distillation with the teacher chosen by the sample's domain",
        # on_policy_distill's rate: the same estimator and update, only the teacher differs by row
        default_learning_rate=3e-4),
    OnlineAlgorithm(
        "sdft", "Self-Distillation Enables Continual Learning (Shenfeld et al., 2026) https://arxiv.org/abs/2601.19897",
        "On-policy distillation whose teacher is the policy itself reading the row's privileged context (a worked "
        "answer) after the prompt, its weights a moving average of the policy's; no --teacher.",
        advantage="reverse_kl", kl_placement="none", beta=0.0, clip="none", eps_low=None, eps_high=None,
        # the paper's loss is (1/T) sum_t of each position's divergence, averaged over the batch (TRL's too)
        aggregation="sequence_mean",
        # the paper's Algorithm 1 moves an EMA teacher after every update; 0.05 is TRL's teacher_update_rate, as
        # the paper's own rate was not found in the text read here (docs/decisions.md)
        self_teacher_ema=0.05,
        update_structure="one update per rollout: SDFT (arXiv:2601.19897, Algorithm 1) samples, takes one gradient "
        "step on the reverse KL to the demonstration-conditioned teacher, then moves the teacher"),
]
_PREFERENCE = [
    PreferenceAlgorithm(
        "dpo", "Direct Preference Optimization: Your Language Model is Secretly a Reward Model "
        "(Rafailov et al., 2023) https://arxiv.org/abs/2305.18290",
        "RLHF without RL: a logistic loss on the policy-vs-reference log-ratio margin of preference pairs.",
        loss="dpo", beta=0.1, label_smoothing=0.0),
    PreferenceAlgorithm(
        "odpo", "Direct Preference Optimization with an Offset (Amini et al., 2024) https://arxiv.org/abs/2402.10571",
        "DPO with an offset: the margin must exceed alpha * log(score_w - score_l).",
        loss="odpo", beta=0.1, alpha=1.0),
    PreferenceAlgorithm(
        "simpo", "SimPO: Simple Preference Optimization with a Reference-Free Reward (Meng et al., 2024) "
        "https://arxiv.org/abs/2405.14734",
        "DPO without the reference: length-normalised log-probs as the reward, with a target margin gamma.",
        loss="simpo", beta=2.0, gamma=1.0),
    PreferenceAlgorithm(
        "orpo", "ORPO: Monolithic Preference Optimization without Reference Model (Hong et al., 2024) "
        "https://arxiv.org/abs/2403.07691",
        "SFT and preference in one loss: chosen NLL + lam * odds-ratio term; no reference model.",
        loss="orpo", lam=0.1),
    PreferenceAlgorithm(
        "ipo", "A General Theoretical Paradigm to Understand Learning from Human Preferences (Azar et al., 2023) "
        "https://arxiv.org/abs/2310.12036",
        "DPO's logistic loss replaced by a squared one: the per-token log-ratio margin regressed to 1 / (2 tau), so "
        "it cannot grow without bound on deterministic preferences.",
        # tau 0.5 (a target of 1 nat per token), not TRL's 0.1 (5 nats per token): on the built-in task's own pairs
        # 0.1 pushed held-out accuracy from 0.386 down to 0.148 by step 50 before it recovered (0.632 at 250);
        # 0.5 rose from the start (0.486 at step 25, 0.598 at 50). The paper fixes no tau for this scale.
        loss="ipo", beta=0.5),
    PreferenceAlgorithm(
        "kto", "KTO: Model Alignment as Prospect Theoretic Optimization (Ethayarajh et al., 2024) "
        "https://arxiv.org/abs/2402.01306",
        "DPO for unpaired data: desirable/undesirable examples against a KL reference point.",
        loss="kto", beta=0.1, desirable_weight=1.0, undesirable_weight=1.0),
]
_INSTRUCT_GPT = ("Training language models to follow instructions with human feedback (Ouyang et al., 2022) "
                 "https://arxiv.org/abs/2203.02155")
_SUPERVISED = [
    SupervisedAlgorithm(
        "sft", _INSTRUCT_GPT, "Supervised fine-tuning: the NLL of demonstrations' completion (assistant) tokens, the "
        "first stage of RLHF.", objective="sft", completion_only_loss=True),
    SupervisedAlgorithm(
        "reward_model", _INSTRUCT_GPT, "A scalar head on the language model trained on preference pairs with the "
        "Bradley-Terry loss -log sigmoid(r_chosen - r_rejected - margin), the second stage of RLHF.",
        objective="reward_model",
        # the built-in default run (the starting model's own pairs, 250 steps) ranks 0.864 of its held-out pairs
        # at 1e-4, 0.876 at 3e-4 and 0.736 at 1e-3, still rising at the end at the two lower rates (decision 88)
        default_learning_rate=3e-4),
    SupervisedAlgorithm(
        "gkd", "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes (Agarwal et al., "
        "2024) https://arxiv.org/abs/2306.13649",
        "Generalised knowledge distillation: the generalised JSD to a teacher (--teacher) over the vocabulary, on "
        "demonstrations and, at a student_fraction of the steps, on the student's own samples.",
        objective="gkd", completion_only_loss=True, student_fraction=0.5, jsd_beta=0.5),
]
ALGORITHMS: dict[str, Preset] = {a.name: a for a in [*_ONLINE, *_AFTER_THE_SEED, *_PREFERENCE, *_SUPERVISED]}
AFTER_THE_SEED = tuple(a.name for a in _AFTER_THE_SEED)
"""The online presets that came after the seed's lineage (GSPO, CISPO): listed in a section of their own."""

POLICY_PAIRS_RPO_ALPHA = 1.0
"""The ``rpo_alpha`` a preference run on a built-in task gets when its pairs are sampled from the policy
(``pairs_from`` auto or policy) and the user set none: the chosen completions' per-token NLL (Iterative
RPO, Pang et al. 2024, arXiv:2404.19733). A preference loss alone on a policy's own pairs can lower the
right answers' likelihood with the wrong ones' (decisions 49 and 87); ``rpo_alpha 0`` gives the paper's
loss alone. ORPO's loss has its NLL already and takes none."""


def _unknown(message: str, name: str, valid: Sequence[str]) -> ValueError:
    close = difflib.get_close_matches(name, valid, n=2)
    hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
    return ValueError(f"{message}.{hint} Valid: {', '.join(valid)}")


def _preset(name: str) -> Preset:
    if name not in ALGORITHMS:
        raise _unknown(f"unknown algorithm {name!r}", name, list(ALGORITHMS))
    return ALGORITHMS[name]


def algorithm(name: str, **overrides: Any) -> Preset:
    """The preset `name` with `overrides` applied (a new frozen object; the registry is unchanged)."""
    preset = _preset(name)
    valid = setting_names(preset)
    for key in overrides:
        if key not in valid:
            raise _unknown(f"unknown field {key!r} for {name!r} ({type(preset).__name__})", key, valid)
    return dataclasses.replace(preset, **overrides)


def register_algorithm(preset: Preset, *, replace: bool = False) -> None:
    """Add ``preset`` to :data:`ALGORITHMS` under its name, so that ``algorithm(name)``, configs and the CLI's
    ``--algorithm`` find it. A name already taken is an error unless ``replace``."""
    if not isinstance(preset, (OnlineAlgorithm, PreferenceAlgorithm, SupervisedAlgorithm)):
        raise TypeError("register_algorithm takes an OnlineAlgorithm, a PreferenceAlgorithm or a SupervisedAlgorithm, "
                        f"got {type(preset).__name__}")
    if preset.name in ALGORITHMS and not replace and ALGORITHMS[preset.name] != preset:
        raise ValueError(f"algorithm {preset.name!r} is already registered; choose another name, or pass replace=True")
    ALGORITHMS[preset.name] = preset
