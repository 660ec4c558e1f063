"""Grade-school math word problems, generated from templates written for posttrain.

Each template is a short story (shopping, ages, rates, sharing, saving, ...) whose numbers are
drawn from a seeded ``random.Random``; it takes 1-3 arithmetic operations and its answer is a
whole number (divisions are built from their quotient, so they come out even). Half of the
problems come from four easy templates (one small addition or multiplication), so that a
135M-parameter instruct model solves some of them: RL needs a starting policy that is sometimes
right (SmolLM2-135M-Instruct's greedy accuracy, overall and on each half: benchmarks/RESULTS.md).

Prompts are chat messages (one user turn: the problem and an instruction to end with
"The answer is N."); the chat template renders them for the model. The split is deterministic:
problems are drawn in a fixed order from ``seed``, duplicates dropped, the first ``n_test`` form the
held-out split and the next ``n_train`` the training split, so the two are disjoint.

Reward: :func:`posttrain.data.rewards.math_answer` (1.0 for the right final answer, read from
``\\boxed{}``, "the answer is ..." or the last number). ``correct`` is the same check.

``--task gsm-calculator`` is the same split with a :func:`calculator` tool the policy may call
(multi-turn episodes, :mod:`posttrain.rollout.episodes`).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import operator
import random
import re
from collections.abc import Callable
from typing import Any, NamedTuple

from posttrain.data.rewards import math_answer
from posttrain.data.tasks.task import Task

INSTRUCTION = 'Show your calculation briefly, then end with "The answer is N." where N is a number.'

NAMES = ("Ava", "Ben", "Carla", "Dev", "Emma", "Finn", "Grace", "Hugo", "Isla", "Jack", "Kira", "Liam",
         "Maya", "Noah", "Olivia", "Pablo", "Quinn", "Rosa", "Sam", "Tara")
ITEMS = ("apples", "pencils", "stickers", "marbles", "cookies", "books", "cards", "balloons", "shells", "stamps")
PRICED = (("notebook", "notebooks"), ("pen", "pens"), ("sandwich", "sandwiches"), ("toy car", "toy cars"),
          ("ticket", "tickets"), ("cupcake", "cupcakes"))

class Problem(NamedTuple):
    """A word problem, its answer, and the arithmetic that gives it (what a demonstration computes)."""

    question: str
    answer: int
    expression: str  # e.g. "20 - 3 * 4": evaluates to ``answer``


def _two_names(rng: random.Random) -> tuple[str, str]:
    a, b = rng.sample(NAMES, 2)
    return a, b


def gain(rng: random.Random) -> Problem:
    """1 operation: a + b, single digits."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    return Problem(f"{name} has {a} {item}. {name} gets {b} more {item}. How many {item} does {name} have now?",
                   a + b, f"{a} + {b}")


