"""Scoring model-written functions against unit tests the model never sees, in the sandbox.

A row names the function (``entry_point``) and carries its tests (``tests``: a list of ``{"input":
[args...], "output": expected}``, or that list as a JSON string). The completion's code runs in a
fresh :mod:`posttrain.sandbox` with a small harness that calls the function on each test's input
and prints what came back; the comparison with the expected outputs happens here, outside, so
nothing inside the sandbox knows the answers (code that reads files, prints fake results or
inspects its caller finds no expected value to copy). Each call has its own time limit inside the
sandbox, so one input that loops forever fails that test only (after two such inputs, the rest fail
unrun).

A step's completions run in parallel (:func:`posttrain.sandbox.run_many`, one per core): one
sandbox per completion, every test in it.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

MAX_TIMEOUTS = 2
"""After this many tests time out, the rest fail unrun: code that loops on two inputs loops on most (sampled
completions do), and a step's scoring should not wait ``seconds_per_test`` for each."""
WORKERS_PER_CORE = 4
MAX_PROCESSES = 4
"""Processes and threads a completion's code may have: a function needs one; its memory is at most this times
``memory_mb``."""
RESULT_MARK = "\x1eposttrain-results "
"""Starts the harness's last line of output; whatever the code printed before it is ignored."""

HARNESS = r'''
import copy, json, signal, sys

spec = json.loads(sys.stdin.read())


class TestTimeout(BaseException):
    pass


def on_alarm(signum, frame):
    raise TestTimeout()


def describe(error):
    return (type(error).__name__ + ": " + str(error))[:200]


namespace = {"__name__": "solution"}
signal.signal(signal.SIGALRM, on_alarm)
signal.setitimer(signal.ITIMER_REAL, spec["seconds_per_test"])  # defining the function gets a test's time too
try:
    with open("/sandbox/solution.py") as source:
        exec(compile(source.read(), "solution.py", "exec"), namespace)
    signal.setitimer(signal.ITIMER_REAL, 0)
    function = namespace.get(spec["entry_point"])
    failure = None if callable(function) else "no function named " + spec["entry_point"]
except BaseException as error:
    signal.setitimer(signal.ITIMER_REAL, 0)
    function = None
    failure = "timed out defining the function" if isinstance(error, TestTimeout) else describe(error)
results = []
timeouts = 0
for args in spec["inputs"]:
    if failure is not None:
        results.append({"error": failure})
        continue
    if timeouts >= spec["max_timeouts"]:
        results.append({"error": "not run: the function timed out on " + str(timeouts) + " tests already"})
        continue
    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, spec["seconds_per_test"])
    try:
        value = function(*copy.deepcopy(args))
        signal.setitimer(signal.ITIMER_REAL, 0)
        results.append({"value": json.loads(json.dumps(value, default=repr))})
    except BaseException as error:
        signal.setitimer(signal.ITIMER_REAL, 0)
        timeouts += isinstance(error, TestTimeout)
        results.append({"error": "timed out" if isinstance(error, TestTimeout) else describe(error)})
sys.stdout.write("\n" + spec["mark"] + json.dumps(results) + "\n")
sys.stdout.flush()
'''
"""Runs in the sandbox as ``main.py``, the completion's code beside it as ``solution.py``."""

_FENCE = re.compile(r"```(?:python|py|Python)?[ \t]*\n(.*?)(?:```|$)", re.DOTALL)


@dataclass(frozen=True)
class TestReport:
    """One completion's tests: how many passed, and why the others did not."""

    passed: int
    total: int
    failures: tuple[str, ...]
    limit: str | None
    """The sandbox limit the whole execution hit (then every unreported test failed), or None."""

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


