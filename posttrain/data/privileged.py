"""The teacher's prompt in self-distillation (SDFT, arXiv:2601.19897): a row's prompt with its privileged context.

The student answers the row's ``prompt``; the teacher, the same model, reads the prompt and the row's privileged
context (a demonstration, a worked answer) joined by ``teacher_prompt_template`` and scores the student's
completion after it. The context comes from one column: ``privileged_column`` when the run names one, else
``solution`` on a built-in task (its worked answer: addition's scratchpad, gsm's expression) and
``privileged_context`` on a dataset, the column TRL's SDFT reads.

A chat prompt keeps its messages; the template fills its last user message (TRL keeps the system messages and
rewrites the last user turn the same way). A context given as chat messages is their contents, one a line.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from posttrain.config.sections import DataConfig
from posttrain.data.images import has_images
from posttrain.data.prompts import DataError, encode_prompt, is_chat

TASK_COLUMN = "solution"
"""A built-in task's worked answer, the default privileged context of a run on a task."""
DATASET_COLUMN = "privileged_context"
"""The default privileged column of a ``--dataset``: the name TRL's SDFT reads."""


def privileged_column(data: DataConfig) -> str:
    """The column a run's teacher reads as privileged context."""
    if data.privileged_column is not None:
        return data.privileged_column
    return DATASET_COLUMN if data.dataset is not None else TASK_COLUMN


def check_privileged_rows(rows: list[dict[str, Any]], column: str, source: str) -> None:
    """A DataError naming the first row without a usable privileged context (absent, None, empty) or with images
    (their teacher pass is not built), before any model loads."""
    for number, row in enumerate(rows, start=1):
        context = row.get(column)
        if context is None or (isinstance(context, (str, list)) and not context):
            found = "has no" if column not in row else "has an empty"
            raise DataError(f"{source}: row {number} {found} {column!r} column, which the self-distilling teacher "
                            f"reads after the prompt (columns: {', '.join(row)}); name the column that holds each "
                            "row's demonstration or worked answer with --privileged-column")
        if has_images(row):
            raise DataError(f"{source}: row {number} has images; self-distillation's teacher pass on image rows is "
                            "not built: train on text rows, or distil from a --teacher model (on_policy_distill)")


def context_text(context: Any) -> str:
    """A privileged context as text: a string as it is, chat messages' contents one a line, else ``str``."""
    if isinstance(context, list) and all(isinstance(m, dict) for m in context):
        return "\n".join(str(m.get("content", "")) for m in context if m.get("content"))
    return context if isinstance(context, str) else str(context)


def teacher_prompt(row: dict[str, Any], column: str, template: str) -> str | list[dict[str, Any]]:
    """The prompt the teacher reads for ``row``: ``template`` with ``{prompt}`` and ``{privileged_context}``
    filled; a chat prompt's last user message is the one filled."""
    context = context_text(row[column])
    prompt = row["prompt"]
    if not is_chat(prompt):
        return template.format(prompt=prompt, privileged_context=context)
    last_user = max((i for i, m in enumerate(prompt) if m.get("role") == "user"), default=len(prompt) - 1)
    message = prompt[last_user]
    filled = {**message, "content": template.format(prompt=message["content"], privileged_context=context)}
    return [*prompt[:last_user], filled, *prompt[last_user + 1:]]


def encode_teacher_prompts(tokenizer: Any, rows: list[dict[str, Any]], data: DataConfig,
                           tools: Sequence[Callable] = ()) -> list[Tensor]:
    """Each row's teacher prompt as token ids, rendered as the student's prompts are (chat template, ``tools``)."""
    column = privileged_column(data)
    return [encode_prompt(tokenizer, teacher_prompt(row, column, data.teacher_prompt_template),
                          f"teacher prompts: row {number}", tools=tools) for number, row in enumerate(rows, start=1)]
