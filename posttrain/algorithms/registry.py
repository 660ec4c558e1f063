"""The registries of the pieces a preset names, and the decorators that add to them.

An online preset names an advantage estimator (``advantage=``) and a policy loss (``loss=``); a
preference preset names a preference loss (``loss=``). Every name is looked up here, so a function a
user registers is a piece like the built-in ones (:mod:`.pieces` registers those with the same
decorators): a preset can name it, ``posttrain.algorithm("grpo", advantage="mine")`` can, and so can
the CLI once ``--plugin FILE.py`` has imported the file that registers it.

One signature per kind of piece (shapes: ``B`` prompts, ``G`` completions each, ``N = B * G`` rows,
``T`` completion tokens):

- **advantage estimator** ``fn(rewards, preset, *, mask, logprobs, ref_logprobs, values, baseline,
  kl_coef)``: ``rewards`` [B, G] (clipped by the preset's ``reward_clip``; a sequence-level
  estimator's already carry the KL when ``kl_placement='sequence_reward'``), the others [N, T] or
  None, ``baseline`` [B] greedy rewards or None, ``kl_coef`` the token reward's KL coefficient; one
  registered with ``takes_step_rewards`` also gets ``step_rewards`` and ``step_ends`` ([N, T], a process
  reward's steps, or None), one registered with ``takes_reward_terms`` gets ``reward_terms`` [B, G, K]
  and ``reward_weights`` [K] (each reward function's values), and one registered with ``needs_teacher``
  gets ``teacher_logprobs`` [N, T] (and the sampler's ``logprobs``, always). It returns the advantages, [B, G] at ``level='sequence'`` (the loop broadcasts
  them over tokens; [N, T] when it was given step rewards) or [N, T] at ``level='token'``, or
  ``(advantages, value_targets)`` when it trains a value model.
- **policy loss** ``fn(logprobs, old_logprobs, advantages, mask, preset, *, ref_logprobs, normalizer,
  max_tokens) -> (loss, metrics)``: token tensors [N, T], advantages [N] or [N, T]; ``normalizer`` is
  the optimizer step's denominator, so micro-batches add up to the step's loss (see
  :func:`posttrain.functional.aggregate`).
- **preference loss** ``fn(preset, **inputs) -> (loss, metrics)``: the sequence log-prob sums and
  other per-example tensors it declares in ``inputs``, named as :mod:`posttrain.functional` names
  them (``chosen_logps``, ``ref_rejected_logps``, ``chosen_lengths``, ...), each [B].

``metrics`` is a dict of 0-dim detached tensors. Registering a name twice is an error unless it is the
same function again (a module imported twice) or ``replace=True``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from torch import Tensor

Fn = TypeVar("Fn", bound=Callable[..., Any])


@dataclass(frozen=True)
class AdvantageEstimator:
    name: str
    fn: Callable[..., Tensor | tuple[Tensor, Tensor | None]]
    level: Literal["sequence", "token"]
    """sequence: one advantage per completion ([B, G]); token: one per token ([N, T])."""
    compares_group: bool
    """It compares a prompt's G completions (G >= 2; dynamic sampling drops groups of equal rewards)."""
    needs_values: bool
    """It needs a value model's per-token values (a value head is trained alongside the policy)."""
    needs_baseline: bool
    """It needs each prompt's greedy completion's reward (one greedy decode per prompt)."""
    takes_step_rewards: bool = False
    """It takes a process reward's step rewards (``step_rewards`` [N, T], ``step_ends`` [N, T] bool, None when
    no reward function gives steps) and returns [N, T] advantages when they are given; an estimator without it
    is refused for a run whose rewards have steps."""
    takes_reward_terms: bool = False
    """It takes each reward function's raw values (``reward_terms`` [B, G, K], NaN where one does not apply) and
    their weights (``reward_weights`` [K]), not only their weighted sum (GDPO)."""
    needs_teacher: bool = False
    """It needs a teacher's log-probs of the sampled tokens (``teacher_logprobs`` [N, T]) and the sampler's own
    (``logprobs``): on-policy distillation. The teacher is ``--teacher MODEL``, or, with the preset's
    ``self_teacher_ema`` (sdft), the policy itself reading the row's privileged context."""


@dataclass(frozen=True)
class PolicyLoss:
    name: str
    fn: Callable[..., tuple[Tensor, dict[str, Tensor]]]
    takes_kl: bool
    """It adds the preset's KL to the reference (``kl_placement='loss'``) itself."""


@dataclass(frozen=True)
class PreferenceLoss:
    name: str
    fn: Callable[..., tuple[Tensor, dict[str, Tensor]]]
    inputs: tuple[str, ...]
    """The tensors it takes, named as in :mod:`posttrain.functional`."""
    coefficients: tuple[str, ...]
    """The preset fields it uses (``beta``, ``gamma``, ...); the preset requires them and rejects the others."""
    takes_rpo_alpha: bool
    """Whether ``rpo_alpha`` (the chosen completions' NLL added to the loss) may be set with it."""

    @property
    def needs_reference(self) -> bool:
        return any(name.startswith(("ref_", "kl_ref")) for name in self.inputs)

    @property
    def paired(self) -> bool:
        return "chosen_logps" in self.inputs