def extract_code(text: str, entry_point: str | None = None) -> str:
    """The code in a completion: the first fenced block that defines ``entry_point`` (else the first
    fenced block), else the text from its first ``def``/``import`` line on, else the whole text."""
    blocks = _FENCE.findall(text)
    if blocks:
        for block in blocks:
            if entry_point and re.search(rf"def\s+{re.escape(entry_point)}\s*\(", block):
                return block
        return blocks[0]
    start = re.search(r"^(?:def |import |from \w+ import )", text, re.MULTILINE)
    return text[start.start():] if start else text


def parse_tests(tests: Any, row: int | None = None) -> list[dict[str, Any]]:
    """A row's tests as a list of ``{"input": [...], "output": ...}``; a clear error naming the row otherwise."""
    where = "tests" if row is None else f"tests (row {row})"
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: not JSON ({error}); give a list of {{'input': [...], 'output': ...}}") from None
    if not isinstance(tests, list) or not tests:
        raise ValueError(f"{where}: got {type(tests).__name__}; give a non-empty list of "
                         "{'input': [args...], 'output': expected}")
    for i, test in enumerate(tests):
        if not isinstance(test, dict) or not isinstance(test.get("input"), list) or "output" not in test:
            raise ValueError(f"{where}: test {i} is {test!r}; each needs 'input' (a list of arguments) and 'output'")
    return tests


def run_tests(codes: Sequence[str], entry_points: Sequence[str], tests: Sequence[Any], *,
              seconds_per_test: float = 0.5, timeout_s: float = 5.0, memory_mb: int = 512,
              max_workers: int | None = None) -> list[TestReport]:
    """Run each code's function on its row's tests in a sandbox of its own, in parallel; compare outside.

    A sampled completion that loops or hangs holds its sandbox until a limit stops it, so more run at once
    than there are cores (``max_workers``, default 4 per core): a hung one waits without using a core, and a
    busy one's CPU time is capped at its tests' time plus a second."""
    from posttrain import sandbox

    parsed = [parse_tests(t, row=i) for i, t in enumerate(tests)]
    jobs = []
    for code, entry, row_tests in zip(codes, entry_points, parsed):
        spec = {"entry_point": entry, "inputs": [t["input"] for t in row_tests], "seconds_per_test": seconds_per_test,
                "max_timeouts": MAX_TIMEOUTS, "mark": RESULT_MARK}
        jobs.append({"source": HARNESS, "files": {"solution.py": code}, "stdin": json.dumps(spec)})
    workers = max_workers or WORKERS_PER_CORE * (os.cpu_count() or 1)
    cpu_budget = min(timeout_s, seconds_per_test * max((len(t) for t in parsed), default=1) + 1)
    results = sandbox.run_many(jobs, max_workers=workers, timeout_s=timeout_s, cpu_time_s=cpu_budget,
                               memory_mb=memory_mb, max_processes=MAX_PROCESSES)
    return [_report(result, row_tests) for result, row_tests in zip(results, parsed)]


def _report(result: Any, tests: list[dict[str, Any]]) -> TestReport:
    lines = [line for line in result.stdout.split("\n") if line.startswith(RESULT_MARK)]  # splitlines splits at \x1e
    try:
        outcomes = json.loads(lines[-1][len(RESULT_MARK):]) if lines else []
    except json.JSONDecodeError:
        outcomes = []
    if len(outcomes) != len(tests):  # the harness never finished: a limit, or the code killed its process
        reason = f"no results ({result.limit or 'exit ' + str(result.returncode)}): {result.stderr[-200:]}"
        return TestReport(0, len(tests), (reason,) * len(tests), result.limit)
    passed, failures = 0, []
    for test, outcome in zip(tests, outcomes):
        expected = json.loads(json.dumps(test["output"]))  # tuples compare as the lists the harness sends
        if "value" in outcome and outcome["value"] == expected:
            passed += 1
        else:
            failures.append(outcome.get("error") or f"returned {outcome.get('value')!r}, expected {expected!r}")
    return TestReport(passed, len(tests), tuple(failures), result.limit)
