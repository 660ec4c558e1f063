"""What a reward model trained on the built-in task ranks right, by the kind of mistake in the rejected answer.

    python benchmarks/reward_model_errors.py RUN_DIR [RUN_DIR ...]

Each RUN_DIR is a finished ``posttrain train --algorithm reward_model`` run on the built-in addition task
with its default data (the starting model's own samples). The held-out pairs are drawn again exactly as the
run drew them (same seed, same starting model), scored by ``RUN_DIR/final_model`` through ``RewardModel``, and
each pair's rejected completion is put in one class:

- ``malformed``: not a scratchpad of ``x+y=s`` columns, a ``|`` and a number;
- ``answer off its columns``: well formed, but the final number is not what its own columns add up to;
- ``wrong column``: the answer follows from the columns, and a column is wrong (a slip or a dropped carry);
- ``columns right, answer wrong``: every column right and the answer still wrong (a missing final carry).

Printed: pairwise accuracy (ties count half) per class and overall, with each class's share of the pairs.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from posttrain.config import Config, load_yaml
from posttrain.data.preference import preference_task
from posttrain.data.rewards import RewardModel
from posttrain.data.tasks.addition import DELIMITER, scratchpad
from posttrain.parallel import distributed
from posttrain.training.reward_model import policy_pairs
from posttrain.training.setup import Inputs, model_name

COLUMN = re.compile(r"^(\d)\+(\d)(\+1)?=(\d{1,2})$")


def mistake(prompt: str, completion: str) -> str:
    """The class of a wrong completion of ``prompt`` (``"a+b="``), as the module docstring defines them."""
    a, b = (int(x) for x in prompt.rstrip("=").split("+"))
    work, _, answer = completion.strip().partition(DELIMITER)
    columns = [COLUMN.match(part) for part in work.split(",")] if work else []
    if not answer.strip().isdigit() or not columns or not all(columns):
        return "malformed"
    from_columns = sum(int(m.group(4)) % 10 * 10**k for k, m in enumerate(columns))
    from_columns += int(columns[-1].group(4)) // 10 * 10 ** len(columns)
    if int(answer) != from_columns:
        return "answer off its columns"
    right = scratchpad(a, b).split(DELIMITER)[0].split(",")
    return "wrong column" if work.split(",") != right else "columns right, answer wrong"


def report(run_dir: Path) -> str:
    config = Config.from_flat(load_yaml(run_dir / "config.yaml"))
    task = preference_task(config.data.task)
    distributed.seed(config.run.seed)  # as the run seeded its sampling: its training pairs, then these
    _, test = policy_pairs(config, model_name(config, task.source.default_model, Inputs()), task)
    test = test[:config.data.eval_size]
    scorer = RewardModel(run_dir / "final_model", batch_size=64)
    chosen = scorer([r["prompt"] for r in test], [r["chosen"] for r in test])
    rejected = scorer([r["prompt"] for r in test], [r["rejected"] for r in test])
    by_class: dict[str, list[float]] = {}
    for row, c, r in zip(test, chosen, rejected):
        by_class.setdefault(mistake(row["prompt"], row["rejected"]), []).append(1.0 if c > r else 0.5 if c == r else 0.0)
    lines = [f"{run_dir}: {len(test)} held-out pairs",
             "| rejected completion | share of pairs | pairwise accuracy |", "|---|---|---|"]
    for name, wins in sorted(by_class.items(), key=lambda item: -len(item[1])):
        lines.append(f"| {name} | {len(wins) / len(test):.3f} | {sum(wins) / len(wins):.3f} |")
    every = [w for wins in by_class.values() for w in wins]
    lines.append(f"| all | 1.000 | {sum(every) / len(every):.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    for run_dir in parser.parse_args().runs:
        print(report(run_dir))


if __name__ == "__main__":
    main()