def combine(rng: random.Random) -> Problem:
    """1 operation: a + b, single digits, two colours."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    first, second = rng.sample(("red", "blue", "green", "yellow"), 2)
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    return Problem(f"{name} has {a} {first} {item} and {b} {second} {item}. How many {item} does {name} have in all?",
                   a + b, f"{a} + {b}")


def twice(rng: random.Random) -> Problem:
    """1 operation: 2 * a."""
    (name, friend), item = _two_names(rng), rng.choice(ITEMS)
    a = rng.randint(2, 12)
    return Problem(f"{name} has {a} {item}. {friend} has twice as many {item} as {name}. How many {item} does {friend} "
                   "have?", 2 * a, f"2 * {a}")


def loss(rng: random.Random) -> Problem:
    """1 operation: a - b."""
    (name, friend), item = _two_names(rng), rng.choice(ITEMS)
    a = rng.randint(6, 20)
    b = rng.randint(1, a - 1)
    return Problem(f"{name} had {a} {item} and gave {b} of them to {friend}. How many {item} does {name} have left?",
                   a - b, f"{a} - {b}")


def total_cost(rng: random.Random) -> Problem:
    """1 operation: n * price."""
    name, (one, many) = rng.choice(NAMES), rng.choice(PRICED)
    n, price = rng.randint(2, 6), rng.randint(2, 9)
    return Problem(f"A {one} costs ${price}. {name} buys {n} {many}. How many dollars does {name} spend?", n * price,
                   f"{n} * {price}")


def change(rng: random.Random) -> Problem:
    """2 operations: bill - n * price."""
    name, (_, many) = rng.choice(NAMES), rng.choice(PRICED)
    n, price = rng.randint(2, 5), rng.randint(2, 9)
    bill = rng.choice([b for b in (20, 50, 100) if b > n * price])
    question = (f"{name} buys {n} {many} that cost ${price} each and pays with a ${bill} bill. "
                f"How many dollars of change does {name} get?")
    return Problem(question, bill - n * price, f"{bill} - {n} * {price}")


def ages(rng: random.Random) -> Problem:
    """2 operations: age + gap + years."""
    name, sibling = _two_names(rng)
    age, gap, years = rng.randint(5, 15), rng.randint(2, 9), rng.randint(2, 10)
    question = (f"{name} is {age} years old. {sibling} is {gap} years older than {name}. "
                f"How old will {sibling} be in {years} years?")
    return Problem(question, age + gap + years, f"{age} + {gap} + {years}")


def distance(rng: random.Random) -> Problem:
    """1 operation: speed * hours."""
    name = rng.choice(NAMES)
    speed, hours = rng.choice((10, 20, 30, 40, 50, 60)), rng.randint(2, 5)
    return Problem(f"{name} drives at {speed} miles per hour for {hours} hours. How many miles does {name} drive?",
                   speed * hours, f"{speed} * {hours}")


def sharing(rng: random.Random) -> Problem:
    """1 operation: total / people (exact)."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    people, each = rng.randint(2, 6), rng.randint(2, 9)
    question = (f"{name} has {people * each} {item} and shares them equally among {people} friends. "
                f"How many {item} does each friend get?")
    return Problem(question, each, f"{people * each} / {people}")


def reading(rng: random.Random) -> Problem:
    """2 operations: pages * 7 * weeks."""
    name = rng.choice(NAMES)
    pages, weeks = rng.randint(2, 12), rng.randint(1, 3)
    week_text = "1 week" if weeks == 1 else f"{weeks} weeks"
    return Problem(f"{name} reads {pages} pages every day. How many pages does {name} read in {week_text}?",
                   pages * 7 * weeks, f"{pages} * 7 * {weeks}")


def saving(rng: random.Random) -> Problem:
    """2 operations: weekly * weeks - spent."""
    name = rng.choice(NAMES)
    weekly, weeks = rng.randint(3, 15), rng.randint(2, 8)
    spent = rng.randint(1, weekly * weeks - 1)
    question = (f"{name} saves ${weekly} every week for {weeks} weeks, then spends ${spent} on a game. "
                f"How many dollars does {name} have left?")
    return Problem(question, weekly * weeks - spent, f"{weekly} * {weeks} - {spent}")


