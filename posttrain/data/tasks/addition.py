"""Addition of 1-3 digit numbers, answered through a column scratchpad.

Prompt ``"47+385="``; the reference completion adds the columns right to
left, the shorter number padded with 0 and an incoming carry written as
``+1``, then gives the sum after ``|``:

    47+385=  ->  7+5=12,4+8+1=13,0+3+1=4|432

Completions run from 7 characters (``3+4=7|7``) to 29 (``999+999``), so
length varies with the problem and with the policy. Each operand's digit
count is drawn uniformly from 1-3, then its value uniformly among numbers
with that many digits (0 counts as one digit). The first ``n_test``
distinct problems drawn form the held-out split, the next ``n_train`` the
training split, so the two are disjoint as strings.

Rewards: ``accuracy`` (1.0 when the text after the last ``|`` is the sum;
the default, weight 1) and ``format`` (1.0 when the completion fully
matches :data:`FORMAT_PATTERN`, syntax only, not arithmetic; available for
shaping, e.g. weight 0.1, but not on by default: the warm-started model
already writes the format).

``column_steps`` is a process reward: one step per scratchpad column, worth
``1 / columns`` when the column is written exactly as the reference writes it
(digits, carry, sum) and 0 otherwise, so a fully right scratchpad earns 1.
The task ``addition-process`` (:func:`make_process_task`) rewards
``accuracy`` plus ``column_steps``: the same problems with the outcome and a
reward at each column.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from posttrain.data.rewards import completion_text, format_reward
from posttrain.data.scoring import StepRewards
from posttrain.data.tasks.task import Task

DELIMITER = "|"
FORMAT_PATTERN = r"\d\+\d(?:\+1)?=\d{1,2}(?:,\d\+\d(?:\+1)?=\d{1,2})*\|\d+"
"""One ``a+b[+1]=s`` step per column, comma separated, then ``|`` and the sum."""


def scratchpad(a: int, b: int) -> str:
    """The reference completion for ``f"{a}+{b}="``."""
    width = max(len(str(a)), len(str(b)))
    digits_a, digits_b = str(a).zfill(width)[::-1], str(b).zfill(width)[::-1]
    steps, carry = [], 0
    for x, y in zip(digits_a, digits_b):
        column = int(x) + int(y) + carry
        steps.append(f"{x}+{y}{'+1' if carry else ''}={column}")
        carry = column // 10
    return ",".join(steps) + DELIMITER + str(a + b)


def final_answer(completion: str) -> str | None:
    """The text after the last ``|``, stripped; None when there is no ``|``."""
    if DELIMITER not in completion:
        return None
    return completion.rsplit(DELIMITER, 1)[1].strip()


def correct(prompts: list, completions: list, answer: list[str], **columns: Any) -> list[bool]:
    """Whether each completion's final answer is exactly the ``answer`` string."""
    return [final_answer(completion_text(c)) == str(gold) for c, gold in zip(completions, answer)]


def accuracy(prompts: list, completions: list, answer: list[str], **columns: Any) -> list[float | None]:
    """1.0 for the right sum after ``|``, 0.0 otherwise (also when ``|`` is missing)."""
    return [float(ok) for ok in correct(prompts, completions, answer)]


def column_steps(prompts: list, completions: list, solution: list[str], **columns: Any) -> list[StepRewards]:
    """A step per written column (the text before ``|``, split at commas), ending at its last character:
    ``1 / len(reference columns)`` when it equals the reference's column at that place, else 0."""
    out = []
    for completion, reference in zip(completions, solution):
        text = completion_text(completion)
        work, reference_columns = text.split(DELIMITER, 1)[0], reference.split(DELIMITER, 1)[0].split(",")
        steps, start = [], 0
        for k, column in enumerate(work.split(",")):
            end = start + len(column)
            if end > start:  # an empty column (",,", or nothing before "|") holds no character to reward
                right = k < len(reference_columns) and column == reference_columns[k]
                steps.append((end, (1.0 if right else 0.0) / len(reference_columns)))
            start = end + 1
        out.append(StepRewards(tuple(steps)))
    return out


def _operand(rng: random.Random) -> int:
    digits = rng.randint(1, 3)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def make_rows(seed: int, n_train: int, n_test: int) -> tuple[list[dict], list[dict]]:
    """Disjoint (train, test) rows: ``prompt``, ``answer`` (the sum, a string), ``solution``."""
    rng = random.Random(seed)
    seen: set[tuple[int, int]] = set()
    rows: list[dict] = []
    while len(rows) < n_test + n_train:
        a, b = _operand(rng), _operand(rng)
        if (a, b) not in seen:
            seen.add((a, b))
            rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b), "solution": scratchpad(a, b)})
    return rows[n_test:], rows[:n_test]


def make_task(seed: int = 0, n_train: int = 20_000, n_test: int = 500) -> Task:
    train, test = make_rows(seed, n_train, n_test)
    return Task(
        name="addition",
        description="1-3 digit addition with a column scratchpad; reward 1 for the right sum after '|'",
        train=train,
        test=test,
        reward_funcs=(accuracy,),
        reward_weights=(1.0,),
        correct=correct,
        max_new_tokens=32,
        final_answer=final_answer,
        default_model="tiny-addition",
    )


def make_process_task(seed: int = 0) -> Task:
    """The addition task rewarded at each scratchpad column too (``accuracy`` + ``column_steps``)."""
    task = make_task(seed)
    return dataclasses.replace(
        task, name="addition-process", reward_funcs=(accuracy, column_steps), reward_weights=(1.0, 1.0),
        description="1-3 digit addition with a column scratchpad; reward 1 for the right sum after '|' and a "
                    "process reward of 1/columns at each right column")


scratchpad_format = format_reward(FORMAT_PATTERN, name="format")
"""Optional shaping reward: 1.0 when a completion is in scratchpad form."""