ADVANTAGES: dict[str, AdvantageEstimator] = {}
"""Advantage estimator name -> its function and what it needs."""
POLICY_LOSSES: dict[str, PolicyLoss] = {}
"""Policy loss name -> its function."""
PREFERENCE_LOSSES: dict[str, PreferenceLoss] = {}
"""Preference loss name -> its function, inputs and coefficients."""


def _add(table: dict[str, Any], kind: str, piece: Any, replace: bool) -> None:
    old = table.get(piece.name)
    same = old is not None and (old.fn.__module__, old.fn.__qualname__) == (piece.fn.__module__, piece.fn.__qualname__)
    if old is not None and not (same or replace):
        raise ValueError(f"{kind} {piece.name!r} is already registered (by {old.fn.__module__}.{old.fn.__qualname__}); "
                         "choose another name, or pass replace=True to replace it")
    table[piece.name] = piece


def _check_name(name: Any) -> None:
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"a piece's name must be an identifier such as 'my_estimator', got {name!r}")


def register_advantage(name: str, *, level: Literal["sequence", "token"] = "sequence", compares_group: bool = False,
                       needs_values: bool = False, needs_baseline: bool = False, takes_step_rewards: bool = False,
                       needs_teacher: bool = False, takes_reward_terms: bool = False,
                       replace: bool = False) -> Callable[[Fn], Fn]:
    """Register the decorated function as the advantage estimator ``name`` (signature: module docstring)."""
    _check_name(name)
    if level not in ("sequence", "token"):
        raise ValueError(f"level must be 'sequence' or 'token', got {level!r}")

    def decorator(fn: Fn) -> Fn:
        _add(ADVANTAGES, "advantage estimator", AdvantageEstimator(
            name, fn, level, compares_group, needs_values, needs_baseline, takes_step_rewards, takes_reward_terms,
            needs_teacher), replace)
        return fn

    return decorator


def register_policy_loss(name: str, *, takes_kl: bool = False, replace: bool = False) -> Callable[[Fn], Fn]:
    """Register the decorated function as the policy loss ``name`` (signature: module docstring). With
    ``takes_kl`` it receives ``ref_logprobs`` and adds the preset's KL itself; without, a preset that
    places the KL in the loss is refused."""
    _check_name(name)

    def decorator(fn: Fn) -> Fn:
        _add(POLICY_LOSSES, "policy loss", PolicyLoss(name, fn, takes_kl), replace)
        return fn

    return decorator


def register_preference_loss(name: str, *, inputs: tuple[str, ...], coefficients: tuple[str, ...] = (),
                             takes_rpo_alpha: bool = True, replace: bool = False) -> Callable[[Fn], Fn]:
    """Register the decorated function as the preference loss ``name`` (signature: module docstring).

    ``inputs`` names the tensors it takes (those of :data:`PREFERENCE_INPUTS`); ``coefficients`` the
    :class:`~posttrain.algorithms.presets.PreferenceAlgorithm` fields it reads. A loss with ``ref_``
    inputs gets a reference model; one with ``chosen_logps`` trains on pairs, otherwise on single
    examples labelled ``desirable`` (KTO's data)."""
    _check_name(name)
    unknown = sorted(set(inputs) - set(PREFERENCE_INPUTS))
    if unknown or not inputs:
        raise ValueError(f"preference loss {name!r}: unknown input(s) {', '.join(unknown) or '(none given)'}; "
                         f"valid: {', '.join(PREFERENCE_INPUTS)}")
    if "chosen_logps" not in inputs and "logps" not in inputs:
        raise ValueError(f"preference loss {name!r}: inputs need chosen_logps (pairs) or logps (single examples)")

    def decorator(fn: Fn) -> Fn:
        _add(PREFERENCE_LOSSES, "preference loss", PreferenceLoss(name, fn, tuple(inputs), tuple(coefficients),
                                                                  takes_rpo_alpha), replace)
        return fn

    return decorator


PREFERENCE_INPUTS = {
    "chosen_logps": "[B] sequence log-prob sum of the chosen completion under the policy",
    "rejected_logps": "[B] the same for the rejected completion",
    "ref_chosen_logps": "[B] the chosen completion under the reference model",
    "ref_rejected_logps": "[B] the rejected completion under the reference model",
    "chosen_scores": "[B] the chosen completion's score (ODPO's offset)",
    "rejected_scores": "[B] the rejected completion's score",
    "chosen_lengths": "[B] the chosen completion's token count",
    "rejected_lengths": "[B] the rejected completion's token count",
    "logps": "[B] single examples (KTO): the completion under the policy",
    "ref_logps": "[B] the completion under the reference model",
    "lengths": "[B] the completion's token count",
    "desirable": "[B] bool, the example is desirable",
    "kl_logps": "[B] a mismatched completion under the policy (KTO's KL estimate)",
    "kl_ref_logps": "[B] the mismatched completion under the reference model",
}
"""Every tensor the preference trainer can hand a preference loss, by name."""
