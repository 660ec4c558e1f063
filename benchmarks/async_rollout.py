"""Synchronous against asynchronous rollouts on the default run: throughput and held-out accuracy.

    python benchmarks/async_rollout.py --output runs/async [--only sync,k1] [--seeds 0,1] [--max-steps 250]
    python benchmarks/async_rollout.py --output runs/async --report-only [--figure docs/figures/async_rollout.png]

Each setting is the default run (``posttrain train``: GRPO on ``tiny-addition``) with the flags below,
trained one at a time (a figure that matters gets the machine alone). An asynchronous run gives the
trainer and the rollout process one torch thread each (``OMP_NUM_THREADS=1``): on 2 cores that beats
two threads each, which oversubscribes them. A finished run (``final_model/`` present) is not run again.
The report prints, per setting: wall time, the trainer's and the sampler's seconds per step, samples per
second, the mean staleness and mismatch KL, and held-out accuracy at every evaluation; ``--figure``
draws held-out accuracy against steps and against training time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SETTINGS: dict[str, tuple[list[str], dict[str, str]]] = {
    "sync": ([], {}),
    # one core's worth of trainer, sampling included: what K=1 becomes when its sampler has a core (a device)
    # of its own, as it does beside the one-thread trainer of the asynchronous settings
    "sync-1t": ([], {"OMP_NUM_THREADS": "1"}),
    "k1": (["--async-rollout", "--max-staleness", "1"], {"OMP_NUM_THREADS": "1"}),
    "k2": (["--async-rollout", "--max-staleness", "2"], {"OMP_NUM_THREADS": "1"}),
    "k1-tis": (["--async-rollout", "--max-staleness", "1", "--correction", "token-truncate"], {"OMP_NUM_THREADS": "1"}),
    "k2-tis": (["--async-rollout", "--max-staleness", "2", "--correction", "token-truncate"], {"OMP_NUM_THREADS": "1"}),
    "k8": (["--async-rollout", "--max-staleness", "8"], {"OMP_NUM_THREADS": "1"}),
    "k8-tis": (["--async-rollout", "--max-staleness", "8", "--correction", "token-truncate"], {"OMP_NUM_THREADS": "1"}),
}


def run_name(name: str, seed: int) -> str:
    return name if seed == 0 else f"{name}-seed{seed}"


def run(output: Path, name: str, seed: int, max_steps: int | None, extra: list[str]) -> None:
    flags, env = SETTINGS[name]
    run_dir = output / run_name(name, seed)
    if (run_dir / "final_model").exists():
        print(f"{name}: done already ({run_dir})", file=sys.stderr)
        return
    command = [sys.executable, "-m", "posttrain", "train", *flags, *extra, "--seed", str(seed), "--no-progress",
               "--output", str(run_dir)]
    if max_steps:
        command += ["--max-steps", str(max_steps)]
    output.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(output / f"{run_dir.name}.log", "w") as log:
        subprocess.run(command, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT, check=True)
    (run_dir / "wall_seconds").write_text(f"{time.perf_counter() - start:.1f}\n")
    print(f"{run_dir.name}: {time.perf_counter() - start:.0f} s", file=sys.stderr)


def summary(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "time/step" in r]
    config = {}
    for line in (run_dir / "config.yaml").read_text().splitlines():
        key, _, value = line.partition(":")
        config[key.strip()] = value.strip()
    samples = int(config.get("prompts_per_step", 0) or 0) * int(config.get("group_size", 0) or 0)

    def mean(key: str) -> float:
        values = [r[key] for r in steps if key in r]
        return sum(values) / len(values) if values else float("nan")

    elapsed, curve = 0.0, []
    for r in rows:
        elapsed += r.get("time/step", 0.0)
        if "eval/accuracy" in r:
            curve.append((r["step"], elapsed, r["eval/accuracy"]))
    wall = run_dir / "wall_seconds"
    return {"steps": len(steps), "wall": float(wall.read_text()) if wall.exists() else float("nan"),
            "step_s": mean("time/step"), "generation_s": mean("time/generation"), "wait_s": mean("time/rollout_wait"),
            "training_s": mean("time/training"), "samples_per_s": samples / mean("time/step"),
            "staleness": mean("staleness/mean"), "kl_k3": mean("mismatch/kl_k3"), "curve": curve}


def report(output: Path, names: list[str], figure: Path | None) -> None:
    found = {name: summary(output / name) for name in names if (output / name / "metrics.jsonl").exists()}
    for name, s in found.items():
        after = [acc for step, _, acc in s["curve"] if step > 0]
        s["mean"] = sum(after) / len(after) if after else float("nan")
    print("| setting | wall | s/step | sampling s/step | trainer waits s/step | training s/step | samples/s "
          "| staleness | mismatch k3 KL | held-out accuracy (step: %) | mean after step 0 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, s in found.items():
        curve = ", ".join(f"{step}: {100 * acc:.1f}" for step, _, acc in s["curve"])
        print(f"| {name} | {s['wall']:.0f} s | {s['step_s']:.3f} | {s['generation_s']:.3f} | {s['wait_s']:.3f} "
              f"| {s['training_s']:.3f} | {s['samples_per_s']:.0f} | {s['staleness']:.2f} | {s['kl_k3']:.1e} | {curve} "
              f"| {100 * s['mean']:.1f} |")
    if figure is not None and found:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
        colours = {"sync": "black", "k1": "tab:blue", "k2": "tab:green", "k8": "tab:red"}
        for name, s in found.items():
            steps, seconds, accuracy = zip(*s["curve"])
            base = name.split("-")[0]  # a setting's correction: the same colour, dashed
            style = dict(marker="o", markersize=3, label=name, color=colours.get(base),
                         linestyle="--" if "-tis" in name else "-")
            axes[0].plot(steps, [100 * a for a in accuracy], **style)
            axes[1].plot([t / 60 for t in seconds], [100 * a for a in accuracy], **style)
        axes[0].set_xlabel("step")
        axes[1].set_xlabel("training time (min, evaluation excluded)")
        axes[0].set_ylabel("held-out accuracy (%)")
        for ax in axes:
            ax.grid(alpha=0.3)
        axes[1].legend()
        fig.tight_layout()
        figure.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(figure, dpi=100)
        print(f"figure: {figure}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=Path("runs/async"))
    parser.add_argument("--only", default=",".join(SETTINGS), help="settings to run and report, comma-separated")
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--seeds", default="0", help="seeds to run each setting with, comma-separated (seed k > 0 "
                        "writes NAME-seedk)")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--figure", type=Path, default=None)
    args, extra = parser.parse_known_args()
    names = args.only.split(",")
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        parser.error(f"--only: unknown setting(s) {', '.join(unknown)}; known: {', '.join(SETTINGS)}")
    seeds = [int(seed) for seed in args.seeds.split(",")]
    if not args.report_only:
        for seed in seeds:
            for name in names:
                run(args.output, name, seed, args.max_steps, extra)
    report(args.output, [run_name(name, seed) for name in names for seed in seeds], args.figure)


if __name__ == "__main__":
    main()
