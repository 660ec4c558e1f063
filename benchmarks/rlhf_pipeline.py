"""The RLHF pipeline end to end on the built-in addition task: SFT a base model, train a reward model on
preference pairs, then PPO and GRPO against that reward model, with the task's true held-out accuracy
logged next to the reward model's score, so reward hacking shows where it happens.

    python benchmarks/rlhf_pipeline.py --output runs/pipeline [--rl-steps 250]
    python benchmarks/rlhf_pipeline.py --output runs/pipeline --report-only [--figure docs/figures/rlhf_pipeline.png]

The stages are the commands the README lists (printed as they run), one at a time; a finished stage
(``final_model/`` present) is not run again:

1. ``sft``: ``tiny-addition-base`` (random weights, the tiny model's architecture and tokenizer) fine-tuned
   on the task's demonstrations (prompt, reference scratchpad);
2. ``reward_model``: a scalar head on the SFT model, its default run: pairs of the SFT model's own samples,
   a right answer against a wrong one of the same prompt (250 steps of 64 pairs);
3. ``ppo`` and ``grpo``: from the SFT model, rewarded by the reward model alone (``--reward-model``); the
   task's answer check still scores held-out accuracy.

Flags the script does not know go to the RL stages. The report prints each stage's held-out figures and, for the RL runs, held-out accuracy (the truth) and
the reward model's mean score of the greedy held-out completions (``eval/reward``, what the policy is
optimised for) at every evaluation; ``--figure`` draws both against steps.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

SFT = ["--algorithm", "sft", "--model", "tiny-addition-base", "--task", "addition", "--learning-rate", "1e-3",
       "--lr-schedule", "linear", "--max-steps", "300"]
REWARD_MODEL = ["--algorithm", "reward_model", "--task", "addition"]
RL = ["--task", "addition"]


def stages(output: Path, rl_steps: int) -> dict[str, list[str]]:
    sft_model, reward_model = str(output / "sft" / "final_model"), str(output / "reward_model" / "final_model")
    rl = [*RL, "--model", sft_model, "--reward-model", reward_model, "--max-steps", str(rl_steps)]
    return {"sft": SFT, "reward_model": [*REWARD_MODEL, "--model", sft_model],
            "ppo": ["--algorithm", "ppo", *rl], "grpo": ["--algorithm", "grpo", *rl]}


def run(output: Path, name: str, flags: list[str], extra: list[str]) -> None:
    path = output / name
    if (path / "final_model").exists():
        print(f"{name}: done already", file=sys.stderr)
        return
    command = ["posttrain", "train", *flags, "--output", str(path), *extra]
    print("$ " + shlex.join(command), file=sys.stderr)
    output.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(output / f"{name}.log", "w") as log:
        subprocess.run([sys.executable, "-m", "posttrain", *command[1:], "--no-progress", "--report-to", "none"],
                       stdout=log, stderr=subprocess.STDOUT, check=True)
    (path / "wall_seconds").write_text(f"{time.perf_counter() - start:.1f}\n")
    print(f"{name}: {time.perf_counter() - start:.0f} s", file=sys.stderr)


def evaluations(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if any(key.startswith("eval/") for key in r)]


def guard_summary(evals: list[dict]) -> str:
    """Where the reward-hacking guard fired and the best evaluation by held-out accuracy, the model it keeps
    (``best_model/``, or the starting model when nothing beat it)."""
    if not any("eval/divergence_streak" in r for r in evals):
        return "reward-hacking guard: not active"
    fired = [r["step"] for r in evals if r.get("eval/diverged")]
    best = max(evals, key=lambda r: r["eval/accuracy"])  # the first of equals, as the guard keeps it
    kept = f"best_model/ from step {best['step']}" if best["step"] else "the starting model (nothing better)"
    return (f"reward-hacking guard: {'fired at step ' + str(fired[0]) if fired else 'did not fire'}; best by "
            f"held-out accuracy: {kept}, accuracy {100 * best['eval/accuracy']:.1f}%, reward-model score "
            f"{best['eval/reward']:.2f}")


def report(output: Path, figure: Path | None) -> None:
    curves = {}
    for name in ("sft", "reward_model", "ppo", "grpo"):
        path = output / name
        if not (path / "metrics.jsonl").exists():
            continue
        evals = evaluations(path)
        wall = path / "wall_seconds"
        seconds = f"{float(wall.read_text()):.0f} s" if wall.exists() else "?"
        first, last = evals[0], evals[-1]
        shown = {k: v for k, v in last.items() if k.startswith("eval/") and not k.endswith(("_low", "_high"))}
        print(f"{name} ({seconds}): " + ", ".join(f"{k.removeprefix('eval/')} {first.get(k, float('nan')):.3f} -> "
                                                  f"{v:.3f}" for k, v in sorted(shown.items())))
        if name in ("ppo", "grpo"):
            curves[name] = [(r["step"], r["eval/accuracy"], r["eval/reward"]) for r in evals
                            if "eval/accuracy" in r and "eval/reward" in r]
            print("  step: held-out accuracy / reward-model score  " +
                  ", ".join(f"{s}: {100 * a:.1f}% / {rm:.2f}" for s, a, rm in curves[name]))
            print("  " + guard_summary(evals))
    if figure is not None and curves:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(curves), figsize=(5.5 * len(curves), 4), squeeze=False)
        for ax, (name, points) in zip(axes[0], curves.items()):
            steps, accuracy, score = zip(*points)
            ax.plot(steps, [100 * a for a in accuracy], color="black", marker="o", markersize=3,
                    label="held-out accuracy (%), the task's check")
            ax.set_xlabel("step")
            ax.set_ylabel("held-out accuracy (%)")
            twin = ax.twinx()
            twin.plot(steps, score, color="tab:red", marker="s", markersize=3, label="reward model's score")
            twin.set_ylabel("reward model's mean score", color="tab:red")
            for step in [r["step"] for r in evaluations(output / name) if r.get("eval/diverged")]:
                ax.axvline(step, color="tab:red", linestyle="--", linewidth=1, label="the guard fires")
            ax.set_title(f"{name} against the reward model")
            ax.grid(alpha=0.3)
            lines = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
            ax.legend(lines, [line.get_label() for line in lines], loc="lower right", fontsize=8)
        fig.tight_layout()
        figure.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(figure, dpi=100)
        print(f"figure: {figure}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=Path("runs/pipeline"))
    parser.add_argument("--rl-steps", type=int, default=250)
    parser.add_argument("--only", default="sft,reward_model,ppo,grpo", help="stages to run, comma-separated")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--figure", type=Path, default=None)
    args, extra = parser.parse_known_args()
    if not args.report_only:
        for name, flags in stages(args.output, args.rl_steps).items():
            if name in args.only.split(","):  # other flags are the RL stages' (the SFT and reward model take theirs)
                run(args.output, name, flags, extra if name in ("ppo", "grpo") else [])
    report(args.output, args.figure)


if __name__ == "__main__":
    main()
