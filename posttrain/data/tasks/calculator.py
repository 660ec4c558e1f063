"""``--task calculator``: addition of two 3-digit numbers, with a calculator the policy may call.

A completion either answers at once (``579``) or calls the tool (``[calc 123+456]``), reads the
inserted result (``=579;``) and answers (``579``): a multi-turn episode in the ``inline`` tool format.
The reward and the correctness check read the final answer, the text after the last ``;`` (the whole
completion without a call), so a call is worth exactly what the answer written after it is worth.

The built-in starting model (``tiny-calculator``) is warm-started on solutions of both kinds, most of
them direct answers, which a model this small gets wrong far more often than a copied calculator
result: it starts out using the tool sometimes, and RL has to find out that the tool pays.
"""

from __future__ import annotations

import random
import re
from typing import Any

from posttrain.data.tasks.task import Task

TOOL_SHARE = 0.3
"""Share of the warm start's solutions that call the calculator."""
CALL = re.compile(r"^(\d+)([+*-])(\d+)$")


def calc(expression: str) -> str:
    """The value of ``A+B``, ``A-B`` or ``A*B`` for whole numbers A and B."""
    match = CALL.match(expression.strip())
    if match is None:
        raise ValueError(f"not A+B, A-B or A*B: {expression!r}")
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


def final_answer(completion: str) -> str | None:
    """The text after the last ``;`` (a tool result's end), else the whole completion; None when empty."""
    answer = completion.rsplit(";", 1)[-1].strip()
    return answer or None


def correct(prompts: list, completions: list, answer: list[str], **columns: Any) -> list[bool]:
    return [final_answer(c) == a for c, a in zip(completions, answer)]


def accuracy(prompts: list, completions: list, answer: list[str], **columns: Any) -> list[float]:
    """1.0 for the right sum as the final answer, 0.0 otherwise."""
    return [float(ok) for ok in correct(prompts, completions, answer)]


def make_rows(seed: int, n_train: int, n_test: int) -> tuple[list[dict], list[dict]]:
    """Disjoint (train, test) rows: ``prompt`` (``A+B=``), ``answer``, and the warm start's ``solution``."""
    rng = random.Random(seed)
    seen: set[tuple[int, int]] = set()
    rows: list[dict] = []
    while len(rows) < n_test + n_train:
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        if (a, b) in seen:
            continue
        seen.add((a, b))
        total = str(a + b)
        uses_tool = rng.random() < TOOL_SHARE
        solution = f"[calc {a}+{b}]={total};{total}" if uses_tool else total
        rows.append({"prompt": f"{a}+{b}=", "answer": total, "solution": solution})
    return rows[n_test:], rows[:n_test]


def make_task(seed: int = 0, n_train: int = 20_000, n_test: int = 500) -> Task:
    train, test = make_rows(seed, n_train, n_test)
    return Task(
        name="calculator",
        description="3-digit addition with a calculator tool ([calc A+B] inserts =SUM;); reward 1 for the right "
                    "final answer",
        train=train,
        test=test,
        reward_funcs=(accuracy,),
        reward_weights=(1.0,),
        correct=correct,
        max_new_tokens=32,
        final_answer=final_answer,
        default_model="tiny-calculator",
        tools=(calc,),
        tool_format="inline",
        tool_timeout=0.0,  # arithmetic on two parsed integers cannot hang; a worker per call would cost a fork
    )
