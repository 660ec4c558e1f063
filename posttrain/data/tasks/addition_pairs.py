"""Preference pairs for the addition task, built offline and deterministically.

For each prompt ``"a+b="`` of the addition task's split, the chosen completion
is the correct scratchpad and the rejected one is a plausible wrong scratchpad
with exactly one mistake, carried through consistently to the answer:

- a *slip*: one column's sum written one too high or too low
  (``7+5=13`` for ``7+5=12``), the carry and the answer following from it;
- a *dropped carry*: a column's incoming carry forgotten
  (``4+8=12`` for ``4+8+1=13``), when the problem has a carry to drop.

Either mistake in column ``k`` (0 = units) moves the answer by exactly
``10**k``. The kind (a dropped carry half of the time when there is a carry),
the column and the direction are drawn from ``random.Random(prompt)``, so a
prompt always gets the same pair, whatever the split.

Scores, for ODPO's offset ``alpha * log(score_chosen - score_rejected)``: the
chosen scores 1, the rejected ``-log10|wrong - right|`` = ``-k``, so the
offset ``alpha * log(1 + k)`` is 0 for a units mistake and grows with how far
the answer is off. Unpaired (KTO) data are the same completions, chosen ones
desirable and rejected ones not (``posttrain.data.preference.unpair``).

The held-out pairs come from the addition task's held-out prompts, and the
held-out generation accuracy uses that task's ``correct``.
"""

from __future__ import annotations

import random

from posttrain.data.tasks.addition import DELIMITER
from posttrain.data.tasks.addition import make_task as make_addition_task
from posttrain.data.tasks.task import PreferenceTask


def wrong_scratchpad(a: int, b: int, rng: random.Random) -> tuple[str, int]:
    """A scratchpad for ``a+b`` with one slip or dropped carry, and its (wrong) answer."""
    width = max(len(str(a)), len(str(b)))
    digits = list(zip(str(a).zfill(width)[::-1], str(b).zfill(width)[::-1]))
    carries, carry = [], 0  # the correct incoming carry of each column
    for x, y in digits:
        carries.append(carry)
        carry = (int(x) + int(y) + carry) // 10
    with_carry = [k for k, c in enumerate(carries) if c]
    drop = bool(with_carry) and rng.random() < 0.5
    column = rng.choice(with_carry) if drop else rng.randrange(width)
    steps, carry, wrong = [], 0, 0
    for k, (x, y) in enumerate(digits):
        written_carry = 0 if (drop and k == column) else carry
        value = int(x) + int(y) + written_carry
        if k == column and not drop:  # a slip: one off, staying a possible column sum (0..19)
            value += rng.choice([-1, 1]) if 0 < value < 19 else (1 if value == 0 else -1)
        steps.append(f"{x}+{y}{'+1' if written_carry else ''}={value}")
        wrong += value % 10 * 10**k  # the answer read off the scratchpad, as the model does
        carry = value // 10
    wrong += carry * 10**width
    return ",".join(steps) + DELIMITER + str(wrong), wrong


def pair_row(row: dict) -> dict:
    """The preference pair of one addition row (``prompt``, ``answer``, ``solution``)."""
    a, b = (int(x) for x in row["prompt"].rstrip("=").split("+"))
    rejected, wrong = wrong_scratchpad(a, b, random.Random(row["prompt"]))
    return {
        "prompt": row["prompt"],
        "chosen": row["solution"],
        "rejected": rejected,
        "score_chosen": 1.0,
        "score_rejected": float(-(len(str(abs(wrong - (a + b)))) - 1)),  # -log10|wrong - right| = -k
        "answer": row["answer"],
    }


def make_task(seed: int = 0, n_train: int = 20_000, n_test: int = 500) -> PreferenceTask:
    source = make_addition_task(seed, n_train, n_test)
    return PreferenceTask(
        name="addition",
        description="addition pairs: the correct scratchpad against one with a slip or a dropped carry",
        train=[pair_row(row) for row in source.train],
        test=[pair_row(row) for row in source.test],
        source=source,
    )
