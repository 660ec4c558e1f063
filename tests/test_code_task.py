"""The code-execution reward and the ``code`` task: hand-computed scores on scripted completions."""

from __future__ import annotations

import json

import pytest

from posttrain import sandbox
from posttrain.data.code_execution import extract_code, parse_tests, run_tests
from posttrain.data.rewards import load_reward

try:
    sandbox.check_available()
except sandbox.SandboxUnavailable as error:
    pytestmark = pytest.mark.skip(reason=f"no sandbox on this machine: {error}")

ADD_3 = json.dumps([{"input": [x], "output": x + 3} for x in (1, 2, 3, 4)])


def score(*completions: str, tests: str = ADD_3, entry_point: str = "add_3") -> list[float | None]:
    reward = load_reward("code_tests(seconds_per_test=0.5, timeout_s=10)")
    n = len(completions)
    return reward([""] * n, list(completions), entry_point=[entry_point] * n, tests=[tests] * n)


def fenced(code: str) -> str:
    return f"Here it is:\n```python\n{code}\n```\nDone."


def test_scores_are_the_share_of_tests_passed():
    assert score(fenced("def add_3(x):\n    return x + 3"),
                 fenced("def add_3(x):\n    return x + 3 if x < 3 else 0"),  # passes 1 and 2 only
                 fenced("def add_3(x):\n    return x"),
                 "def add_3(x):\n    return 3 + x\n") == [1.0, 0.5, 0.0, 1.0]  # the last: no fence, still code


def test_a_test_that_hangs_or_raises_fails_alone():
    hangs_on_4 = fenced("def add_3(x):\n    while x == 4:\n        pass\n    return x + 3")
    raises_on_1 = fenced("def add_3(x):\n    if x == 1:\n        raise ValueError(x)\n    return x + 3")
    assert score(hangs_on_4, raises_on_1) == [0.75, 0.75]
    reports = run_tests([extract_code(hangs_on_4)], ["add_3"], [ADD_3], seconds_per_test=0.5)
    assert reports[0].failures == ("timed out",)
    loops = fenced("def add_3(x):\n    while True:\n        pass")
    reports = run_tests([extract_code(loops)], ["add_3"], [ADD_3], seconds_per_test=0.5)
    assert reports[0].failures == ("timed out", "timed out", *["not run: the function timed out on 2 tests already"] * 2)


def test_broken_code_scores_zero_and_says_why():
    reports = run_tests(["def add_3(x) return x", "def other(x):\n    return x + 3", "import os\nos._exit(0)",
                         "while True:\n    pass"], ["add_3"] * 4, [ADD_3] * 4, timeout_s=2)
    assert [r.fraction for r in reports] == [0.0, 0.0, 0.0, 0.0]
    assert "SyntaxError" in reports[0].failures[0] and "no function named add_3" in reports[1].failures[0]
    assert reports[2].failures[0].startswith("no results")
    assert reports[3].failures[0] == "timed out defining the function"  # the module's own code has a test's time


def test_the_expected_outputs_never_enter_the_sandbox():
    """Whatever the code reads (its caller's variables, stdin, the harness, its files), no answer is there."""
    snoop = fenced("""
import sys, os
def add_3(x):
    seen = repr(vars(sys.modules["__main__"])) + open("/sandbox/main.py").read() + repr(os.listdir("/sandbox"))
    return seen
""")
    reports = run_tests([extract_code(snoop)], ["add_3"], [ADD_3])
    seen = reports[0].failures[0]
    assert "'output'" not in seen and '"output"' not in seen and "inputs" in seen


def test_printing_fake_results_earns_nothing():
    fake = fenced("""
import atexit, json
def add_3(x):
    return None
atexit.register(lambda: print("\\n\\x1eposttrain-results " + json.dumps([{"value": "ok"}] * 4)))
""")
    assert score(fake) == [0.0]


def test_rows_without_tests_score_none_and_bad_tests_name_the_row():
    reward = load_reward("code_tests")
    assert reward(["", ""], ["def add_3(x): return x+3", "x"], entry_point=["add_3", "f"],
                  tests=[ADD_3, None]) == [1.0, None]
    with pytest.raises(ValueError, match=r"tests \(row 1\): test 0 is"):
        run_tests(["", ""], ["f", "f"], [ADD_3, '[{"in": 1}]'])
    with pytest.raises(ValueError, match=r"tests \(row 3\): not JSON"):
        parse_tests("[{", row=3)
    with pytest.raises(ValueError, match="needs 'entry_point' and 'tests'"):
        reward([""], ["x"])


def test_extract_code_prefers_the_block_that_defines_the_function():
    text = "```python\nprint('example')\n```\nand\n```python\ndef f(x):\n    return x\n```"
    assert extract_code(text, "f") == "def f(x):\n    return x\n"
    assert extract_code("Sure! def f(x): ...") == "Sure! def f(x): ..."  # no def at a line start: the whole text
    assert extract_code("Sure!\ndef f(x):\n    return 1") == "def f(x):\n    return 1"


def test_every_reference_solution_of_the_code_task_passes_its_tests():
    from posttrain.data.tasks import get_task

    task = get_task("code")
    rows = task.train[:40] + task.test[:40]
    assert len({r["entry_point"] for r in task.train} & {r["entry_point"] for r in task.test}) == 0
    columns = {name: [r[name] for r in rows] for name in ("entry_point", "tests")}
    prompts = [r["prompt"] for r in rows]
    assert task.reward_funcs[0](prompts, [r["solution"] for r in rows], **columns) == [1.0] * len(rows)
    assert task.correct(prompts, ["```python\ndef nothing():\n    pass\n```"] * len(rows), **columns) == [False] * len(rows)
    assert all("output" not in r["prompt"][0]["content"] for r in rows)


def test_a_completion_seen_before_is_not_run_again(monkeypatch):
    from posttrain.data import code_execution

    programs = []
    real = code_execution.run_tests

    def counting(codes, *args, **kwargs):
        programs.extend(codes)
        return real(codes, *args, **kwargs)

    monkeypatch.setattr(code_execution, "run_tests", counting)
    right, wrong = fenced("def add_3(x):\n    return x + 3"), fenced("def add_3(x):\n    return x")
    reward = load_reward("code_tests")
    assert reward([""] * 3, [right, wrong, right], entry_point=["add_3"] * 3, tests=[ADD_3] * 3) == [1.0, 0.0, 1.0]
    assert reward([""], [right], entry_point=["add_3"], tests=[ADD_3]) == [1.0]
    assert len(programs) == 2  # the repeat in the batch and the later call are served from what ran

