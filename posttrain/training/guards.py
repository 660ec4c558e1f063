"""Guards against the silent failures of RL post-training: runs that go on while learning nothing.

Users of other libraries report runs that trained for hours with nothing to learn from. Each
guard here watches one such failure and makes it loud:

- ``SignalWatch``: every group's rewards are all equal, step after step, or the batch the step
  trains on holds no token with a nonzero advantage (best-of-N's selection kept nothing, or only
  groups without variance). The policy gradient is then zero. It warns after
  ``WARN_AFTER`` such steps in a row and stops the run after ``limit`` of them
  (``max_no_signal_steps``), with advice.
- ``UpdateCheck``: an optimizer step that should have moved the weights (the policy's trainable
  tensors hold a finite, non-zero gradient; the learning rate is positive) left all of them as
  they were.
  LoRA adapters that are not in the optimizer, frozen weights, or an update below the
  precision of the weights look like this. That is an error. It is checked at the first such
  step of each process, when it costs one pass over the trainable weights; a wiring fault
  shows there, and later steps pay nothing.
- ``RewardWatch``: a reward function whose values have been one constant over the whole run
  so far, or that failed (NaN, inf, an exception) on many of its samples under
  ``reward_errors=skip``. Each gets one warning per run.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from posttrain.parallel import distributed, fsdp

WARN_AFTER = 5
"""Consecutive steps without signal before the warning."""

REWARD_WARN_SAMPLES = 256
"""Samples a reward function must have scored before it can be called constant."""

REWARD_FAILURE_SHARE = 0.1
"""Share of failed samples (over at least ``REWARD_WARN_SAMPLES``) that draws the failure warning."""


class NoLearningSignal(RuntimeError):
    """The run stopped because nothing could be learned for ``max_no_signal_steps`` steps."""


class WeightsNotUpdated(RuntimeError):
    """An optimizer step that should have changed the policy's weights changed none of them."""


def has_signal(rewards_BG: Tensor) -> Tensor:
    """[B, G] -> [B] True where the group's rewards are not all equal."""
    return (rewards_BG != rewards_BG[:, :1]).any(-1)


def step_has_signal(rewards_BG: Tensor) -> bool:
    """Whether a step's rewards can give any sample an advantage over another: some group has
    variance, or, with one sample per prompt (G = 1), the batch does."""
    if rewards_BG.numel() == 0:
        return False
    if rewards_BG.shape[1] == 1:
        return bool(has_signal(rewards_BG.reshape(1, -1)).any())
    return bool(has_signal(rewards_BG).any())


class SignalWatch:
    """Counts consecutive steps without reward variance; warns, then stops the run at ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit  # 0: never stop
        self.streak = 0

    def update(self, signal: bool, accuracy: float | None = None) -> int:
        """Record one step; returns the current streak of steps without signal."""
        self.streak = 0 if signal else self.streak + 1
        if not self.streak:
            return 0
        seen = f" (training accuracy {accuracy:.3f})" if accuracy is not None else ""
        if self.limit and self.streak >= self.limit:
            raise NoLearningSignal(
                f"every group's rewards were all equal, or the trained batch had no nonzero advantage, for "
                f"{self.streak} steps in a row{seen}: the advantages are zero and nothing is learned. Start from a policy that is sometimes right (a warm start "
                "or easier prompts), raise group_size or temperature, give a denser reward (partial credit, "
                "a format reward), or set max_no_signal_steps 0 to go on regardless"
            )
        if self.streak == WARN_AFTER:
            distributed.say(f"warning: every group's rewards were all equal, or the trained batch had no nonzero "
                            f"advantage, for {self.streak} steps in a row"
                            f"{seen}; nothing is learned from such steps (the run stops after "
                            f"{self.limit or 'no limit of'} of them: max_no_signal_steps)")
        return self.streak


@dataclass
class Snapshot:
    """The trainable weights before an optimizer step: a fingerprint per tensor, and whether any of
    them holds a non-zero gradient for the step to apply."""

    fingerprints: list[tuple[float, float]]
    has_gradient: bool


class UpdateCheck:
    """Checks that the first optimizer step that should move the weights moves some of them."""

    def __init__(self, model: nn.Module, lora: bool) -> None:
        self.model = model
        self.what = "trainable tensors (LoRA adapters)" if lora else "trainable tensors"
        self.done = False

    def before_step(self) -> Snapshot | None:
        """Call with the step's gradients in place; None once the check is done (it costs nothing)."""
        if self.done:
            return None
        params = list(_trainable(self.model))
        gradient = any(p.grad is not None and bool(_local(p.grad).ne(0).any()) for p in params)
        return Snapshot([_fingerprint(p) for p in params], distributed.any_true(gradient))

    def after_step(self, before: Snapshot | None, grad_norm: float, lr: float) -> None:
        """Raise WeightsNotUpdated if the step should have changed the weights and changed none.

        The model's own gradients decide whether it should have (not the optimizer's norm, which
        is 0 when the optimizer holds other tensors than the model computes with); a step skipped
        for a non-finite gradient or taken at learning rate 0 is not expected to change anything."""
        if before is None or not before.has_gradient or not math.isfinite(grad_norm) or lr <= 0:
            return
        self.done = True
        now = [_fingerprint(p) for p in _trainable(self.model)]
        if distributed.any_true(now != before.fingerprints):
            return
        raise WeightsNotUpdated(
            f"an optimizer step at learning rate {lr:.3g} changed none of the policy's {len(now)} {self.what}, "
            "although they had gradients: the optimizer does not update the tensors the model computes with "
            "(was it built before the adapters were added, or over other parameters?), or the update is below "
            "the weights' precision (bfloat16 weights need a larger learning rate, or float32 weights with "
            "mixed_precision bf16)"
        )