def packs(rng: random.Random) -> Problem:
    """3 operations: packs * size - given + found."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    n, size = rng.randint(2, 5), rng.randint(3, 10)
    given = rng.randint(1, n * size - 1)
    found = rng.randint(1, 9)
    question = (f"{name} buys {n} packs of {item} with {size} {item} in each pack, gives away {given} {item}, "
                f"and then finds {found} more. How many {item} does {name} have now?")
    return Problem(question, n * size - given + found, f"{n} * {size} - {given} + {found}")


EASY: tuple[Callable[[random.Random], Problem], ...] = (gain, combine, twice, total_cost)
"""One small operation: the templates SmolLM2-135M-Instruct solves most often (benchmarks/RESULTS.md)."""
HARDER: tuple[Callable[[random.Random], Problem], ...] = (loss, distance, sharing, change, ages, reading, saving, packs)
"""1-3 operations: it solves few of these; they are what RL has to teach."""
EASY_SHARE = 0.5
"""Probability that a problem comes from an easy template (then a template is drawn uniformly)."""


def make_rows(seed: int, n_train: int, n_test: int) -> tuple[list[dict], list[dict]]:
    """Disjoint (train, test) rows: ``prompt`` (chat messages), ``answer`` (a string), ``template``, ``question``
    (without the instruction), ``expression`` (its arithmetic) and ``solution`` (a worked answer:
    "EXPRESSION = N. The answer is N.", what ``posttrain sft --task gsm`` imitates)."""
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[dict[str, Any]] = []
    while len(rows) < n_test + n_train:
        template = rng.choice(EASY if rng.random() < EASY_SHARE else HARDER)
        question, answer, expression = template(rng)
        if question not in seen:
            seen.add(question)
            rows.append({"prompt": [{"role": "user", "content": f"{question}\n{INSTRUCTION}"}],
                         "answer": str(answer), "template": template.__name__, "question": question,
                         "expression": expression, "solution": f"{expression} = {answer}. The answer is {answer}."})
    return rows[n_test:], rows[:n_test]


answer_reward = math_answer()


def correct(prompts: list, completions: list, answer: list[str], **columns: Any) -> list[bool]:
    """Whether each completion's final answer equals ``answer`` (the reward's check)."""
    return [score == 1.0 for score in answer_reward(prompts, completions, answer=answer)]


OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers joined by +, -, *, / and parentheses, e.g. "(12 + 30) * 2"
    """

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"not arithmetic: {ast.unparse(node)!r} (use numbers, + - * / and parentheses)")

    times = re.sub(r"(?<=[\d)\s])[x×](?=[\s\d(])", "*", expression)  # 3 x 4, a common way to write it
    result = value(ast.parse(times, mode="eval").body)
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


TOOL_INSTRUCTION = 'Use the calculator for the arithmetic, then end with "The answer is N." where N is a number.'


def tool_solution(expression: str, answer: str) -> list[dict[str, Any]]:
    """A demonstration of using the calculator, as segments of the completion: the call (trained), the result
    the episode inserts (not trained: the tool writes it), the answer (trained). Both are written the way
    the episodes' JSON format (Hermes') writes and reads them, so the warm-started model writes calls the
    episodes parse (tests/test_tool_formats.py checks it against ``JSONCalls``)."""
    call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    assert calculator(expression) == answer, (expression, answer)
    return [{"text": f"<tool_call>{call}</tool_call>", "train": True},
            {"text": f"<tool_response>\n{answer}\n</tool_response>\n", "train": False},
            {"text": f"The answer is {answer}.", "train": True}]


def make_tool_task(seed: int = 0) -> Task:
    """``--task gsm-calculator``: the same problems, with the :func:`calculator` tool (JSON calls, described in
    the system prompt where the chat template does not render tools) and a budget for the whole episode."""
    task = make_task(seed)

    def with_tool(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{**row, "prompt": [{"role": "user", "content": row["prompt"][0]["content"].replace(
            INSTRUCTION, TOOL_INSTRUCTION)}], "solution": tool_solution(row["expression"], row["answer"])}
                for row in rows]

    return dataclasses.replace(
        task, name="gsm-calculator", train=with_tool(task.train), test=with_tool(task.test),
        description=task.description + "; a calculator tool the policy may call", tools=(calculator,),
        tool_format="json", tool_timeout=0.0, max_new_tokens=256)


def make_task(seed: int = 0, n_train: int = 2000, n_test: int = 200) -> Task:
    train, test = make_rows(seed, n_train, n_test)
    return Task(
        name="gsm",
        description="templated grade-school math word problems (1-3 operations), chat prompts; "
                    "reward 1 for the right final answer",
        train=train,
        test=test,
        reward_funcs=(answer_reward,),
        reward_weights=(1.0,),
        correct=correct,
        max_new_tokens=128,
        default_model="smollm2-135m",
    )
