"""Every preset's default run on the built-in task: does each one make the model better?

    python benchmarks/default_runs.py --output runs/defaults [--algorithms dpo,kto] [--seeds 0,1,2]
    python benchmarks/default_runs.py --output runs/defaults --report-only [--figure docs/figures/default_runs.png]

A default run is what a user types first: ``posttrain train --algorithm NAME --seed S`` and nothing else (the
built-in ``tiny-addition`` model and task, the preset's default data and budget). Runs go one at a time into
``OUTPUT/NAME/seedS/``, the layout ``posttrain compare`` writes, so a comparison's directory can be reported
too; a finished run (``final_model/`` present) is not run again. The report gives, per preset, the task metric
before and after (held-out greedy accuracy; the reward model's is held-out pairwise accuracy), per seed and as
mean +- standard deviation, with the machine's CPU, and draws the figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from posttrain.algorithms.presets import ALGORITHMS, OnlineAlgorithm, PreferenceAlgorithm


def task_metric(algorithm: str) -> str:
    """The metric a preset's default run is judged by."""
    return "eval/pairwise_accuracy" if algorithm == "reward_model" else "eval/accuracy"


def kind(algorithm: str) -> str:
    preset = ALGORITHMS[algorithm]
    if isinstance(preset, OnlineAlgorithm):
        return "online"
    return "preference" if isinstance(preset, PreferenceAlgorithm) else "supervised"


def run(output: Path, algorithm: str, seed: int) -> None:
    path = output / algorithm / f"seed{seed}"
    if (path / "final_model").exists():
        print(f"{algorithm} seed {seed}: done already", file=sys.stderr)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "posttrain", "train", "--algorithm", algorithm, "--seed", str(seed),
               "--no-progress", "--report-to", "none", "--output", str(path)]
    start = time.perf_counter()
    with open(path.parent / f"seed{seed}.log", "w") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT)
    print(f"{algorithm} seed {seed}: {time.perf_counter() - start:.0f} s", file=sys.stderr)


def before_after(path: Path, metric: str) -> tuple[float, float] | None:
    """The metric at the run's first and last evaluation; None for an unfinished run."""
    rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    values = [row[metric] for row in rows if metric in row]
    if not (path / "final_model").exists() or len(values) < 2:
        return None
    return values[0], values[-1]


def collect(output: Path, algorithms: list[str]) -> dict[str, dict[int, tuple[float, float]]]:
    """``{algorithm: {seed: (before, after)}}`` of the finished runs under ``output``."""
    found: dict[str, dict[int, tuple[float, float]]] = {}
    for algorithm in algorithms:
        for path in sorted((output / algorithm).glob("seed*")):
            pair = before_after(path, task_metric(algorithm)) if path.is_dir() else None
            if pair is not None:
                found.setdefault(algorithm, {})[int(path.name.removeprefix("seed"))] = pair
    return found


def cpu_name() -> str:
    """The CPU model and whether it has AMX, as a label for the figures."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?")
    flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return model + (" with AMX" if "amx_bf16" in flags else " with AVX512-BF16" if "avx512_bf16" in flags else "")


def _mean_std(values: list[float]) -> str:
    return f"{statistics.mean(values):.3f}" + (f" ± {statistics.stdev(values):.3f}" if len(values) > 1 else "")


def report(found: dict[str, dict[int, tuple[float, float]]]) -> str:
    lines = [f"CPU: {cpu_name()}", "",
             "| preset | kind | metric | seeds | before | after (mean ± std) | gain | per seed (before -> after) |",
             "|---|---|---|---|---|---|---|---|"]
    for algorithm, runs in found.items():
        befores, afters = [b for b, _ in runs.values()], [a for _, a in runs.values()]
        gains = [a - b for b, a in runs.values()]
        per_seed = ", ".join(f"{s}: {b:.3f} -> {a:.3f}" for s, (b, a) in sorted(runs.items()))
        lines.append(f"| {algorithm} | {kind(algorithm)} | {task_metric(algorithm).removeprefix('eval/')} | "
                     f"{', '.join(map(str, sorted(runs)))} | {_mean_std(befores)} | {_mean_std(afters)} | "
                     f"{_mean_std(gains)} | {per_seed} |")
    return "\n".join(lines)


def figure(found: dict[str, dict[int, tuple[float, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(found)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(names) + 2), 3.8))
    for x, name in enumerate(names):
        runs = found[name]
        before = statistics.mean(b for b, _ in runs.values())
        afters = [a for _, a in runs.values()]
        ax.bar(x - 0.2, before, 0.4, color="#bbbbbb", label="before" if x == 0 else None)
        ax.bar(x + 0.2, statistics.mean(afters), 0.4, color="#3b7dd8", label="after" if x == 0 else None)
        ax.scatter([x + 0.2] * len(afters), afters, color="black", s=8, zorder=3)
    ax.set_xticks(range(len(names)), names, rotation=45, ha="right")
    ax.set_ylim(0, 1)
    ax.set_ylabel("held-out accuracy\n(reward_model: pairwise)")
    ax.set_title(f"Default runs on the built-in task ({cpu_name()})", fontsize=9)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS), help="comma-separated [default: every preset]")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds [default: 0]")
    parser.add_argument("--report-only", action="store_true", help="report the finished runs, run nothing")
    parser.add_argument("--figure", type=Path, help="where the figure goes [default: OUTPUT/default_runs.png]")
    args = parser.parse_args()
    algorithms = args.algorithms.split(",")
    if not args.report_only:
        for algorithm in algorithms:
            for seed in map(int, args.seeds.split(",")):
                run(args.output, algorithm, seed)
    found = collect(args.output, algorithms)
    print(report(found))
    figure(found, args.figure or args.output / "default_runs.png")


if __name__ == "__main__":
    main()
