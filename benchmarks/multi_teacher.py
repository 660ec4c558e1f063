"""Multi-teacher on-policy distillation on an arithmetic mixture: a teacher per family against one teacher for all.

    python benchmarks/multi_teacher.py --output runs/multi-teacher [--seeds 0,1,2] [--baseline-seeds 0]
    python benchmarks/multi_teacher.py --output runs/multi-teacher --report-only

The mixture is the built-in addition task's problems in two families: ``short`` (both operands at most two
digits) and ``long`` (an operand of three digits). The steps, each a ``posttrain`` command (printed as it runs;
a finished run, one with ``final_model/``, is not run again):

1. **Data**: the task's training and held-out rows (seed 0) as ``OUTPUT/data/{train,test}_{all,short,long}.jsonl``,
   each row's family in its ``task`` column.
2. **Teachers**: the default GRPO run from ``tiny-addition``, one per family on that family's training rows
   alone, scored by the task's own reward (``posttrain/data/tasks/addition.py:accuracy``).
3. **Student**: ``tiny-addition-base`` after 240 SFT steps, the on-policy distillation student of the results.
4. **Distillation** from the student at the default budget, per seed, on the whole mixture:
   ``multi_teacher_distill`` with each family's teacher (``--teachers short=... --teachers long=...``), and
   ``on_policy_distill`` from each teacher alone (at ``--baseline-seeds``, by default the same seeds).
5. **Evaluation**: every model's held-out greedy accuracy on each family (``posttrain eval``).

The report is one table: each model's accuracy on the short and the long held-out problems and on all of them
(per seed and as the mean), with the machine's CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from default_runs import cpu_name

from posttrain.data.tasks.addition import make_rows

REWARD = str(Path(__file__).resolve().parent.parent / "posttrain" / "data" / "tasks" / "addition.py") + ":accuracy"
FAMILIES = ("short", "long")
COMMON = ["--no-progress", "--report-to", "none", "--max-new-tokens", "32"]


def family(row: dict) -> str:
    """``long`` when an operand has three digits, else ``short``."""
    a, b = row["prompt"].removesuffix("=").split("+")
    return "long" if max(len(a), len(b)) == 3 else "short"


def write_data(data: Path) -> None:
    train, test = make_rows(0, 20_000, 500)
    data.mkdir(parents=True, exist_ok=True)
    for split, rows in (("train", train), ("test", test)):
        tagged = [{**row, "task": family(row)} for row in rows]
        for part in ("all", *FAMILIES):
            chosen = [row for row in tagged if part == "all" or row["task"] == part]
            (data / f"{split}_{part}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in chosen))


def train(path: Path, *flags: str) -> None:
    if (path / "final_model").exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "posttrain", "train", *flags, *COMMON, "--output", str(path)]
    print(" ".join(command[1:]), file=sys.stderr, flush=True)
    start = time.perf_counter()
    with open(path.with_suffix(".log"), "w") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT)
    print(f"  {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)


def evaluate(model: Path | str, data: Path, out: Path) -> dict[str, float]:
    """``{family: held-out greedy accuracy}`` (``all`` too), cached in ``out``."""
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        result = {}
        for part in ("all", *FAMILIES):
            file = out.with_name(f"{out.stem}_{part}.json")
            subprocess.run([sys.executable, "-m", "posttrain", "eval", "--model", str(model), "--dataset",
                            str(data / f"test_{part}.jsonl"), "--reward", REWARD, "--max-new-tokens", "32",
                            "--output", str(file)], check=True, stdout=subprocess.DEVNULL)
            result[part] = accuracy_of(json.loads(file.read_text()))
        out.write_text(json.dumps(result))
    return json.loads(out.read_text())


def accuracy_of(result: dict) -> float:
    """The held-out accuracy in ``posttrain eval --output``'s JSON (one dataset)."""
    (scores,) = result["tasks"].values()
    return float(scores["accuracy"])