class RewardWatch:
    """Per reward function: samples scored, failures, and the range of its values over the run."""

    def __init__(self) -> None:
        self.seen: dict[str, dict[str, float]] = {}
        self.warned: set[tuple[str, str]] = set()

    def update(self, terms: dict[str, Tensor], failures: dict[str, int]) -> None:
        """Record one batch: ``terms`` name -> [N] values (nan where not applicable or failed)."""
        for name, values in terms.items():
            present = values[~values.isnan()]
            stats = self.seen.setdefault(name, {"samples": 0, "values": 0, "failures": 0,
                                                "low": math.inf, "high": -math.inf})
            stats["samples"] += len(values)
            stats["values"] += len(present)
            stats["failures"] += failures.get(name, 0)
            if len(present):
                stats["low"] = min(stats["low"], float(present.min()))
                stats["high"] = max(stats["high"], float(present.max()))
            self._warn(name, stats)

    def _warn(self, name: str, stats: dict[str, float]) -> None:
        if stats["values"] >= REWARD_WARN_SAMPLES and stats["low"] == stats["high"]:
            self._once(name, "constant",
                       f"reward function {name!r} returned {stats['low']:g} for all {int(stats['values'])} "
                       "completions it scored so far: it cannot tell one completion from another, so it adds "
                       "nothing to the advantages (check that it reads the right column and parses the answers)")
        if stats["samples"] >= REWARD_WARN_SAMPLES and stats["failures"] > REWARD_FAILURE_SHARE * stats["samples"]:
            self._once(name, "failures",
                       f"reward function {name!r} failed (NaN, inf or an exception) on {int(stats['failures'])} of "
                       f"{int(stats['samples'])} samples so far; reward_errors=skip drops their groups from the "
                       "update (reward_failures/ in the metrics counts them)")

    def _once(self, name: str, kind: str, message: str) -> None:
        if (name, kind) not in self.warned:
            self.warned.add((name, kind))
            distributed.say(f"warning: {message}")


def _trainable(model: nn.Module) -> Iterable[Tensor]:
    return (p for p in model.parameters() if p.requires_grad)


def _local(tensor: Tensor) -> Tensor:
    """FSDP: this process's shard of a sharded tensor; any other tensor as it is."""
    return tensor.to_local() if fsdp.is_sharded_parameter(tensor) else tensor


def _fingerprint(param: Tensor) -> tuple[float, float]:
    """(sum, norm) in float64: a change of any element changes it, short of an exact cancellation."""
    local = _local(param)
    with torch.no_grad():
        return float(local.sum(dtype=torch.float64)), float(torch.linalg.vector_norm(local, dtype=torch.float64))
