"""A real model learns to use a tool: SmolLM2-135M-Instruct with the calculator on grade-school word problems.

    python benchmarks/tool_use.py --output runs/tool-use [--jobs 2]
    python benchmarks/tool_use.py --output runs/tool-use --report-only [--figure docs/figures/tool_use.png]

RL reinforces what the policy samples, and SmolLM2-135M-Instruct almost never writes a tool call. So the
tool arm starts from a short SFT warm start on the task's tool-call demonstrations (a call, the result the
episode inserts, untrained, and the answer). Every arm then runs the same RL budget (Dr.GRPO, the same
settings as the recipe's, 20 steps of 8 prompts x 4 samples), and every model is scored greedily on the same
200 held-out problems, with ``tool_call_rate`` the share of episodes that call the calculator:

- ``sft-tool`` -> ``rl-warm``: the warm start, then RL with the tool (``--task gsm-calculator``);
- ``rl-tool``: RL with the tool from the instruct model, no warm start;
- ``rl-notool``: RL without a tool (``--task gsm``);
- ``sft-notool`` -> ``rl-warm-notool``: the control, the same warm start without the tool (demonstrations
  "EXPRESSION = N. The answer is N."), then RL without one: what the warm start gives by itself.

The instruct model itself is scored on both tasks (``base``). Stages run ``--jobs`` at a time (one thread
each); a stage whose output exists is not run again. The report prints the table docs/results.md shows.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MODEL = "smollm2-135m"
LORA = ["--lora-r", "16", "--lora-alpha", "32", "--mixed-precision", "bf16"]
SFT = ["--algorithm", "sft", *LORA, "--pairs-per-step", "16", "--learning-rate", "2e-4", "--lr-schedule", "linear",
       "--max-steps", "30", "--eval-size", "0", "--eval-every", "0"]
RL = ["--algorithm", "dr_grpo", "--mini-batches", "1", *LORA, "--prompts-per-step", "8", "--group-size", "4",
      "--temperature", "0.7", "--learning-rate", "1e-4", "--max-steps", "20", "--micro-batch-size", "16",
      "--eval-size", "0", "--eval-every", "0"]
EVAL_SIZE = 200

# stage -> (its task, the stage whose final model it starts from, or None for the instruct model, its flags)
STAGES: dict[str, tuple[str, str | None, list[str]]] = {
    "sft-tool": ("gsm-calculator", None, SFT),
    "rl-warm": ("gsm-calculator", "sft-tool", RL),
    "rl-tool": ("gsm-calculator", None, RL),
    "rl-notool": ("gsm", None, RL),
    "sft-notool": ("gsm", None, SFT),
    "rl-warm-notool": ("gsm", "sft-notool", RL),
}
ROWS = [  # (label, stage evaluated, task)
    ("SmolLM2-135M-Instruct, with the tool", "base", "gsm-calculator"),
    ("SmolLM2-135M-Instruct, no tool", "base", "gsm"),
    ("warm start on tool calls (SFT, 30 steps)", "sft-tool", "gsm-calculator"),
    ("  then RL with the tool", "rl-warm", "gsm-calculator"),
    ("RL with the tool, no warm start", "rl-tool", "gsm-calculator"),
    ("RL, no tool", "rl-notool", "gsm"),
    ("control: warm start without the tool (SFT, 30 steps)", "sft-notool", "gsm"),
    ("  then RL, no tool", "rl-warm-notool", "gsm"),
]


def posttrain(args: list[str], log: Path) -> float:
    print("$ posttrain " + shlex.join(args), file=sys.stderr)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    start = time.perf_counter()
    with open(log, "w") as out:
        subprocess.run([sys.executable, "-m", "posttrain", *args], stdout=out, stderr=subprocess.STDOUT, check=True,
                       env=env)
    return time.perf_counter() - start


def model_of(output: Path, stage: str | None) -> str:
    return MODEL if stage in (None, "base") else str(output / stage / "final_model")


def run_stage(output: Path, stage: str) -> None:
    task, start, flags = STAGES[stage]
    if not (output / stage / "final_model").exists():
        seconds = posttrain(["train", *flags, "--model", model_of(output, start), "--task", task,
                             "--output", str(output / stage), "--no-progress", "--report-to", "none"],
                            output / f"{stage}.log")
        print(f"{stage}: {seconds / 60:.1f} min", file=sys.stderr)
    evaluate(output, stage, [task])


def evaluate(output: Path, stage: str, tasks: list[str]) -> None:
    result = output / f"eval-{stage}.json"
    if not result.exists():
        posttrain(["eval", "--model", model_of(output, stage), *(f for t in tasks for f in ("--task", t)),
                   "--eval-size", str(EVAL_SIZE), "--output", str(result)], output / f"eval-{stage}.log")


def chains() -> list[list[str]]:
    """The stages as chains that run one after another; the chains run side by side."""
    return [["sft-tool", "rl-warm"], ["rl-tool", "rl-notool"], ["sft-notool", "rl-warm-notool"]]


def training_curve(output: Path, stage: str) -> list[dict]:
    path = output / stage / "metrics.jsonl"
    if not path.exists():
        return []
    return [row for row in map(json.loads, path.read_text().splitlines()) if "reward/mean" in row]


def report(output: Path) -> str:
    lines = ["| model | problems | greedy accuracy [95% CI] | episodes calling the tool [95% CI] | calls per episode |",
             "|---|---|---|---|---|"]
    for label, stage, task in ROWS:
        path = output / f"eval-{stage}.json"
        if not path.exists():
            continue
        m = json.loads(path.read_text())["tasks"][task]
        calls = (f"{m['tool_call_rate']:.1%} [{m['tool_call_rate_low']:.1%}, {m['tool_call_rate_high']:.1%}] | "
                 f"{m['tool_calls']:.2f}" if "tool_call_rate" in m else "no tool | ")
        lines.append(f"| {label} ({task}) | {m['problems']} | {m['accuracy']:.1%} [{m['accuracy_low']:.1%}, "
                     f"{m['accuracy_high']:.1%}] | {calls} |")
    lines += ["", "| RL run | reward, steps 1-5 | reward, steps 16-20 | tool calls per episode, steps 1-5 | "
                  "steps 16-20 | training time |", "|---|---|---|---|---|---|"]
    for stage in ("rl-warm", "rl-tool", "rl-notool", "rl-warm-notool"):
        curve = training_curve(output, stage)
        if len(curve) < 20:
            continue

        def mean(key: str, rows: list[dict]) -> float:
            return sum(r.get(key, 0.0) for r in rows) / len(rows)

        first, last = curve[:5], curve[15:20]
        minutes = sum(r.get("time/step", 0.0) for r in curve) / 60
        lines.append(f"| {stage} | {mean('reward/mean', first):.3f} | {mean('reward/mean', last):.3f} | "
                     f"{mean('episode/tool_calls', first):.2f} | {mean('episode/tool_calls', last):.2f} | "
                     f"{minutes:.0f} min |")
    return "\n".join(lines)


def figure(output: Path, path: Path, commit: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for stage, label in (("rl-warm", "warm start + RL, tool"), ("rl-tool", "RL, tool"), ("rl-notool", "RL, no tool"),
                         ("rl-warm-notool", "warm start without tool + RL")):
        curve = training_curve(output, stage)
        if not curve:
            continue
        steps = [r["step"] for r in curve]
        left.plot(steps, [r["reward/mean"] for r in curve], label=label)
        right.plot(steps, [r.get("episode/tool_calls", 0.0) for r in curve], label=label)
    left.set(xlabel="RL step", ylabel="training reward (share right)", ylim=(0, 1))
    right.set(xlabel="RL step", ylabel="tool calls per episode", ylim=(-0.05, 1.5))
    left.legend(fontsize=8)
    fig.suptitle(f"SmolLM2-135M-Instruct with a calculator: benchmarks/tool_use.py, commit {commit}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--jobs", type=int, default=2, help="chains of stages run side by side (one thread each)")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--figure", type=Path)
    parser.add_argument("--commit", help="the commit the runs came from, for the figure's title [default: HEAD]")
    args = parser.parse_args()
    if not args.report_only:
        args.output.mkdir(parents=True, exist_ok=True)
        with ThreadPoolExecutor(args.jobs) as pool:
            jobs = [pool.submit(lambda chain=chain: [run_stage(args.output, stage) for stage in chain])
                    for chain in chains()]
            jobs.append(pool.submit(evaluate, args.output, "base", ["gsm-calculator", "gsm"]))
            for job in jobs:
                job.result()
    print(report(args.output))
    if args.figure:
        commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                               text=True).stdout.strip()
        figure(args.output, args.figure, commit)


if __name__ == "__main__":
    main()
