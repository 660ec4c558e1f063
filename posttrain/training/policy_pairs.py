"""Preference pairs from a policy's own samples, labelled by a built-in task's answer check (or a judge).

The default data of the preference presets on a built-in task (a new round every ``resample_every``
steps, from the policy being trained) and of the reward model (one round, from the starting model):
``group_size`` completions of each prompt are sampled, the task's ``correct`` labels them, and a
prompt's k-th correct completion is chosen over its k-th incorrect one
(``posttrain.data.preference.pairs_from_samples``). A prompt the policy always or never solves gives
no pair, so the pairs hold the mistakes the policy actually makes next to its right answers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from posttrain.algorithms.presets import POLICY_PAIRS_RPO_ALPHA, PreferenceAlgorithm
from posttrain.algorithms.registry import PREFERENCE_LOSSES
from posttrain.config import Config
from posttrain.data.judge import Judge
from posttrain.data.preference import pairs_from_samples
from posttrain.data.prompts import encode_prompt
from posttrain.data.tasks.task import Task
from posttrain.rollout.completions import Generator
from posttrain.rollout.generators import generate_texts
from posttrain.training.guards import NoLearningSignal


def pairs_source(config: Config) -> str:
    """``dataset`` or ``policy``: ``pairs_from`` with ``auto`` resolved (the policy's own samples on a
    built-in task, the given pairs with ``--dataset``)."""
    if config.preference.pairs_from != "auto":
        return config.preference.pairs_from
    return "dataset" if config.data.dataset else "policy"


def with_policy_pairs_defaults(preset: PreferenceAlgorithm, config: Config) -> tuple[PreferenceAlgorithm, str]:
    """The preset a run on pairs of the policy's own samples trains with, and the line that says so: RPO's
    NLL term (``POLICY_PAIRS_RPO_ALPHA``) added unless the user set ``rpo_alpha`` or the loss takes none
    (ORPO's has its NLL already)."""
    what = (f"pairs sampled from the policy: {config.rollout.group_size} completions of each of "
            f"{config.rollout.prompts_per_step * config.preference.resample_every} prompts every "
            f"{config.preference.resample_every} steps, a correct one chosen over an incorrect one")
    if "rpo_alpha" in config.overrides or not PREFERENCE_LOSSES[preset.loss].takes_rpo_alpha:
        return preset, what
    preset = dataclasses.replace(preset, rpo_alpha=POLICY_PAIRS_RPO_ALPHA)
    return preset, (f"{what}; {preset.name}'s loss + {POLICY_PAIRS_RPO_ALPHA} x the chosen completions' per-token "
                    "NLL (RPO; --rpo-alpha 0 for the paper's loss alone)")


def sample_pairs(generator: Generator, tokenizer: Any, source: Task, rows: list[dict[str, Any]], group_size: int,
                 chunk: int, wanted: int | None = None, judge: Judge | None = None,
                 ) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Pairs of ``group_size`` sampled completions of each of ``rows``' prompts, ``chunk`` prompts per
    generation call, and the metrics of the samples drawn. With ``wanted``, sampling stops after the chunk
    that brings the pairs to that many. With a ``judge``, it labels the pairs instead of the answer check
    (:func:`judged_pairs`). No pair at all is a ``NoLearningSignal`` that says what to change."""
    pairs: list[dict[str, Any]] = []
    correct: list[bool] = []
    drawn, agreed, comparable = 0, 0, 0
    for start in range(0, len(rows), chunk):
        part = rows[start:start + chunk]
        texts, _ = generate_texts(generator, tokenizer, [encode_prompt(tokenizer, row["prompt"]) for row in part],
                                  num_samples=group_size, chunk=chunk)
        columns = {key: [row[key] for row in part for _ in range(group_size)] for key in part[0] if key != "prompt"}
        labels = source.correct([row["prompt"] for row in part for _ in range(group_size)], texts, **columns)
        if judge is None:
            pairs += pairs_from_samples(part, texts, labels, group_size)
        else:
            judged, chosen_right = judged_pairs(judge, part, texts, group_size, labels)
            pairs += judged
            comparable += sum(right is not None for right in chosen_right)
            agreed += sum(bool(right) for right in chosen_right)
        correct += labels
        drawn += len(part)
        if wanted is not None and len(pairs) >= wanted:
            break
    accuracy = sum(correct) / len(correct)
    if not pairs:
        how = ("the judge agreed with itself on no pair (each is judged in both orders)" if judge is not None else
               f"none of {drawn} prompts had both a correct and an incorrect completion among its {group_size} "
               "samples")
        raise NoLearningSignal(
            f"pairs from the policy: {how} (sample accuracy {accuracy:.3f}), so there is no pair to learn from; raise "
            "group_size or temperature, or start from a policy that is sometimes right")
    metrics = {"pairs/count": len(pairs), "pairs/sample_accuracy": accuracy,
               "pairs/prompts_with_a_pair": len({str(pair["prompt"]) for pair in pairs}) / drawn}
    if judge is not None and comparable:  # the judge's pairs where the answer check tells the two apart
        metrics["pairs/judge_agrees_with_answer"] = agreed / comparable
    return pairs, metrics


def judged_pairs(judge: Judge, rows: list[dict[str, Any]], texts: list[str], group_size: int,
                 correct: list[bool]) -> tuple[list[dict[str, Any]], list[bool | None]]:
    """Each prompt's samples taken two by two (0 with 1, 2 with 3, ...), identical ones skipped; the judge's
    choice, asked in both orders, is the chosen one, and a pair it does not agree with itself on is dropped.
    Also, per pair kept: whether the chosen one is the right one by ``correct``, or None where both or
    neither are."""
    candidates = []  # (row, index of the first sample, index of the second)
    for i, row in enumerate(rows):
        for j in range(i * group_size, (i + 1) * group_size - 1, 2):
            if texts[j] != texts[j + 1]:
                candidates.append((row, j, j + 1))
    verdicts = judge.prefer([row["prompt"] for row, _, _ in candidates], [texts[a] for _, a, _ in candidates],
                            [texts[b] for _, _, b in candidates])
    pairs, chosen_right = [], []
    for (row, a, b), verdict in zip(candidates, verdicts):
        if verdict is None:
            continue
        chosen, rejected = (a, b) if verdict == 0 else (b, a)
        pairs.append({**row, "chosen": texts[chosen], "rejected": texts[rejected], "score_chosen": 1.0,
                      "score_rejected": 0.0})
        chosen_right.append(None if correct[chosen] == correct[rejected] else correct[chosen])
    return pairs, chosen_right
