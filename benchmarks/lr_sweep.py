"""Learning-rate sweep of online presets on the built-in task: held-out accuracy per (preset, rate).

    .venv/bin/python benchmarks/lr_sweep.py --algorithms cispo,dr_grpo --learning-rates 1e-4,3e-5,1e-5 \\
        --max-steps 100 --seeds 1 --jobs 2 --output runs/lr-sweep

Each rate is one ``posttrain compare`` (resumable: run the same command again after an
interruption) in ``OUTPUT/lr<rate>/``, every other setting the default run's unless given after
``--``, e.g. ``-- --prompts-per-step 16``. Prints one row per (preset, rate): held-out greedy
accuracy before and after (mean over seeds), the gain, and the last evaluation's step. The rates
the presets default to (``OnlineAlgorithm.learning_rate``) come from this script's output,
reported in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from posttrain.cli import build_parser
from posttrain.report.compare import compare, flat_from_args
from posttrain.tracking.metrics import read_metrics


def accuracy_curve(run_dir: Path) -> list[tuple[int, float]]:
    """(step, held-out accuracy) of every evaluation the run logged."""
    return [(int(row["step"]), float(row["eval/accuracy"])) for row in read_metrics(run_dir) if "eval/accuracy" in row]


def main(argv: list[str] | None = None) -> int:
    own = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    own.add_argument("--algorithms", required=True, help="comma-separated online presets")
    own.add_argument("--learning-rates", required=True, help="comma-separated rates, e.g. 1e-4,3e-5,1e-5")
    own.add_argument("--max-steps", type=int, default=100)
    own.add_argument("--seeds", default="1", help="as posttrain compare's --seeds [default: 1]")
    own.add_argument("--jobs", type=int, default=1)
    own.add_argument("--output", required=True)
    args, rest = own.parse_known_args(argv)
    rest = [a for a in rest if a != "--"]
    rows = []
    for rate in args.learning_rates.split(","):
        output = Path(args.output) / f"lr{rate}"
        parsed = build_parser().parse_args(["compare", "--algorithms", args.algorithms, "--seeds", args.seeds,
                                            "--output", str(output), "--learning-rate", rate,
                                            "--max-steps", str(args.max_steps), *rest])
        result = compare(parsed.algorithms, seeds=parsed.seeds, output=parsed.output, flat=flat_from_args(parsed),
                         jobs=args.jobs)
        for name in parsed.algorithms:
            curves = [accuracy_curve(d) for d in result["run_dirs"] if Path(d).parent.name == name]
            curves = [c for c in curves if c]
            if not curves:
                rows.append((name, rate, None, None, None))
                continue
            before = sum(c[0][1] for c in curves) / len(curves)
            after = sum(c[-1][1] for c in curves) / len(curves)
            rows.append((name, rate, before, after, min(c[-1][0] for c in curves)))
    print(f"{'preset':<24}{'lr':>8}{'before':>9}{'after':>9}{'gain':>8}  last eval step")
    for name, rate, before, after, step in sorted(rows, key=lambda r: (r[0], float(r[1]))):
        if before is None:
            print(f"{name:<24}{rate:>8}{'failed':>9}")
        else:
            print(f"{name:<24}{rate:>8}{before:>9.3f}{after:>9.3f}{after - before:>+8.3f}  {step}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
