"""Preference data: the columns users already have (TRL's), checked, rendered, tokenized, truncated.

Two formats, from a JSONL/JSON/Parquet/CSV file, a directory or ``hf:NAME`` (``posttrain.data.prompts.read_rows``):

- pairs: ``prompt``, ``chosen``, ``rejected``; ODPO also ``score_chosen`` > ``score_rejected``;
- unpaired (KTO): ``prompt``, ``completion``, ``label`` (true = desirable).

A pair dataset given to an unpaired preset is unpaired (as TRL's
``unpair_preference_dataset``): each pair gives ``(prompt, chosen, true)`` and
``(prompt, rejected, false)``. Held-out data are always pairs (pairwise
accuracy compares a chosen with its rejected completion, KTO's included).

Each text is a string or a list of chat messages (``{"role", "content"}``).
Conversational rows follow TRL: the prompt is rendered with the chat template
and the generation prompt; the completion is what the template adds for the
assistant messages (render prompt + completion, remove the prompt's rendering).
String prompts are tokenized with the tokenizer's special tokens (BOS), as
generation sees them; completions without, then EOS is appended unless they
already end with it.

Images (a vision-language model's rows): an ``images`` column as in online data
(``posttrain.data.images``), the prompt chat messages with one ``{"type": "image"}``
part per image, rendered and tokenized by the model's processor; the image inputs
go with every completion of the example.

Truncation rule (``max_prompt_length`` < ``max_length``, in tokens): a prompt
longer than ``max_prompt_length`` keeps its END (its last tokens, nearest the
answer); then each completion keeps its START, up to ``max_length`` minus the
prompt's length. An example with anything cut is counted as truncated. A prompt
with images is never cut (its image tokens stand for its images).

Every problem with a row is a ``DataError`` naming the source, the 1-based row
number and the field.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from posttrain.data.images import (
    IMAGE_COLUMNS,
    dataset_directory,
    encode_row_prompt,
    has_images,
    processor_of,
    resolve_image_paths,
)
from posttrain.data.prompts import (
    DataError,
    HubSplits,
    encode_prompt,
    is_chat,
    read_rows,
    require_chat_template,
)
from posttrain.data.tasks.task import PreferenceTask

PAIR_COLUMNS = ("chosen", "rejected")
UNPAIRED_COLUMNS = ("completion",)
SCORE_COLUMNS = ("score_chosen", "score_rejected")


def _addition_pairs(seed: int) -> PreferenceTask:
    from posttrain.data.tasks import addition_pairs

    return addition_pairs.make_task(seed)


PREFERENCE_TASKS: dict[str, Callable[[int], PreferenceTask]] = {"addition": _addition_pairs}
"""``--task`` name -> builder taking the split seed, for the preference presets."""


def preference_task(name: str, seed: int = 0) -> PreferenceTask:
    if name not in PREFERENCE_TASKS:
        raise ValueError(f"unknown preference task {name!r}; valid: {', '.join(sorted(PREFERENCE_TASKS))}")
    return PREFERENCE_TASKS[name](seed)


# --- checking ------------------------------------------------------------------------------


def is_paired(rows: list[dict[str, Any]]) -> bool:
    return bool(rows) and "chosen" in rows[0]


def check_rows(rows: list[dict[str, Any]], source: str, *, paired: bool, needs_scores: bool = False) -> None:
    """Raise DataError at the first unusable row: a missing or empty field, a bad label or scores."""
    if not rows:
        raise DataError(f"{source}: the dataset has no rows")
    for number, row in enumerate(rows, start=1):
        where = f"{source}: row {number}"
        for name in ("prompt", *(PAIR_COLUMNS if paired else UNPAIRED_COLUMNS)):
            _check_text(row, name, where)
            if name != "prompt" and is_chat(row["prompt"]) != is_chat(row[name]):
                raise DataError(f"{where}: 'prompt' and {name!r} must both be strings or both be lists of "
                                "chat messages")
        if not paired:
            label = row.get("label")
            if label is None:
                raise DataError(f"{where} has no 'label' (true for a desirable completion, false otherwise)")
            if not (isinstance(label, bool) or label in (0, 1)):
                raise DataError(f"{where}: 'label' must be true or false, got {label!r}")
        if needs_scores:
            _check_scores(row, where)


def _check_text(row: dict[str, Any], name: str, where: str) -> None:
    value = row.get(name)
    if value is None:
        raise DataError(f"{where} has no {name!r} (columns: {', '.join(row)})")
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: {name!r} is empty")
        return
    if not isinstance(value, list) or not all(isinstance(m, dict) and "content" in m for m in value):
        raise DataError(f"{where}: {name!r} must be a string or a list of {{'role', 'content'}} messages")
    if not value or not any(str(m["content"]).strip() for m in value):
        raise DataError(f"{where}: {name!r} is empty")


def _check_scores(row: dict[str, Any], where: str) -> None:
    for name in SCORE_COLUMNS:
        value = row.get(name)
        if value is None:
            raise DataError(f"{where} has no {name!r}: ODPO's offset needs score_chosen and score_rejected")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise DataError(f"{where}: {name!r} must be a finite number, got {value!r}")
    if not row["score_chosen"] > row["score_rejected"]:
        raise DataError(f"{where}: ODPO needs score_chosen > score_rejected, got {row['score_chosen']} <= "
                        f"{row['score_rejected']}; swap chosen and rejected, or drop the row")


MARGIN_COLUMN = "margin"
"""A reward model's optional per-pair column (TRL's name): how much higher the chosen must score (Llama 2)."""


def pair_margins(rows: list[dict[str, Any]], source: str) -> list[float] | None:
    """Each pair's ``margin``, or None when no row has one. Once any row has the column every row needs a
    finite number there: a DataError names the first row that does not."""
    if not any(MARGIN_COLUMN in row for row in rows):
        return None
    for number, row in enumerate(rows, start=1):
        value = row.get(MARGIN_COLUMN)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise DataError(f"{source}: row {number}: {MARGIN_COLUMN!r} must be a finite number (how much higher "
                            f"the chosen must score), got {value!r}; other rows have one, so every row needs one")
    return [float(row[MARGIN_COLUMN]) for row in rows]


def pairs_from_samples(rows: list[dict[str, Any]], texts: list[str], correct: list[bool],
                       group_size: int) -> list[dict[str, Any]]:
    """Preference pairs from ``group_size`` sampled completions of each row's prompt (row ``i``'s are
    ``texts[i*G:(i+1)*G]``): its k-th correct completion is chosen over its k-th incorrect one, so a
    prompt gives min(#correct, #incorrect) pairs and one the policy always (or never) solves gives
    none. Scores are 1 and 0, as the answer check gives them (ODPO's offset ``alpha * log(1 - 0)`` is
    then 0). The row's other columns are kept."""
    pairs = []
    for i, row in enumerate(rows):
        group = range(i * group_size, (i + 1) * group_size)
        right = [texts[j] for j in group if correct[j]]
        wrong = [texts[j] for j in group if not correct[j]]
        for chosen, rejected in zip(right, wrong):
            pairs.append({**row, "chosen": chosen, "rejected": rejected, "score_chosen": 1.0, "score_rejected": 0.0})
    return pairs


def unpair(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Pairs -> KTO rows: ``(prompt, chosen, true)`` then ``(prompt, rejected, false)`` for each pair."""
    return [{"prompt": row["prompt"], "completion": row[name], "label": name == "chosen",
             **{column: row[column] for column in IMAGE_COLUMNS if column in row}}
            for row in rows for name in PAIR_COLUMNS]


def load_rows(dataset: str | None, eval_dataset: str | None, task: str | None, *, paired: bool, needs_scores: bool,
              hub: HubSplits = HubSplits()) -> tuple[list[dict], list[dict], PreferenceTask | None]:
    """Checked (train, held-out) rows of ``dataset`` (else the built-in ``task``); held-out rows are pairs.

    The training rows are unpaired when the preset is (pairs given to KTO are unpaired after checking).
    """
    if dataset is not None:
        train, source = read_rows(dataset, hub.config, hub.split), dataset
        test = read_rows(eval_dataset, hub.config, hub.eval_split) if eval_dataset else []
        resolve_image_paths(train, dataset_directory(dataset), dataset)
        if test:
            resolve_image_paths(test, dataset_directory(eval_dataset), eval_dataset)
        built_in = None
    else:
        built_in = preference_task(task)
        train, test, source = built_in.train, built_in.test, f"task {task}"
        eval_dataset = f"task {task} (held-out)"
    given_pairs = paired or is_paired(train)
    check_rows(train, source, paired=given_pairs, needs_scores=needs_scores and given_pairs)
    if test:
        check_rows(test, eval_dataset, paired=True, needs_scores=needs_scores)
    return (train if paired or not given_pairs else unpair(train)), test, built_in


# --- tokenizing ----------------------------------------------------------------------------


@dataclass
class PreferenceExamples:
    """``N`` tokenized examples, each a prompt with ``K`` completions: (chosen, rejected) or (completion,)."""

    rows: list[dict[str, Any]]  # [N] the source rows
    prompt_ids: list[Tensor]  # [N] each [P_i]
    completion_ids: list[list[Tensor]]  # [K][N] each [T_ki], EOS included unless truncated
    scores: Tensor | None  # [2, N] (score_chosen, score_rejected), ODPO
    desirable: Tensor | None  # [N] bool, unpaired data
    truncated: Tensor  # [N] bool: prompt or a completion was cut
    images: list[dict[str, Tensor] | None] | None = None  # [N] a prompt's image inputs (None: it has none)

    def __len__(self) -> int:
        return len(self.prompt_ids)


def truncate(prompt: list[int], completions: list[list[int]], *, max_length: int,
             max_prompt_length: int) -> tuple[list[int], list[list[int]], bool]:
    """The module's rule: the prompt keeps its last ``max_prompt_length`` tokens, each completion its
    first ``max_length - len(prompt)``; also whether anything was cut."""
    kept_prompt = prompt[-max_prompt_length:]
    room = max_length - len(kept_prompt)
    kept = [c[:room] for c in completions]
    cut = len(kept_prompt) < len(prompt) or any(len(k) < len(c) for k, c in zip(kept, completions))
    return kept_prompt, kept, cut


def prompt_token_ids(tokenizer: Any, prompts: list[Any], source: str = "preference data") -> list[list[int]]:
    """Token ids of each prompt, as ``posttrain.data.prompts.encode_prompt`` gives them (strings in one batch call)."""
    texts = [p for p in prompts if not is_chat(p)]
    encoded = iter(tokenizer(texts)["input_ids"] if texts else [])
    return [encode_prompt(tokenizer, p, f"{source}: row {number}").tolist() if is_chat(p) else next(encoded)
            for number, p in enumerate(prompts, start=1)]


def completion_text(tokenizer: Any, prompt: Any, completion: Any, where: str) -> str:
    """A completion as text; chat messages are what the template adds after the prompt (TRL), rendered by a
    vision-language model's processor where the model has one (its template renders image parts)."""
    if not is_chat(prompt):
        return completion
    renderer = processor_of(tokenizer)
    if renderer is None or not getattr(renderer, "chat_template", None):
        require_chat_template(tokenizer, where)
        renderer = tokenizer
    prompt_text = renderer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    full = renderer.apply_chat_template(prompt + completion, tokenize=False)
    if not full.startswith(prompt_text):
        raise DataError(f"{where}: the chat template renders the prompt differently when a completion "
                        "follows, so the completion cannot be cut off it; give strings instead")
    return full[len(prompt_text):]


def completion_token_ids(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of each completion text, without special tokens, EOS-terminated."""
    eos = tokenizer.eos_token_id
    return [ids if ids and ids[-1] == eos else ids + [eos]
            for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def encode(rows: list[dict[str, Any]], tokenizer: Any, *, paired: bool, with_scores: bool, max_length: int,
           max_prompt_length: int, source: str = "data") -> PreferenceExamples:
    """Tokenize and truncate checked rows (see the module docstring for the rules)."""
    columns = PAIR_COLUMNS if paired else UNPAIRED_COLUMNS
    prompts, images = prompt_token_ids(tokenizer, [row["prompt"] for row in rows], source), None
    if any(has_images(row) for row in rows):
        encoded = [encode_row_prompt(tokenizer, row, f"{source}: row {number}")
                   for number, row in enumerate(rows, start=1)]
        prompts, images = [ids.tolist() for ids, _ in encoded], [inputs for _, inputs in encoded]
    texts = [[completion_text(tokenizer, row["prompt"], row[name], f"{source}: row {number}")
              for number, row in enumerate(rows, start=1)] for name in columns]
    completions = [completion_token_ids(tokenizer, column) for column in texts]  # [K][N]
    prompt_ids: list[Tensor] = []
    completion_ids: list[list[Tensor]] = [[] for _ in columns]
    truncated = []
    for i, prompt in enumerate(prompts):
        if images is not None and images[i] is not None:  # cutting its image tokens would orphan its images
            _fits_whole(len(prompt), max_length, f"{source}: row {i + 1}")
        prompt, ids, cut = truncate(prompt, [column[i] for column in completions], max_length=max_length,
                                    max_prompt_length=max_prompt_length if images is None or images[i] is None
                                    else len(prompt))
        prompt_ids.append(torch.tensor(prompt, dtype=torch.long))
        for k, completion in enumerate(ids):
            completion_ids[k].append(torch.tensor(completion, dtype=torch.long))
        truncated.append(cut)
    scores = torch.tensor([[float(row[name]) for row in rows] for name in SCORE_COLUMNS]) if with_scores else None
    desirable = None if paired else torch.tensor([bool(row["label"]) for row in rows])
    return PreferenceExamples(rows, prompt_ids, completion_ids, scores, desirable,
                              torch.tensor(truncated, dtype=torch.bool), images)


def _fits_whole(prompt_length: int, max_length: int, where: str) -> None:
    """A prompt with images is kept whole (its image tokens stand for its images); it must leave room for a
    completion token."""
    if prompt_length >= max_length:
        raise DataError(f"{where}: the prompt with its image tokens is {prompt_length} tokens, and max_length is "
                        f"{max_length}; a prompt with images is never cut, so raise --max-length or use smaller images")
