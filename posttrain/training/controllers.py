"""Coefficients a run adapts from step to step, with their state for an exact resume.

``EntropyControl`` sets the entropy bonus's coefficient of each step from the preset's fields: fixed
(``entropy_coef``), or adapted towards ``entropy_target`` (Skywork-OR1's control,
``F.adaptive_entropy_coef``). The step's coefficient comes from the previous step's measured entropy
(the entropy of the policy on the batch it trained on): Skywork-OR1 measures the entropy of the
batch being trained, which here would cost a forward pass before the update, so the control acts
one step late, a departure its step size of 0.005 makes small.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import posttrain.functional as F
from posttrain.algorithms.presets import OnlineAlgorithm


@dataclass
class EntropyControl:
    coef: float
    """c_k: the adaptive coefficient (the fixed one without a target)."""
    target: float | None = None
    step: float | None = None
    last_entropy: float | None = None
    """The mean token entropy the last step trained at; None before the first step."""

    @classmethod
    def of(cls, alg: OnlineAlgorithm) -> "EntropyControl | None":
        if not alg.entropy_coef and alg.entropy_target is None:
            return None
        return cls(alg.entropy_coef, alg.entropy_target, alg.entropy_coef_step)

    def coefficient(self) -> float:
        """The bonus's weight for this step: c (fixed), or Skywork-OR1's c_k * [e_k <= target]."""
        if self.target is None:
            return self.coef
        if self.last_entropy is None:
            return self.coef  # no measurement yet: the starting c
        self.coef, active = F.adaptive_entropy_coef(self.coef, self.last_entropy, target=self.target, step=self.step)
        return self.coef if active else 0.0

    def record(self, entropy: float) -> None:
        self.last_entropy = entropy

    def state_dict(self) -> dict[str, Any]:
        return {"coef": self.coef, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.coef, self.last_entropy = state["coef"], state["last_entropy"]
