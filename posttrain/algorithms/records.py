"""What a preset is: each algorithm is a frozen record of named pieces.

An online algorithm (`OnlineAlgorithm`) is a choice of advantage estimator,
ratio level, clip scheme, aggregation, KL estimator and placement, sampling
filters and reward shaping; an offline one (`PreferenceAlgorithm`) is a
preference loss and its coefficients; a supervised one (`SupervisedAlgorithm`:
SFT, a Bradley-Terry reward model, GKD) is an objective on given targets, the first
two stages of the RLHF pipeline (both offline records: :mod:`.offline`). The math lives in `posttrain.functional`:
the methods here only hand a preset's fields to it. The named presets are in
:mod:`posttrain.algorithms.presets`. The estimator and the losses a preset names are looked up in
the registries of `posttrain.algorithms.registry` (the built-in ones: `posttrain.algorithms.pieces`),
so a preset can name a piece a user registered.

Decisions where the spec is silent:

1. A field a preset does not use is `None` (GAE's `gamma`/`lam` and
   `value_clip` outside `gae`, the KL estimator without a KL, the coefficients
   of the other preference losses), and setting one is an error rather than a
   silent no-op (so is `beta > 0` with `kl_placement='none'`). Exception:
   `eps_low`/`eps_high` = `None` means unbounded on that side.
2. KL in the reward (token or sequence level) uses `k1`, as the spec defines
   the shaped reward; `k2`/`k3` are for the KL in the loss.
3. `reward_clip` also clips the greedy baseline, so both sides of
   `r - r_greedy` live on the same scale.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch
from torch import Tensor

import posttrain.functional as F
from posttrain.algorithms import pieces  # noqa: F401  (registers the built-in pieces before any preset is built)
from posttrain.algorithms.registry import ADVANTAGES, POLICY_LOSSES, AdvantageEstimator
from posttrain.functional._policy import CLIP_OPTIONS, check_clip_options

Ratio = Literal["token", "sequence", "sequence_token"]
Clip = Literal["ppo", "is_weight", "none", "sapo", "dppo_tv", "dppo_kl", "geometric", "clip_cov", "kl_cov"]
Aggregation = Literal["sequence_mean", "token_mean", "constant"]
KLPlacement = Literal["loss", "token_reward", "sequence_reward", "none"]
KLEstimator = Literal["k1", "k2", "k3"]


def _estimators(**where: Any) -> list[str]:
    """The registered advantage estimators whose attributes equal ``where``."""
    return [name for name, e in ADVANTAGES.items() if all(getattr(e, k) == v for k, v in where.items())]

Metrics = dict[str, Tensor]
_REQUIRED = dataclasses.MISSING


def _field(help: str, default: Any = None) -> Any:
    return field(default=default, metadata={"help": help})


DESCRIPTIVE_FIELDS = ("name", "paper", "summary", "update_structure", "default_learning_rate")
"""Fields that say what a preset is; they are not settings, and no config or flag overrides them."""


def field_help(cls: type | object) -> dict[str, str]:
    """Setting name -> its one-line help, for the CLI (a preset class or instance)."""
    return {f.name: f.metadata["help"] for f in dataclasses.fields(cls) if f.name not in DESCRIPTIVE_FIELDS}


def setting_names(cls: type | object) -> list[str]:
    """The fields of a preset class or instance that a config may override."""
    return list(field_help(cls))


_PLUGIN_HINT = "; posttrain.{} adds one (from the CLI: --plugin FILE.py imports the file that registers it)"


def _choice_problems(obj: object, choices: dict[str, tuple], registered_by: dict[str, str]) -> list[str]:
    return [f"{name}={getattr(obj, name)!r} is not one of {', '.join(map(repr, valid))}"
            + (_PLUGIN_HINT.format(registered_by[name]) if name in registered_by else "")
            for name, valid in choices.items() if getattr(obj, name) not in valid]


def _raise_if_problems(obj: Any, problems: list[str]) -> None:
    if problems:
        raise ValueError(f"invalid {type(obj).__name__} {obj.name!r}: " + "; ".join(problems))


def _require(who: str, why: str, **tensors: Tensor | None) -> None:
    missing = [name for name, value in tensors.items() if value is None]
    if missing:
        raise ValueError(f"{who}: {why} needs {', '.join(missing)}")


def _with_returns(result: Tensor | tuple[Tensor, Tensor | None]) -> tuple[Tensor, Tensor | None]:
    """An estimator's result as (advantages, value targets or None)."""
    return result if isinstance(result, tuple) else (result, None)


