"""Outcome against process rewards on the built-in addition task: does a reward at each scratchpad column
learn faster than the outcome alone?

    python benchmarks/process_rewards.py --output runs/process [--algorithms grpo,reinforce_pp] [--seeds 0,1]
    python benchmarks/process_rewards.py --output runs/process --report-only [--figure docs/figures/process_rewards.png]

Each run is the default run (``posttrain train``: 250 steps on ``tiny-addition``) of one preset on ``--task
addition`` (the outcome: 1 for the right sum) or ``--task addition-process`` (the outcome plus
``column_steps``, 1/columns at each column written as the reference writes it), trained one at a time; a
finished run (``final_model/`` present) is not run again. GRPO takes the steps as DeepSeekMath's process
supervision, REINFORCE++ as token rewards. The report prints held-out accuracy at every evaluation, its
mean after step 0 (how fast a run gets there) and the last, per run and averaged over seeds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

TASKS = {"outcome": "addition", "process": "addition-process"}


def run_dir(output: Path, algorithm: str, reward: str, seed: int) -> Path:
    return output / f"{algorithm}-{TASKS[reward]}-s{seed}"


def run(output: Path, algorithm: str, reward: str, seed: int, extra: list[str]) -> None:
    path = run_dir(output, algorithm, reward, seed)
    if (path / "final_model").exists():
        print(f"{path.name}: done already", file=sys.stderr)
        return
    command = [sys.executable, "-m", "posttrain", "train", "--algorithm", algorithm, "--task", TASKS[reward],
               "--seed", str(seed), "--no-progress", "--report-to", "none", "--output", str(path), *extra]
    output.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(output / f"{path.name}.log", "w") as log:
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=True)
    print(f"{path.name}: {time.perf_counter() - start:.0f} s", file=sys.stderr)


def curve(path: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]


def report(output: Path, algorithms: list[str], seeds: list[int], figure: Path | None) -> None:
    print("| preset | reward | seed | held-out accuracy (step: %) | mean after step 0 | last |")
    print("|---|---|---|---|---|---|")
    averaged: dict[tuple[str, str], list[list[tuple[int, float]]]] = {}
    for algorithm in algorithms:
        for reward in TASKS:
            for seed in seeds:
                path = run_dir(output, algorithm, reward, seed)
                if not (path / "metrics.jsonl").exists():
                    continue
                points = curve(path)
                after = [acc for step, acc in points if step > 0]
                print(f"| {algorithm} | {reward} | {seed} | {', '.join(f'{s}: {100 * a:.1f}' for s, a in points)} "
                      f"| {100 * sum(after) / max(len(after), 1):.1f} | {100 * points[-1][1]:.1f} |")
                averaged.setdefault((algorithm, reward), []).append(points)
    for (algorithm, reward), runs in averaged.items():
        after = [acc for points in runs for step, acc in points if step > 0]
        last = [points[-1][1] for points in runs]
        print(f"{algorithm} {reward}: mean after step 0 {100 * sum(after) / len(after):.1f}%, last "
              f"{100 * sum(last) / len(last):.1f}% over {len(runs)} seed(s)")
    if figure is not None and averaged:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(algorithms), figsize=(5.5 * len(algorithms), 4), sharey=True, squeeze=False)
        for ax, algorithm in zip(axes[0], algorithms):
            for reward, colour in (("outcome", "black"), ("process", "tab:blue")):
                for k, points in enumerate(averaged.get((algorithm, reward), [])):
                    steps, accuracy = zip(*points)
                    ax.plot(steps, [100 * a for a in accuracy], color=colour, marker="o", markersize=3,
                            alpha=0.9 if k == 0 else 0.5, label=reward if k == 0 else None)
            ax.set_title(algorithm)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            ax.legend()
        axes[0][0].set_ylabel("held-out accuracy (%)")
        fig.tight_layout()
        figure.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(figure, dpi=100)
        print(f"figure: {figure}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=Path("runs/process"))
    parser.add_argument("--algorithms", default="grpo,reinforce_pp")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--figure", type=Path, default=None)
    args, extra = parser.parse_known_args()
    algorithms, seeds = args.algorithms.split(","), [int(seed) for seed in args.seeds.split(",")]
    if not args.report_only:
        for seed in seeds:
            for reward in TASKS:
                for algorithm in algorithms:
                    run(args.output, algorithm, reward, seed, extra)
    report(args.output, algorithms, seeds, args.figure)


if __name__ == "__main__":
    main()