def run_all(output: Path, seeds: list[int], baseline_seeds: list[int]) -> None:
    data = output / "data"
    write_data(data)
    teachers = {part: output / f"teacher_{part}" for part in FAMILIES}
    for part, path in teachers.items():
        train(path, "--algorithm", "grpo", "--model", "tiny-addition", "--dataset", str(data / f"train_{part}.jsonl"),
              "--eval-dataset", str(data / f"test_{part}.jsonl"), "--reward", REWARD, "--eval-every", "50")
    student = output / "student"
    train(student, "--algorithm", "sft", "--model", "tiny-addition-base", "--task", "addition",
          "--learning-rate", "1e-3", "--lr-schedule", "linear", "--max-steps", "240")
    mixture = ["--model", str(student / "final_model"), "--dataset", str(data / "train_all.jsonl"),
               "--eval-dataset", str(data / "test_all.jsonl"), "--reward", REWARD, "--eval-every", "50"]
    for seed in seeds:
        train(output / "multi_teacher_distill" / f"seed{seed}", "--algorithm", "multi_teacher_distill", *mixture,
              "--seed", str(seed), *[f"--teachers={part}={teachers[part] / 'final_model'}" for part in FAMILIES])
        for part in FAMILIES if seed in baseline_seeds else ():
            train(output / f"on_policy_distill_{part}" / f"seed{seed}", "--algorithm", "on_policy_distill",
                  *mixture, "--seed", str(seed), "--teacher", str(teachers[part] / "final_model"))


def report(output: Path) -> str:
    data = output / "data"
    models = {"start (`tiny-addition`)": ("start", "tiny-addition")}
    for part in FAMILIES:
        models[f"teacher, GRPO on the {part} problems alone"] = (f"teacher_{part}",
                                                                 output / f"teacher_{part}" / "final_model")
    models["student (`tiny-addition-base` + 240 SFT steps)"] = ("student", output / "student" / "final_model")
    lines = [f"CPU: {cpu_name()}", "", "| model | seeds | short problems | long problems | all (mean; per seed) |",
             "|---|---|---|---|---|"]
    for name, (tag, model) in models.items():
        if model == "tiny-addition" or Path(model).exists():
            acc = evaluate(model, data, output / "eval" / f"{tag}.json")
            lines.append(f"| {name} | | {acc['short']:.3f} | {acc['long']:.3f} | {acc['all']:.3f} |")
    for preset in ("multi_teacher_distill", *(f"on_policy_distill_{part}" for part in FAMILIES)):
        runs = sorted(p for p in (output / preset).glob("seed*") if (p / "final_model").exists())
        if not runs:
            continue
        accs = [evaluate(p / "final_model", data, output / "eval" / f"{preset}_{p.name}.json") for p in runs]
        mean = {part: statistics.mean(a[part] for a in accs) for part in ("all", *FAMILIES)}
        per_seed = ", ".join(f"{a['all']:.3f}" for a in accs)
        label = ("`multi_teacher_distill`, each family's teacher" if preset == "multi_teacher_distill"
                 else f"`on_policy_distill`, the {preset.rsplit('_', 1)[1]} teacher for all")
        lines.append(f"| {label} | {', '.join(p.name.removeprefix('seed') for p in runs)} | {mean['short']:.3f} | "
                     f"{mean['long']:.3f} | {mean['all']:.3f} ({per_seed}) |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated distillation seeds [default: 0,1,2]")
    parser.add_argument("--baseline-seeds", help="comma-separated seeds of the one-teacher runs [default: --seeds]")
    parser.add_argument("--report-only", action="store_true", help="report the finished runs, run nothing")
    args = parser.parse_args()
    if not args.report_only:
        seeds = [int(s) for s in args.seeds.split(",")]
        run_all(args.output, seeds, [int(s) for s in args.baseline_seeds.split(",")] if args.baseline_seeds else seeds)
    print(report(args.output))


if __name__ == "__main__":
    main()
