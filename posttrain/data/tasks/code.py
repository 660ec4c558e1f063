"""``--task code``: write a small Python function that passes unit tests the model does not see.

Problems come from templates with a parameter (``add_7``, ``count_greater_than_3``, ``replace_a_with_e``,
...), so the split holds hundreds of distinct functions; each row carries six tests drawn for it and
a reference solution (the SFT column ``solution``, and proof that the tests pass). The reward is the
share of tests passed in :mod:`posttrain.sandbox` (the ``code_tests`` reward); held-out accuracy
counts a problem solved when every test passes. Prompts are chat messages, for instruction-tuned
models (``smollm2-135m`` by default).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from posttrain.data.rewards import code_tests
from posttrain.data.tasks.task import Task

INSTRUCTION = "Answer with the function only, in a ```python code block."
TESTS_PER_PROBLEM = 6


@dataclass(frozen=True)
class Problem:
    entry_point: str
    arguments: str
    description: str
    reference: Callable[..., Any]
    solution_body: str
    draw_input: Callable[[random.Random], list[Any]]

    @property
    def solution(self) -> str:
        return f"def {self.entry_point}({self.arguments}):\n    {self.solution_body}\n"


def _ints(rng: random.Random, n: int = 6) -> list[int]:
    return [rng.randint(-20, 50) for _ in range(rng.randint(0, n))]


def _word(rng: random.Random) -> str:
    return "".join(rng.choice("abcdeilmnorst") for _ in range(rng.randint(0, 9)))


def _templates(rng: random.Random) -> list[Problem]:
    """One problem of each template, its parameters drawn from ``rng``."""
    k, small, power = rng.randint(2, 40), rng.randint(2, 9), rng.randint(2, 5)
    lo = rng.randint(-5, 5)
    hi = lo + rng.randint(5, 15)
    a, b = rng.sample("abcdeilmnorst", 2)
    c = rng.choice("abcdefghijklmnopqrstuvwxyz")
    return [
        Problem(f"add_{k}", "x", f"returns x plus {k}", lambda x: x + k, f"return x + {k}",
                lambda r: [r.randint(-100, 100)]),
        Problem(f"subtract_{k}", "x", f"returns x minus {k}", lambda x: x - k, f"return x - {k}",
                lambda r: [r.randint(-100, 100)]),
        Problem(f"times_{k}", "x", f"returns x multiplied by {k}", lambda x: x * k, f"return x * {k}",
                lambda r: [r.randint(-100, 100)]),
        Problem(f"power_{power}", "x", f"returns x to the power {power}", lambda x: x ** power, f"return x ** {power}",
                lambda r: [r.randint(-6, 6)]),
        Problem(f"is_divisible_by_{k}", "n", f"returns True if n is divisible by {k}, else False",
                lambda n: n % k == 0, f"return n % {k} == 0", lambda r: [r.randint(-60, 60)]),
        Problem(f"add_{k}_to_each", "xs", f"returns a new list with {k} added to every number of the list xs",
                lambda xs: [x + k for x in xs], f"return [x + {k} for x in xs]", lambda r: [_ints(r)]),
        Problem(f"greater_than_{k}", "xs", f"returns the numbers of the list xs that are greater than {k}, in order",
                lambda xs: [x for x in xs if x > k], f"return [x for x in xs if x > {k}]", lambda r: [_ints(r)]),
        Problem(f"count_greater_than_{k}", "xs", f"returns how many numbers in the list xs are greater than {k}",
                lambda xs: sum(x > k for x in xs), f"return sum(1 for x in xs if x > {k})", lambda r: [_ints(r)]),
        Problem(f"first_{small}", "xs", f"returns the first {small} items of the list xs (all of them if it is "
                "shorter)", lambda xs: xs[:small], f"return xs[:{small}]", lambda r: [_ints(r, 12)]),
        Problem(f"repeat_{small}_times", "s", f"returns the string s repeated {small} times", lambda s: s * small,
                f"return s * {small}", lambda r: [_word(r)]),
        Problem(f"clamp_{lo}_{hi}".replace("-", "minus"), "x",
                f"returns x limited to the range from {lo} to {hi}: {lo} if x is smaller, {hi} if x is larger",
                lambda x: min(max(x, lo), hi), f"return min(max(x, {lo}), {hi})", lambda r: [r.randint(-30, 50)]),
        Problem(f"count_{c}", "s", f"returns how many times the letter '{c}' appears in the string s",
                lambda s: s.count(c), f"return s.count('{c}')", lambda r: [_word(r) + c * r.randint(0, 2)]),
        Problem(f"replace_{a}_with_{b}", "s", f"returns the string s with every '{a}' replaced by '{b}'",
                lambda s: s.replace(a, b), f"return s.replace('{a}', '{b}')", lambda r: [_word(r)]),
        Problem(f"starts_with_{c}", "s", f"returns True if the string s starts with the letter '{c}', else False",
                lambda s: s.startswith(c), f"return s.startswith('{c}')", lambda r: [r.choice(["", c]) + _word(r)]),
        Problem(f"ends_with_{c}", "s", f"returns True if the string s ends with the letter '{c}', else False",
                lambda s: s.endswith(c), f"return s.endswith('{c}')", lambda r: [_word(r) + r.choice(["", c])]),
        Problem("reverse_string", "s", "returns the string s reversed", lambda s: s[::-1], "return s[::-1]",
                lambda r: [_word(r)]),
        Problem("sum_list", "xs", "returns the sum of the numbers in the list xs", sum, "return sum(xs)",
                lambda r: [_ints(r)]),
        Problem("largest", "xs", "returns the largest number in the non-empty list xs", max, "return max(xs)",
                lambda r: [[r.randint(-50, 50) for _ in range(r.randint(1, 6))]]),
        Problem("digit_sum", "n", "returns the sum of the decimal digits of the non-negative integer n",
                lambda n: sum(int(d) for d in str(n)), "return sum(int(d) for d in str(n))",
                lambda r: [r.randint(0, 99999)]),
        Problem("is_palindrome", "s", "returns True if the string s reads the same backwards, else False",
                lambda s: s == s[::-1], "return s == s[::-1]", lambda r: [r.choice([_word(r), "abba", "level"])]),
        Problem("count_vowels", "s", "returns how many vowels (a, e, i, o, u) the string s contains",
                lambda s: sum(ch in "aeiou" for ch in s), "return sum(1 for ch in s if ch in 'aeiou')",
                lambda r: [_word(r)]),
        Problem("factorial", "n", "returns n! (the product 1 * 2 * ... * n; 1 for n = 0)",
                lambda n: __import__("math").factorial(n), "return 1 if n == 0 else n * factorial(n - 1)",
                lambda r: [r.randint(0, 10)]),
    ]


def prompt_text(problem: Problem) -> str:
    return f"Write a Python function `{problem.entry_point}({problem.arguments})` that {problem.description}.\n" \
           f"{INSTRUCTION}"


def make_rows(seed: int, n_train: int, n_test: int) -> tuple[list[dict], list[dict]]:
    """Disjoint (train, test) rows, distinct functions: ``prompt`` (chat messages), ``entry_point``, ``tests``
    (JSON, hidden from the model), ``solution`` (a fenced reference, for SFT) and ``template``."""
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[dict[str, Any]] = []
    for _ in range(100 * (n_train + n_test)):
        if len(rows) == n_train + n_test:
            break
        problem = rng.choice(_templates(rng))
        if problem.entry_point in seen:
            continue
        seen.add(problem.entry_point)
        inputs = [problem.draw_input(rng) for _ in range(TESTS_PER_PROBLEM)]
        tests = [{"input": args, "output": problem.reference(*args)} for args in inputs]
        rows.append({"prompt": [{"role": "user", "content": prompt_text(problem)}],
                     "entry_point": problem.entry_point, "tests": json.dumps(tests),
                     "solution": f"```python\n{problem.solution}```", "template": problem.entry_point.split("_")[0]})
    if len(rows) < n_train + n_test:
        raise ValueError(f"the code task has {len(rows)} distinct problems; asked for {n_train} + {n_test}")
    return rows[n_test:], rows[:n_test]


_score = code_tests()


def correct(prompts: list, completions: list, **columns: Any) -> list[bool]:
    """Solved: every test passes."""
    return [score == 1.0 for score in _score(prompts, completions, **columns)]


def make_task(seed: int = 0, n_train: int = 400, n_test: int = 100) -> Task:
    train, test = make_rows(seed, n_train, n_test)
    return Task(
        name="code",
        description="write a small Python function from its description; reward: the share of 6 hidden unit "
                    "tests it passes in the sandbox",
        train=train,
        test=test,
        reward_funcs=(_score,),
        reward_weights=(1.0,),
        correct=correct,
        max_new_tokens=160,
        default_model="smollm2-135m",
    )
