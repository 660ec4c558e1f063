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
- ``DivergenceWatch``: reward hacking. A run optimises a proxy (a reward model, any reward that is
  not the task's own answer check) and can evaluate a check (held-out accuracy, or a reward function
  the user names). When the check has fallen below its best beyond its noise (the interval's upper
  end under the best value; for a check without an interval, any fall) and is not climbing back
  (its interval's lower end not above its lowest since the best), while the proxy has risen above
  the lowest it has been since that best, for ``divergence_evals`` evaluations in a row, the run
  warns with both curves' numbers; with ``stop_on_divergence`` it stops. Whenever the check reaches
  a new best the model is kept in ``best_model/``.
- ``SyncCheck``: a sampler that holds its own copy of the weights (the asynchronous rollout
  process, a sampling copy in another dtype, a vLLM engine) must sample with the weights being
  trained. After every weight sync the sampler's log-probs of a fixed probe sequence (the first
  training prompt's first ``PROBE_TOKENS`` tokens) are compared with the trainer's; a mean gap
  over the tolerance its dtype allows stops the run (``WeightSyncError``). A sync that silently
  keeps old weights (verl's LoRA sync kept the initial policy) shows once the policy has moved
  past that tolerance on the probe: at once in float32, after some steps in bfloat16. A
  sampling copy with ``sampler_noise`` is different on purpose and is not checked.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from posttrain.models.logprobs import batched_logprobs
from posttrain.models.modeling import right_pad
from posttrain.parallel import distributed, fsdp

WARN_AFTER = 5
"""Consecutive steps without signal before the warning."""

REWARD_WARN_SAMPLES = 256
"""Samples a reward function must have scored before it can be called constant."""

REWARD_FAILURE_SHARE = 0.1
"""Share of failed samples (over at least ``REWARD_WARN_SAMPLES``) that draws the failure warning."""


PROBE_TOKENS = 32
"""Tokens of the probe sequence whose log-probs the weight-sync check compares."""

SYNC_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 1e-2}
BF16_WEIGHTS_TOLERANCE = 0.3
"""The probe gap allowed a sampler whose weights themselves are rounded to bfloat16 (a rollout server: vLLM's
CPU build serves an fp32 checkpoint in bf16). SmolLM2-135M served so measured 0.077-0.123 against its fp32
trainer over a LoRA run's first four syncs (the probe is 31 tokens: a noisy mean); a misnamed load gives
gaps of nats, and a stale one crosses it once the policy has moved that far."""
"""Mean absolute gap of per-token log-probs allowed between a sampler and the trainer computing in this dtype
(the coarser of the two): float32 differs by summation order only (another thread count, another kernel);
bfloat16 keeps 8 bits of mantissa, float16 11."""


class WeightSyncError(RuntimeError):
    """A sampler's log-probs of the probe sequence differ from the trainer's: it samples other weights."""


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


class SyncCheck:
    """Compares a sampler's probe log-probs with the trainer's after each weight sync (module docstring)."""

    def __init__(self, probe_ids: Tensor, *dtypes: torch.dtype) -> None:
        self.probe_ids = probe_ids[:PROBE_TOKENS]
        self.tolerance = max(SYNC_TOLERANCE.get(dtype, SYNC_TOLERANCE[torch.float16]) for dtype in dtypes)
        self.last_gap = 0.0

    @classmethod
    def of(cls, probe_ids: Tensor, policy: nn.Module, sampler: nn.Module | None, generator: object,
           mixed_precision: str, checked: bool) -> SyncCheck | None:
        """The check of a session's sampler (None unless ``checked``), in the dtypes the trainer and the sampler
        compute in (bfloat16 too under mixed_precision bf16); an engine that syncs its own weights (vLLM) gets
        it to check each of its syncs."""
        if not checked:
            return None
        dtypes = [next(model.parameters()).dtype for model in (policy, sampler) if model is not None]
        check = cls(probe_ids, *dtypes, *([torch.bfloat16] if mixed_precision == "bf16" else []))
        if generator.capabilities.syncs_weights:
            generator.sync_check = check
        return check

    def verify(self, trainer: Tensor, sampler: Tensor, what: str, when: str) -> float:
        """[T - 1] log-probs from each side -> their mean absolute gap; raise WeightSyncError over the tolerance.
        ``what``: the sampler; ``when``: which sync (``step 12``)."""
        gap = float((trainer - sampler.to(trainer)).abs().mean()) if trainer.shape == sampler.shape else math.inf
        self.last_gap = gap
        if not gap <= self.tolerance:
            raise WeightSyncError(
                f"{what}: after the weight sync for {when} its log-probs of the probe sequence differ from the "
                f"trainer's by {gap:.3g} per token on average (tolerance {self.tolerance:g}): it is not sampling with "
                "the weights being trained, so the run would train on another policy's samples. The weight "
                "transfer misses or misnames some tensors (LoRA adapters not merged, a renamed layer)")
        return gap


@dataclass
class Divergence:
    """What a :class:`DivergenceWatch` found at one evaluation."""

    streak: int  # evaluations in a row with the check down and the proxy up
    fired: bool  # the streak reached the limit at this evaluation (once per episode)
    new_best: bool  # the check reached a new best (keep this model)


class DivergenceWatch:
    """The check against the proxy at every evaluation (module docstring); its state is JSON-able for a resume."""

    def __init__(self, check: str, proxy: str = "eval/reward", limit: int = 2) -> None:
        self.check, self.proxy, self.limit = check, proxy, limit
        # at the check's best evaluation: its step, check and proxy; then the lowest of each since
        self.best: dict[str, float] | None = None  # {"step", "check", "proxy", "check_low", "proxy_low"}
        self.streak = 0

    def update(self, step: int, metrics: dict[str, float]) -> Divergence | None:
        """Record one evaluation's metrics; None when it logged neither the check nor the proxy."""
        if self.check not in metrics or self.proxy not in metrics:
            return None
        check, proxy = metrics[self.check], metrics[self.proxy]
        best = self.best
        if best is None or check > best["check"]:
            self.best = {"step": step, "check": check, "proxy": proxy, "check_low": check, "proxy_low": proxy}
            self.streak = 0
            return Divergence(0, False, new_best=step > 0)
        # beyond the check's own noise (its interval; a check without one: any change)
        upper, lower = metrics.get(f"{self.check}_high", check), metrics.get(f"{self.check}_low", check)
        fallen = upper < best["check"]
        recovering = lower > best["check_low"]  # the check climbs back: with the proxy, that is learning
        # the proxy climbs: above its lowest since the best (a policy that leaves a reward model's data often
        # scores lower on it first, then climbs as it learns what the reward model pays for)
        diverging = fallen and not recovering and proxy > best["proxy_low"]
        best["check_low"], best["proxy_low"] = min(best["check_low"], check), min(best["proxy_low"], proxy)
        self.streak = self.streak + 1 if diverging else 0
        return Divergence(self.streak, self.streak == self.limit, new_best=False)

    def warning(self, step: int, metrics: dict[str, float]) -> str:
        best = self.best or {}
        return (f"possible reward hacking: {self.proxy} rose to {metrics[self.proxy]:.4g} from its low of "
                f"{best.get('proxy_low', math.nan):.4g} while {self.check} fell from {best.get('check', math.nan):.4g} "
                f"(step {int(best.get('step', 0))}) to {metrics[self.check]:.4g} (step {step}), "
                f"{self.streak} evaluations in a row: the policy is learning what the reward scores, not the task")

    def state_dict(self) -> dict[str, object]:
        return {"best": self.best, "streak": self.streak}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.best, self.streak = state.get("best"), int(state.get("streak", 0))


SELF_TEACHER_PROBE_ROWS = 16
"""Training rows whose privileged context the self-distillation probe scores."""


@dataclass(frozen=True)
class SelfTeacherProbe:
    """Whether a self-distilling teacher reads its privileged context: the mean per-token log-prob of each probed
    row's context, taken as the completion, after the student's prompt and after the teacher's (which holds it).

    A model that uses what is in its context gives the context a higher likelihood once it has read it. One that
    does not (a model without in-context learning) may give it a lower one, and then the teacher is worse than
    the student: on the built-in tiny model, 0.332 -> 0.000 held-out accuracy over a default run (sdft's entry in
    docs/decisions.md). The run says so at its start instead of training toward that teacher silently."""

    student: float
    teacher: float

    @property
    def reads_context(self) -> bool:
        return self.teacher > self.student

    def line(self) -> str:
        said = (f"self-distillation probe: the privileged context's log-prob {self.student:.3f} nats per token after "
                f"the prompt, {self.teacher:.3f} after the teacher's prompt")
        if self.reads_context:
            return said + ": the teacher reads its context"
        return ("warning: " + said + ": the teacher does not read its context, so it is worse than the student, and "
                "distilling from it lowers accuracy; sdft needs a model that learns in context (a larger one), or "
                "another --teacher-prompt-template")


def self_teacher_probe(model: nn.Module, student_prompts: list[Tensor], teacher_prompts: list[Tensor],
                       contexts: list[Tensor], *, pad_id: int) -> SelfTeacherProbe:
    """:class:`SelfTeacherProbe` of ``model`` on the given rows (prompts [n] of 1-D ids, contexts [n] of 1-D ids)."""
    completion_ids, mask = right_pad(contexts, pad_id)
    mask = mask.float()
    means = []
    with torch.no_grad():
        for prompts in (student_prompts, teacher_prompts):
            # on the host, as every caller passes them: batched_logprobs moves each micro-batch to the model
            logprobs, _ = batched_logprobs(model, prompts, completion_ids, mask, pad_id=pad_id,
                                           micro_batch_size=len(prompts))
            means.append(float((logprobs * mask).sum() / mask.sum()))
    return SelfTeacherProbe(*means)
