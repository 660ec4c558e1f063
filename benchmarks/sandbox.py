"""Sandboxed code execution: executions per second, serial and in parallel.

    .venv/bin/python benchmarks/sandbox.py [--rows 128] [--repeats 3]

Four workloads, each timed ``--repeats`` times (the median is printed): an empty program run one
at a time (the cost of a sandbox: bubblewrap's namespaces and seccomp filter, a cgroup where the host
delegates one, plus Python's start), and the ``code``
task's reference solutions scored by the ``code_tests`` reward (one sandbox per completion, six
tests in each) with 1, 2 and 4 workers, and with the reward's defaults (four sandboxes per core) when one
completion in eight loops forever in its function and one in eight hangs before defining it. A training step of 32 prompts x 8 samples scores 256
completions; the figure to compare it with is that step's generation time.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from posttrain import sandbox
    from posttrain.data.tasks import get_task

    sandbox.check_available()
    task = get_task("code")
    rows = (task.train * (1 + args.rows // len(task.train)))[:args.rows]
    columns = {name: [r[name] for r in rows] for name in ("entry_point", "tests")}
    prompts = [r["prompt"] for r in rows]
    solutions = [r["solution"] for r in rows]
    reward = task.reward_funcs[0]

    print(f"{cpu_model()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}")
    whole = sandbox.run("pass").cgroup
    print(f"a cgroup per sandbox: {'yes' if whole else 'no (memory capped per process, tasks by RLIMIT_NPROC)'}")
    empty = timed(lambda: [sandbox.run("pass") for _ in range(20)], args.repeats) / 20
    print(f"empty program, one at a time: {1 / empty:.1f} executions/s ({empty * 1000:.0f} ms each)")
    from posttrain.data import code_execution

    for workers in (1, 2, 4):
        def score() -> None:
            reports = code_execution.run_tests(
                [code_execution.extract_code(s) for s in solutions], columns["entry_point"], columns["tests"],
                max_workers=workers)
            assert all(r.fraction == 1.0 for r in reports)

        seconds = timed(score, args.repeats)
        print(f"code task, {len(rows)} completions x 6 tests, {workers} worker(s): {len(rows) / seconds:.1f} "
              f"executions/s ({seconds:.2f} s; a step of 256 completions: {256 * seconds / len(rows):.1f} s)")
    # sampled completions are not all well behaved: one in eight loops in the function, one in eight hangs at import
    mixed = []
    for i, (solution, entry) in enumerate(zip(solutions, columns["entry_point"])):
        if i % 8 == 3:
            solution = f"```python\ndef {entry}(*args):\n    while True:\n        pass\n```"
        elif i % 8 == 6:
            solution = "```python\nimport time\ntime.sleep(100)\n```"
        mixed.append(solution)
    seconds = timed(lambda: reward(prompts, mixed, **columns), args.repeats)
    print(f"code task, the same with 1 in 8 looping and 1 in 8 hanging, the reward's defaults: "
          f"{len(rows) / seconds:.1f} executions/s ({seconds:.2f} s; a step of 256 completions: "
          f"{256 * seconds / len(rows):.1f} s)")
    assert reward(prompts[:4], solutions[:4], **{k: v[:4] for k, v in columns.items()}) == [1.0] * 4


if __name__ == "__main__":
    main()