@dataclass(frozen=True)
class OnlineAlgorithm:
    """An online RL algorithm (generate, score, update) as a choice of pieces."""

    name: str = _field("Preset name (the key in ALGORITHMS).", _REQUIRED)
    paper: str = _field("The paper that introduced it: title (authors, year) and arXiv URL.", _REQUIRED)
    summary: str = _field("One line: what it changed with respect to its ancestor.", _REQUIRED)
    advantage: str = _field("Advantage estimator (a registered one; posttrain.register_advantage adds one): gae, greedy_baseline (ReMax), rloo, group (GRPO), group_mean "
                                  "(Dr.GRPO), reinforce_pp, reinforce_pp_baseline, best_of_n.", _REQUIRED)
    ratio: Ratio = _field("Importance ratio: token (PPO), sequence (GSPO) or sequence_token (GSPO-token).", "token")
    clip: Clip = _field("ppo (clipped surrogate), is_weight (CISPO: clip the detached IS weight), none, sapo (SAPO's "
                        "soft gate), dppo_tv / dppo_kl (DPPO's divergence mask), geometric (GMPO), clip_cov or "
                        "kl_cov (Cui et al. 2025).", "ppo")
    eps_low: float | None = _field("Lower clip bound 1 - eps_low; None = unbounded below.", 0.2)
    eps_high: float | None = _field("Upper clip bound 1 + eps_high (DAPO's clip-higher: 0.28); None = unbounded.", 0.2)
    dual_clip: float | None = _field("Dual-clip c > 1 bounding losses of negative advantages (verl: 3); None = off.")
    tau_pos: float | None = _field("SAPO's gate temperature for A > 0 (paper: 1.0); clip='sapo' only.")
    tau_neg: float | None = _field("SAPO's gate temperature for A <= 0 (paper: 1.05; above tau_pos it damps them "
                                   "faster); clip='sapo' only.")
    divergence_bound: float | None = _field("DPPO: how far a token's probability may move from the sampler's in "
                                            "its advantage's direction and keep its gradient (Binary-TV: 0.15, "
                                            "Binary-KL: 0.05); clip='dppo_tv'/'dppo_kl' only.")
    cov_fraction: float | None = _field("Clip-Cov / KL-Cov: share of tokens picked by their advantage x log-prob "
                                        "covariance (Cui et al. 2025: 2e-4 / 2e-3).")
    cov_bounds: tuple[float, float] | None = _field("Clip-Cov: the covariance band (lower, upper) its tokens are "
                                                    "drawn from (paper: (1, 5)).")
    kl_cov_coef: float | None = _field("KL-Cov: weight of |log r| on its picked tokens (paper: 1).")
    off_policy_mask: float | None = _field("DeepSeek-V3.2's off-policy sequence mask (arXiv:2512.02556): a completion "
                                           "with A < 0 whose mean log pi_old - log pi exceeds this delta leaves the "
                                           "loss; None = off.")
    kl_importance_weighted: bool = _field("Weight the KL-in-loss term by pi / pi_old (DeepSeek-V3.2's unbiased KL "
                                          "for samples of the old policy); kl_placement='loss' only.", False)
    aggregation: Aggregation = _field("Token losses to one number: sequence_mean, token_mean (over the optimizer "
                                      "step) or constant (sum / max_tokens, Dr.GRPO).", "sequence_mean")
    loss: str = _field("Policy loss (a registered one; posttrain.register_policy_loss adds one): policy (the "
                       "clipped surrogate) or nll (likelihood; best_of_n only).", "policy")
    kl_placement: KLPlacement = _field("Where the KL to the reference goes: loss (GRPO), token_reward (PPO, "
                                       "REINFORCE++), sequence_reward (RLOO, ReMax) or none.", "none")
    kl_estimator: KLEstimator | None = _field("k1, k2 or k3 (Schulman 2020); k1 in a reward; None without a KL.")
    beta: float = _field("KL coefficient; 0 = no KL term, no reference model.", 0.0)
    num_epochs: int = _field("Passes over each rollout (PPO epochs, GRPO's mu).", 1)
    mini_batches: int = _field("Optimizer steps per pass: the rollout is split into this many mini-batches "
                               "(InstructGPT's PPO: 8, DAPO: 16, GSPO: 4). Several make updates off-policy, "
                               "which is where the clip schemes act.", 1)
    value_clip: float | None = _field("Value-loss clip range around the old values (gae only); None = unclipped.")
    gamma: float | None = _field("GAE discount (gae only).")
    lam: float | None = _field("GAE lambda (gae only).")
    reward_clip: float | None = _field("Clip rewards to [-reward_clip, reward_clip] (REINFORCE++: 10); None = off.")
    binary_reward: tuple[float, float] | None = _field("(incorrect, correct) reward for a task's correctness "
                                                       "(DAPO: (-1, 1)); None = the task's reward.")
    dynamic_sampling: bool = _field("Drop groups with all-equal rewards, generate until the batch is full (DAPO).",
                                    False)
    max_generation_rounds: int = _field("Generation rounds per step with dynamic sampling (DAPO's "
                                        "max_num_gen_batches).", 3)
    overlong_buffer_ratio: float | None = _field("DAPO's soft overlong punishment, L_cache / L_max (paper: 4096 / "
                                                 "20480 = 0.2); None = off.")
    overlong_filter: bool = _field("Mask truncated completions out of the loss (DAPO's overlong filtering).", False)
    history_resampling: bool = _field("Skip prompts solved by every completion in the previous epoch (SRPO, "
                                      "https://arxiv.org/abs/2504.14286).", False)
    min_reward: float | None = _field("best_of_n: skip prompts whose best reward is below; None = keep all.")
    skip_ties: bool = _field("best_of_n: skip prompts whose completions all have the same reward (none is better "
                             "than another; with a 0/1 reward, a group without a right answer would train on a "
                             "wrong one).", False)
    eps: float = _field("Added to the std in group normalisation and whitening.", 1e-6)
    task_reward_weight: float | None = _field("On-policy distillation (advantage reverse_kl): weight of the task "
                                              "reward's group-normalised advantage added to each token's "
                                              "teacher-minus-student log-prob; None = distillation alone.")
    self_teacher_ema: float | None = _field("Self-distillation (SDFT, advantage reverse_kl): the teacher is the policy "
                                            "itself reading each row's privileged context after its prompt (data's "
                                            "privileged_column, teacher_prompt_template), no --teacher; its weights "
                                            "move this far toward the policy's after each step: 0 = the starting "
                                            "weights, 1 = the current ones. None = a --teacher model reading the "
                                            "student's prompt.")
    teacher_per_task: bool = _field("Multi-teacher distillation (advantage reverse_kl): each row is scored by its "
                                    "own task's teacher (--teachers TASK=MODEL; the task: data's task_column), "
                                    "not one --teacher.", False)
    entropy_coef: float = _field("Weight c of the entropy bonus -c * H in the loss (aggregated like the policy term); "
                                 "with entropy_target, its starting value. 0 = no bonus.", 0.0)
    entropy_target: float | None = _field("Adaptive entropy control (Skywork-OR1, arXiv:2505.22312): c rises by "
                                          "entropy_coef_step while the entropy is below this target and falls while "
                                          "above, and the bonus acts only below it. None = c fixed.")
    entropy_coef_step: float | None = _field("The adaptive control's step for c (Skywork-OR1: 0.005); with "
                                             "entropy_target only.")
    update_structure: str = _field("Where mini_batches x num_epochs come from: the paper's words, or why another "
                                   "paper's when it states none.", "")
    default_learning_rate: float | None = _field(
        "The learning rate of a run that gives none (--learning-rate wins); None = OptimConfig's. Set where the "
        "papers' update structure needs a smaller one than the default on the built-in task, chosen by "
        "benchmarks/lr_sweep.py (figures: benchmarks/RESULTS.md).")

    @property
    def needs_reference(self) -> bool:
        """A frozen reference model must score the samples (a KL term with beta > 0)."""
        return self.beta > 0 and self.kl_placement != "none"

    @property
    def needs_old_logprobs(self) -> bool:
        """The sampling policy's log-probs must be recorded at generation.

        With one update per rollout they equal the updated policy's detached log-probs
        (its own forward pass gives them); several epochs or mini-batches move the policy away, and
        dynamic sampling carries surplus groups to the next step, one policy later.
        """
        return self.num_epochs > 1 or self.mini_batches > 1 or self.dynamic_sampling

    @property
    def takes_reward_terms(self) -> bool:
        """Its advantages read each reward function's values (GDPO), not only their weighted sum."""
        return ADVANTAGES[self.advantage].takes_reward_terms

    @property
    def needs_teacher(self) -> bool:
        """A teacher scores the samples (on-policy distillation: ``--teacher MODEL``, or the policy itself)."""
        return ADVANTAGES[self.advantage].needs_teacher

    @property
    def teaches_itself(self) -> bool:
        """The teacher is the policy (a moving average of its weights) given the row's privileged context (SDFT)."""
        return self.self_teacher_ema is not None

    @property
    def needs_teacher_model(self) -> bool:
        """The run loads a separate teacher model (``--teacher MODEL``)."""
        return self.needs_teacher and not self.teaches_itself and not self.teacher_per_task

    @property
    def needs_value_model(self) -> bool:
        """A value head is trained alongside the policy (GAE)."""
        return ADVANTAGES[self.advantage].needs_values

    @property
    def needs_greedy_baseline(self) -> bool:
        """Each prompt needs one greedy decode, scored, as the baseline (ReMax)."""
        return ADVANTAGES[self.advantage].needs_baseline

    @property
    def is_group_estimator(self) -> bool:
        """The advantage compares the G completions of a prompt, so G >= 2 is required."""
        return ADVANTAGES[self.advantage].compares_group

    @property
    def trains_on_best_only(self) -> bool:
        """Only each group's selected best completion trains (best-of-N, RAFT): the others leave the batch."""
        return self.advantage == "best_of_n"

    def __post_init__(self) -> None:
        for name in ("binary_reward", "cov_bounds"):
            if isinstance(getattr(self, name), list):  # YAML gives lists
                object.__setattr__(self, name, tuple(getattr(self, name)))
        choices = {"advantage": tuple(ADVANTAGES), "ratio": get_args(Ratio), "clip": get_args(Clip),
                   "aggregation": get_args(Aggregation), "loss": tuple(POLICY_LOSSES),
                   "kl_placement": get_args(KLPlacement), "kl_estimator": (*get_args(KLEstimator), None)}
        registered_by = {"advantage": "register_advantage", "loss": "register_policy_loss"}
        _raise_if_problems(self, _choice_problems(self, choices, registered_by) or self._problems())

    def _problems(self) -> list[str]:
        a, kl, br, est = self.advantage, self.kl_placement, self.binary_reward, self.kl_estimator
        token_level, sequence_level, group = (_estimators(level="token"), _estimators(level="sequence"),
                                              _estimators(compares_group=True))
        gae_ok = self.gamma is not None and self.lam is not None and 0 < self.gamma <= 1 and 0 <= self.lam <= 1
        rules = [
            (self.eps < 0, f"eps={self.eps} must be >= 0"),
            (self.eps_low is not None and not 0 <= self.eps_low < 1,
             f"eps_low={self.eps_low} must be in [0, 1) (the lower bound is 1 - eps_low); None = no lower bound"),
            (self.eps_high is not None and self.eps_high < 0, f"eps_high={self.eps_high} must be >= 0 or None"),
            (self.dual_clip is not None and not self.dual_clip > 1, f"dual_clip={self.dual_clip} must be > 1 or None"),
            (self.dual_clip is not None and self.clip != "ppo", "dual_clip applies to clip='ppo' only"),
            (self.ratio != "token" and self.clip != "ppo", f"ratio={self.ratio!r} (GSPO) needs clip='ppo'"),
            (self.beta < 0, f"beta={self.beta} must be >= 0"),
            (self.num_epochs < 1, f"num_epochs={self.num_epochs} must be >= 1"),
            (self.mini_batches < 1, f"mini_batches={self.mini_batches} must be >= 1"),
            (self.max_generation_rounds < 1, f"max_generation_rounds={self.max_generation_rounds} must be >= 1"),
            (self.overlong_buffer_ratio is not None and not 0 < self.overlong_buffer_ratio <= 1,
             f"overlong_buffer_ratio={self.overlong_buffer_ratio} must be in (0, 1] (DAPO: 0.2) or None"),
            (self.reward_clip is not None and not self.reward_clip > 0, f"reward_clip={self.reward_clip} must be > 0"),
            (br is not None and not (len(br) == 2 and br[0] < br[1]),
             f"binary_reward={br} must be (incorrect, correct) with incorrect < correct, e.g. (-1.0, 1.0)"),
            (kl != "none" and est is None, f"kl_placement={kl!r} needs a kl_estimator: 'k1', 'k2' or 'k3'"),
            (kl.endswith("_reward") and est not in (None, "k1"),
             f"kl_placement={kl!r} uses kl_estimator='k1'; for k2/k3 use kl_placement='loss'"),
            (kl == "none" and self.beta > 0,
             f"beta={self.beta} does nothing with kl_placement='none': set beta=0.0 or choose a kl_placement"),
            (kl == "token_reward" and a not in token_level, f"kl_placement='token_reward' needs a token-level "
             f"estimator ({', '.join(token_level)}); with {a!r} use 'sequence_reward' or 'loss'"),
            (kl == "sequence_reward" and a not in sequence_level, f"kl_placement='sequence_reward' needs a "
             f"sequence-level estimator ({', '.join(sequence_level)}); with {a!r} use 'token_reward' or 'loss'"),
            (kl == "loss" and not POLICY_LOSSES[self.loss].takes_kl,
             f"loss={self.loss!r} does not add a KL term: use another kl_placement, or a policy loss that takes it"),
            ((a == "best_of_n") != (self.loss == "nll"), "advantage='best_of_n' and loss='nll' go together"),
            (self.loss == "nll" and kl != "none", "loss='nll' (best_of_n) takes no KL: set kl_placement='none'"),
            (a == "gae" and not gae_ok, f"advantage='gae' needs gamma in (0, 1] and lam in [0, 1] (PPO: 1.0, "
             f"0.95), got {self.gamma}, {self.lam}"),
            (a != "gae" and (self.gamma, self.lam, self.value_clip) != (None, None, None),
             f"gamma, lam and value_clip belong to advantage='gae'; set them to None for {a!r}"),
            (self.value_clip is not None and not self.value_clip > 0, f"value_clip={self.value_clip} must be > 0"),
            (self.min_reward is not None and a != "best_of_n", "min_reward applies to advantage='best_of_n' only"),
            (self.skip_ties and a != "best_of_n", "skip_ties applies to advantage='best_of_n' only"),
            (self.entropy_coef < 0, f"entropy_coef={self.entropy_coef} must be >= 0"),
            (self.off_policy_mask is not None and self.off_policy_mask < 0,
             f"off_policy_mask={self.off_policy_mask} must be >= 0 (a mean log-ratio) or None"),
            (self.kl_importance_weighted and kl != "loss", "kl_importance_weighted weights the KL in the loss: it "
             "needs kl_placement='loss'"),
            (self.task_reward_weight is not None and not ADVANTAGES[a].needs_teacher,
             f"task_reward_weight belongs to a distillation estimator (reverse_kl); set it to None for {a!r}"),
            (self.task_reward_weight is not None and self.task_reward_weight < 0,
             f"task_reward_weight={self.task_reward_weight} must be >= 0"),
            (self.self_teacher_ema is not None and not ADVANTAGES[a].needs_teacher,
             f"self_teacher_ema belongs to a distillation estimator (reverse_kl); set it to None for {a!r}"),
            (self.self_teacher_ema is not None and not 0 <= self.self_teacher_ema <= 1,
             f"self_teacher_ema={self.self_teacher_ema} must be in [0, 1] (0: the starting weights, 1: the current "
             "ones) or None"),
            (self.teacher_per_task and not ADVANTAGES[a].needs_teacher,
             f"teacher_per_task belongs to a distillation estimator (reverse_kl); set it to false for {a!r}"),
            (self.teacher_per_task and self.self_teacher_ema is not None,
             "teacher_per_task loads a teacher model per task and self_teacher_ema makes the policy its own "
             "teacher: set one of them (self_teacher_ema none, or teacher_per_task false)"),
            ((self.entropy_target is None) != (self.entropy_coef_step is None),
             "entropy_target and entropy_coef_step go together (adaptive entropy control), or both None"),
            (self.entropy_target is not None and not self.entropy_target > 0,
             f"entropy_target={self.entropy_target} must be > 0 (nats per token)"),
            (self.entropy_coef_step is not None and not self.entropy_coef_step > 0,
             f"entropy_coef_step={self.entropy_coef_step} must be > 0"),
            (self.dynamic_sampling and a not in group, "dynamic_sampling drops groups with equal rewards, "
             f"which carry no signal only for a group estimator ({', '.join(group)})"),
        ]
        return [message for broken, message in rules if broken] + self._clip_problems()

    @property
    def clip_options(self) -> dict[str, Any]:
        """The settings this preset's clip scheme takes (``F.policy_loss``'s ``clip_options``)."""
        return {name: getattr(self, name) for name in CLIP_OPTIONS.get(self.clip, ())}

    def _clip_problems(self) -> list[str]:
        needed = CLIP_OPTIONS.get(self.clip, ())
        owners = {name: [c for c, names in CLIP_OPTIONS.items() if name in names]
                  for names in CLIP_OPTIONS.values() for name in names}
        problems = [f"{name} belongs to clip={' or '.join(map(repr, clips))}; set it to None for clip={self.clip!r}"
                    for name, clips in owners.items() if name not in needed and getattr(self, name) is not None]
        problems += [f"clip={self.clip!r} needs {name}" for name in needed if getattr(self, name) is None]
        if not problems and needed:
            try:
                check_clip_options(self.clip, self.clip_options)
            except ValueError as e:
                problems.append(str(e))
        return sorted(set(problems), key=problems.index)

    def advantages_and_returns(
        self, rewards: Tensor, *, mask: Tensor | None = None, logprobs: Tensor | None = None,
        ref_logprobs: Tensor | None = None, values: Tensor | None = None, baseline: Tensor | None = None,
        step_rewards: Tensor | None = None, step_ends: Tensor | None = None, teacher_logprobs: Tensor | None = None,
        reward_terms: Tensor | None = None, reward_weights: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """This preset's advantages and, for `gae`, the value targets.

        rewards [B, G]: one scalar per completion (G completions of each of B prompts);
        mask, logprobs, ref_logprobs, values [N, T] with N = B * G, row b * G + g;
        baseline [B]: greedy-decode rewards (`greedy_baseline`);
        step_rewards [N, T], step_ends [N, T] bool: a process reward's steps (the reward of the step
        ending at token t), for the estimators registered with ``takes_step_rewards``;
        teacher_logprobs [N, T]: a teacher's log-probs, for those registered with ``needs_teacher``;
        reward_terms [B, G, K], reward_weights [K]: each reward function's values and weight, for those
        registered with ``takes_reward_terms``.
        Returns (advantages, returns). Sequence estimators and best_of_n give [B, G]
        when mask is None, else [N, T] (broadcast, 0 at padding); token estimators,
        and any estimator given step rewards, need mask and give [N, T]. returns is
        F.gae's A + V (before the advantages are whitened) for `gae`, else None.
        """
        if rewards.dim() != 2:
            raise ValueError(f"{self.name}: rewards must be [B, G] (B prompts x G completions), "
                             f"got shape {tuple(rewards.shape)}")
        if self.reward_clip is not None:  # REINFORCE++: rewards clipped to [-10, 10]
            rewards = rewards.clamp(-self.reward_clip, self.reward_clip)
            baseline = None if baseline is None else baseline.clamp(-self.reward_clip, self.reward_clip)
        estimator = ADVANTAGES[self.advantage]
        if estimator.needs_baseline:
            _require(self.name, f"advantage={self.advantage!r}", baseline=baseline)
        steps: dict[str, Tensor] = {}  # the estimator's extra inputs: steps, reward terms, a teacher's log-probs
        if step_rewards is not None:
            if not estimator.takes_step_rewards:
                takers = _estimators(takes_step_rewards=True)
                raise ValueError(f"{self.name}: a reward gave step rewards (a process reward), which "
                                 f"advantage={self.advantage!r} does not take; estimators that do: {', '.join(takers)}")
            _require(self.name, "step rewards", mask=mask, step_ends=step_ends)
            steps = {"step_rewards": step_rewards, "step_ends": step_ends}
        if estimator.takes_reward_terms:
            _require(self.name, f"advantage={self.advantage!r}", reward_terms=reward_terms, reward_weights=reward_weights)
            steps.update(reward_terms=reward_terms, reward_weights=reward_weights)
        if estimator.needs_teacher:
            _require(self.name, f"advantage={self.advantage!r}", mask=mask, logprobs=logprobs,
                     teacher_logprobs=teacher_logprobs)
            steps["teacher_logprobs"] = teacher_logprobs
        if estimator.level == "token":
            return self._token_advantages(estimator, rewards, mask, logprobs, ref_logprobs, values, baseline, steps)
        if self.kl_placement == "sequence_reward" and self.beta > 0:  # r_i - beta * sum_t k1[i, t]
            _require(self.name, "KL in the sequence reward", mask=mask, logprobs=logprobs, ref_logprobs=ref_logprobs)
            kl = F.kl_estimate(logprobs, ref_logprobs, "k1").masked_fill(~mask.bool(), 0.0)
            rewards = rewards - self.beta * kl.sum(-1).view_as(rewards)
        advantages, returns = _with_returns(estimator.fn(
            rewards, self, mask=mask, logprobs=logprobs, ref_logprobs=ref_logprobs, values=values, baseline=baseline,
            kl_coef=0.0, **steps))
        if "step_rewards" in steps:  # process supervision: one advantage per token
            if advantages.shape != mask.shape:
                raise ValueError(f"{self.name}: advantage estimator {self.advantage!r} given step rewards returned "
                                 f"shape {tuple(advantages.shape)}; it must return [N, T] = {tuple(mask.shape)}")
            return advantages, returns
        if advantages.shape != rewards.shape:
            raise ValueError(f"{self.name}: advantage estimator {self.advantage!r} (level='sequence') returned shape "
                             f"{tuple(advantages.shape)}; it must return [B, G] = {tuple(rewards.shape)}")
        if mask is None:
            return advantages, returns
        if advantages.numel() != mask.shape[0]:
            raise ValueError(f"{self.name}: mask has {mask.shape[0]} rows but rewards hold "
                             f"{advantages.numel()} completions; mask must be [B * G, T]")
        return torch.where(mask.bool(), advantages.reshape(-1, 1), 0.0), returns

    def _token_advantages(self, estimator: AdvantageEstimator, rewards: Tensor, mask: Tensor | None,
                          logprobs: Tensor | None, ref_logprobs: Tensor | None, values: Tensor | None,
                          baseline: Tensor | None, steps: dict[str, Tensor]) -> tuple[Tensor, Tensor | None]:
        kl_coef = self.beta if self.kl_placement == "token_reward" else 0.0
        needed = {"mask": mask, **({"logprobs": logprobs, "ref_logprobs": ref_logprobs} if kl_coef > 0 else {}),
                  **({"values": values} if estimator.needs_values else {})}
        _require(self.name, f"advantage={self.advantage!r}", **needed)
        if kl_coef == 0 and not estimator.needs_teacher:  # no KL in the reward: the log-probs do not enter
            logprobs = ref_logprobs = torch.zeros(mask.shape, dtype=rewards.dtype, device=rewards.device)
        advantages, returns = _with_returns(estimator.fn(
            rewards, self, mask=mask, logprobs=logprobs, ref_logprobs=ref_logprobs, values=values, baseline=baseline,
            kl_coef=kl_coef, **steps))
        if advantages.shape != mask.shape:
            raise ValueError(f"{self.name}: advantage estimator {self.advantage!r} (level='token') returned shape "
                             f"{tuple(advantages.shape)}; it must return [N, T] = {tuple(mask.shape)}")
        return advantages, returns

    def advantages(self, rewards: Tensor, **kwargs: Tensor | None) -> Tensor:
        """The advantages of `advantages_and_returns` (same arguments)."""
        return self.advantages_and_returns(rewards, **kwargs)[0]

    def policy_loss(
        self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
        ref_logprobs: Tensor | None = None, *, normalizer: float | Tensor | None = None,
        max_tokens: int | None = None,
    ) -> tuple[Tensor, Metrics]:
        """This preset's registered policy loss (F.policy_loss with its pieces; F.nll_loss for best_of_n).

        logprobs, old_logprobs, mask, ref_logprobs [N, T]; advantages [N] or [N, T].
        The KL enters only with kl_placement='loss' (then ref_logprobs is needed).
        normalizer: the optimizer step's denominator; max_tokens: for 'constant'.
        For best_of_n the loss covers the tokens of completions with advantage > 0.
        """
        if self.kl_placement == "loss" and self.beta > 0:
            _require(self.name, "KL in the loss", ref_logprobs=ref_logprobs)
        return POLICY_LOSSES[self.loss].fn(logprobs, old_logprobs, advantages, mask, self, ref_logprobs=ref_logprobs,
                                           normalizer=normalizer, max_tokens=max_tokens)

    def value_loss(
        self, values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *,
        normalizer: float | Tensor | None = None, max_tokens: int | None = None,
    ) -> tuple[Tensor, Metrics]:
        """F.value_loss with this preset's value_clip and aggregation; all inputs [N, T]."""
        if not self.needs_value_model:
            raise ValueError(f"{self.name}: advantage={self.advantage!r} has no value model; "
                             "value_loss is for advantage='gae'")
        return F.value_loss(values, old_values, returns, mask, clip=self.value_clip, aggregation=self.aggregation,
                            normalizer=normalizer, max_tokens=max_tokens)
