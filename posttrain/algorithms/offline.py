"""The offline presets' records: a preference loss and its coefficients, and a supervised objective.

What a preset is, and the helpers every record shares: :mod:`posttrain.algorithms.records`. Decision 1
there holds here too: a field the record's loss or objective does not use is None, and setting one is
an error that names its owner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from torch import Tensor

import posttrain.functional as F
from posttrain.algorithms.records import (
    _REQUIRED,
    Metrics,
    _choice_problems,
    _field,
    _raise_if_problems,
    _require,
)
from posttrain.algorithms.registry import PREFERENCE_INPUTS, PREFERENCE_LOSSES

PREFERENCE_COEFFICIENTS = ("beta", "label_smoothing", "alpha", "gamma", "lam", "desirable_weight", "undesirable_weight")
"""The PreferenceAlgorithm fields a preference loss may read; those its loss does not declare stay None."""


@dataclass(frozen=True)
class PreferenceAlgorithm:
    """An offline preference-optimisation loss and its coefficients; None = not used by this loss."""

    name: str = _field("Preset name (the key in ALGORITHMS).", _REQUIRED)
    paper: str = _field("The paper that introduced it: title (authors, year) and arXiv URL.", _REQUIRED)
    summary: str = _field("One line: what it changed with respect to its ancestor.", _REQUIRED)
    loss: str = _field("Preference loss (a registered one; posttrain.register_preference_loss adds one): dpo, "
                       "odpo, simpo, orpo or kto.", _REQUIRED)
    beta: float | None = _field("Reward scale (DPO, ODPO, KTO: 0.1; SimPO: 2.0).")
    label_smoothing: float | None = _field("DPO: assumed rate of flipped labels, in [0, 0.5).")
    alpha: float | None = _field("ODPO: offset scale, offset = alpha * log(score_w - score_l).")
    gamma: float | None = _field("SimPO: target reward margin.")
    lam: float | None = _field("ORPO: weight of the odds-ratio term added to the chosen NLL.")
    desirable_weight: float | None = _field("KTO: weight of desirable examples.")
    undesirable_weight: float | None = _field("KTO: weight of undesirable examples.")
    rpo_alpha: float | None = _field("Weight of the chosen completions' per-token NLL added to the loss (RPO, "
                                     "arXiv:2404.19733; TRL's rpo_alpha); KTO: the desirable examples'. Unset: 1 "
                                     "when the pairs are the policy's own samples (pairs_from policy, the default "
                                     "on a built-in task), else off; 0 turns it off; ORPO has its own (lam).")

    @property
    def needs_reference(self) -> bool:
        """A frozen reference model scores the completions (DPO, ODPO, KTO)."""
        return PREFERENCE_LOSSES[self.loss].needs_reference

    @property
    def paired(self) -> bool:
        """Data are (chosen, rejected) pairs; KTO takes single examples labelled desirable or not."""
        return PREFERENCE_LOSSES[self.loss].paired

    @property
    def needs_scores(self) -> bool:
        """Each pair needs the scores of both completions (ODPO's offset)."""
        return "chosen_scores" in PREFERENCE_LOSSES[self.loss].inputs

    def __post_init__(self) -> None:
        problems = _choice_problems(self, {"loss": tuple(PREFERENCE_LOSSES)}, {"loss": "register_preference_loss"})
        if not problems:
            used = PREFERENCE_LOSSES[self.loss].coefficients
            problems += [f"loss={self.loss!r} needs {p}" for p in used if getattr(self, p) is None]
            problems += [f"{p} is not used by loss={self.loss!r} (it uses {', '.join(used) or 'none'}): set it to None"
                         for p in PREFERENCE_COEFFICIENTS if p not in used and getattr(self, p) is not None]
            if not PREFERENCE_LOSSES[self.loss].takes_rpo_alpha and self.rpo_alpha is not None:
                problems.append(f"rpo_alpha: loss={self.loss!r} takes no rpo_alpha (ORPO's loss has its chosen NLL "
                                "already, weighted 1); set rpo_alpha None")
        positive = ("beta", "desirable_weight", "undesirable_weight")
        problems += [f"{p}={getattr(self, p)} must be > 0" for p in positive
                     if getattr(self, p) is not None and not getattr(self, p) > 0]
        problems += [f"{p}={getattr(self, p)} must be >= 0" for p in ("alpha", "gamma", "lam", "rpo_alpha")
                     if getattr(self, p) is not None and getattr(self, p) < 0]
        if self.label_smoothing is not None and not 0 <= self.label_smoothing < 0.5:
            problems.append(f"label_smoothing={self.label_smoothing} must be in [0, 0.5)")
        _raise_if_problems(self, sorted(set(problems), key=problems.index))

    def preference_loss(self, **inputs: Tensor) -> tuple[Tensor, Metrics]:
        """This preset's loss from sequence log-prob sums, keyword arguments named as in F.

        Paired losses: chosen_logps, rejected_logps [B]; DPO/ODPO also ref_chosen_logps,
        ref_rejected_logps [B]; ODPO also chosen_scores, rejected_scores [B]; SimPO/ORPO
        also chosen_lengths, rejected_lengths [B]. KTO: logps, ref_logps, desirable (bool),
        kl_logps, kl_ref_logps [B]. With ``rpo_alpha``: chosen_lengths (KTO: lengths) [B] too.
        Inputs this loss does not use are ignored, so a loop can pass everything it has.
        """
        unknown = sorted(set(inputs) - set(PREFERENCE_INPUTS))
        if unknown:
            raise ValueError(f"{self.name}: unknown input(s) {', '.join(unknown)}; "
                             f"valid: {', '.join(sorted(PREFERENCE_INPUTS))}")
        piece = PREFERENCE_LOSSES[self.loss]
        _require(self.name, f"loss={self.loss!r}", **{n: inputs.get(n) for n in piece.inputs})
        loss_and_metrics = piece.fn(self, **{n: inputs[n] for n in piece.inputs})
        return self._with_nll(loss_and_metrics, inputs) if piece.takes_rpo_alpha else loss_and_metrics

    def _with_nll(self, loss_and_metrics: tuple[Tensor, Metrics], inputs: dict[str, Tensor]) -> tuple[Tensor, Metrics]:
        """The loss plus ``rpo_alpha`` times the chosen (KTO: desirable) completions' per-token NLL."""
        loss, metrics = loss_and_metrics
        if not self.rpo_alpha:
            return loss, metrics
        names = ("chosen_logps", "chosen_lengths") if self.paired else ("logps", "lengths", "desirable")
        _require(self.name, "rpo_alpha", **{n: inputs.get(n) for n in names})
        nll = F.chosen_nll(*(inputs[n] for n in names))
        return loss + self.rpo_alpha * nll, {**metrics, "nll": nll.detach()}


SupervisedObjective = Literal["sft", "reward_model", "gkd"]


@dataclass(frozen=True)
class SupervisedAlgorithm:
    """Training on given targets, with no sampling and no reward: supervised fine-tuning (the NLL of the
    demonstrations' completion or assistant tokens) or a reward model (a scalar head on the language model
    trained with the Bradley-Terry loss to score chosen above rejected). None = not used by this objective."""

    name: str = _field("Preset name (the key in ALGORITHMS).", _REQUIRED)
    paper: str = _field("The paper that introduced it: title (authors, year) and arXiv URL.", _REQUIRED)
    summary: str = _field("One line: what it trains.", _REQUIRED)
    objective: SupervisedObjective = _field("sft (next-token NLL of the targets), reward_model (Bradley-Terry "
                                            "loss on a scalar head) or gkd (generalised JSD to a teacher over the "
                                            "vocabulary, on demonstrations and the student's own samples).", _REQUIRED)
    completion_only_loss: bool | None = _field(
        "SFT: the loss covers only the completion (prompt + completion data) or the assistant turns (messages "
        "data); False: every token. Plain text data has no prompt: every token.")
    center_rewards_coefficient: float | None = _field(
        "Reward model: weight of the mean squared score added to the loss, which keeps scores centred on 0 "
        "(Eisenstein et al., 2023, arXiv:2312.09244; TRL's center_rewards_coefficient); None = off.")
    student_fraction: float | None = _field(
        "GKD: the share of steps that train on the student's own samples of the prompts instead of the "
        "demonstrations (GKD's lambda; 1 = fully on-policy, 0 = supervised KD).")
    jsd_beta: float | None = _field("GKD: beta of the generalised JSD (0: forward KL(teacher || student), 1: "
                                    "reverse KL, 0.5: symmetric).")
    default_learning_rate: float | None = _field(
        "The learning rate of a run that gives none (--learning-rate wins); None = OptimConfig's.")

    def __post_init__(self) -> None:
        problems = _choice_problems(self, {"objective": get_args(SupervisedObjective)}, {})
        owners = {"completion_only_loss": ("sft", "gkd"), "center_rewards_coefficient": ("reward_model",),
                  "student_fraction": ("gkd",), "jsd_beta": ("gkd",)}
        problems += [f"{p} is not used by objective={self.objective!r} (it belongs to {' and '.join(owner)}): set it "
                     "to None" for p, owner in owners.items() if self.objective not in owner and getattr(self, p) is not None]
        problems += [f"objective={self.objective!r} needs {p}" for p, owner in owners.items()
                     if self.objective in owner and p != "center_rewards_coefficient" and getattr(self, p) is None]
        problems += [f"{p}={getattr(self, p)} must lie in [0, 1]" for p in ("student_fraction", "jsd_beta")
                     if getattr(self, p) is not None and not 0 <= getattr(self, p) <= 1]
        if self.center_rewards_coefficient is not None and self.center_rewards_coefficient < 0:
            problems.append(f"center_rewards_coefficient={self.center_rewards_coefficient} must be >= 0")
        _raise_if_problems(self, problems)
