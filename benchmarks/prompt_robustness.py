"""What a model learned, asked many ways: accuracy per prompt variant before and after training, the
reply lengths, and why the wrong replies are wrong.

Reads the ``--completions`` JSONL files of ``posttrain eval --prompt-variants ...`` (one per model,
the same problems and variants) and prints, per variant, each model's greedy accuracy, its mean
reply length and the share of replies cut off by the token budget; the mean over variants and the
worst; then, over every wrong reply, what went wrong:

- ``cut off``: the reply reached the token budget before it gave an answer it could finish;
- ``arithmetic``: the reply writes an equation whose result is wrong (``3 * 13 = 33``);
- ``setup``: every equation it writes is right, but the answer is not (the wrong operation, a number
  misread or left out: a reading error);
- ``no answer``: nothing to read an answer from.

Every file is rescored with the same parser (:func:`posttrain.data.rewards.final_answer`), so
figures from evaluations run at different commits compare. With ``--samples N`` it also prints N
problems' replies before and after under each of a few variants::

    posttrain eval --model smollm2-135m --task reasoning-gym:gsm_templates --prompt-variants eval \\
        --eval-size 100 --max-new-tokens 256 --completions before.jsonl
    posttrain eval --model runs/smollm2-math/final_model ... --completions after.jsonl
    python benchmarks/prompt_robustness.py before.jsonl after.jsonl --max-new-tokens 256 --samples 3
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from posttrain.data.rewards import final_answer, parse_number
from posttrain.tracking.stats import across_variants

_NUM = r"\$?\d+(?:,\d{3})*(?:\.\d+)?"
EQUATION = re.compile(rf"((?:{_NUM}\s*[-+*/x×]\s*)+{_NUM})\s*=\s*(-?{_NUM})")
"""A written equation: numbers joined by + - * / x, then = and its claimed result."""


def wrong_equations(text: str) -> list[str]:
    """The equations in ``text`` whose claimed result is not what their left side computes.

    >>> wrong_equations("3 * 13 = 33, then 33 + 2 = 35 and $4 x 5 = $20")
    ['3 * 13 = 33']
    """
    wrong = []
    for match in EQUATION.finditer(text):
        left = match.group(1).replace("$", "").replace(",", "").replace("x", "*").replace("×", "*")
        try:
            value = eval(left, {"__builtins__": {}})  # digits and + - * / only, by the pattern
        except (SyntaxError, ZeroDivisionError):
            continue
        claimed = float(match.group(2).replace("$", "").replace(",", ""))
        if abs(value - claimed) > 1e-6 * max(1.0, abs(value)):
            wrong.append(match.group(0))
    return wrong


def is_right(record: dict[str, Any]) -> bool:
    """Whether the reply's answer, read however it is written, is the reference number."""
    answer = parse_number(final_answer(record["completion"], record.get("question")))
    return answer is not None and answer == float(record["answer"])


def failure(record: dict[str, Any], budget: int) -> str:
    """Why a wrong reply is wrong: cut off, arithmetic, setup or no answer (module docstring)."""
    if record["length"] >= budget:
        return "cut off"
    if wrong_equations(record["completion"]):
        return "arithmetic"
    if final_answer(record["completion"]) is None:
        return "no answer"
    return "setup"


def read(path: Path) -> dict[str, list[dict[str, Any]]]:
    """The records of an eval completions file by variant, in problem order."""
    by_variant: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for line in path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        by_variant[record.get("variant") or "task prompt"].append(record)
    return dict(by_variant)


def report(paths: list[Path], budget: int, samples: int, sample_variants: list[str]) -> str:
    models = {path.stem: read(path) for path in paths}
    variants = list(next(iter(models.values())))
    lines = ["| variant | " + " | ".join(f"{name}: accuracy, length, cut off" for name in models) + " |",
             "|---|" + "---|" * len(models)]
    verdicts = {name: {v: [is_right(r) for r in records[v]] for v in variants} for name, records in models.items()}
    for variant in variants:
        cells = []
        for name, records in models.items():
            rows = records[variant]
            right = sum(verdicts[name][variant])
            length = sum(r["length"] for r in rows) / len(rows)
            cut = sum(r["length"] >= budget for r in rows) / len(rows)
            cells.append(f"{right / len(rows):.3f}, {length:.0f}, {cut:.0%}")
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    summary = {name: across_variants(v) for name, v in verdicts.items()}
    lines.append("| mean over variants | " + " | ".join(
        f"**{s['mean']:.3f}** [{s['mean_low']:.3f}, {s['mean_high']:.3f}]" for s in summary.values()) + " |")
    lines.append("| worst variant | " + " | ".join(
        f"{s['worst']:.3f} ({s['worst_variant']})" for s in summary.values()) + " |")
    lines.append("")
    lines.append("Why the wrong replies are wrong (all variants):")
    for name, records in models.items():
        counts = Counter(failure(r, budget) for v in variants for r, ok in zip(records[v], verdicts[name][v])
                         if not ok)
        total = sum(counts.values())
        lines.append(f"  {name}: {total} wrong: " + ", ".join(
            f"{kind} {counts[kind]} ({counts[kind] / max(total, 1):.0%})"
            for kind in ("setup", "arithmetic", "cut off", "no answer")))
    for i in range(samples):
        first = models[next(iter(models))][variants[0]][i]
        lines.append("")
        lines.append(f"problem {i + 1}: {first.get('question') or _question(first)}   (answer {first['answer']})")
        for variant in (v for v in sample_variants if v in variants):
            for name, records in models.items():
                record = records[variant][i]
                mark = "right" if is_right(record) else "wrong"
                reply = " ".join(record["completion"].split())
                lines.append(f"  [{variant}] {name} ({mark}): {reply[:400]}")
    return "\n".join(lines)


def draw(paths: list[Path], out: Path) -> None:
    """Grouped bars: each model's greedy accuracy under each variant, with the mean over variants."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = {path.stem: read(path) for path in paths}
    variants = list(next(iter(models.values())))
    width = 0.8 / len(models)
    fig, ax = plt.subplots(figsize=(9, 3.6))
    for k, (name, records) in enumerate(models.items()):
        accuracies = [sum(map(is_right, records[v])) / len(records[v]) for v in variants]
        positions = [i + (k - (len(models) - 1) / 2) * width for i in range(len(variants) + 1)]
        ax.bar(positions, [*accuracies, sum(accuracies) / len(accuracies)], width, label=name)
    ax.set_xticks(range(len(variants) + 1), [*variants, "mean"], rotation=20)
    ax.set_ylabel("greedy accuracy")
    ax.set_ylim(0, 1.2 * ax.get_ylim()[1])  # room for the legend above the bars
    ax.legend(frameon=False, ncol=len(models), loc="upper left")
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def _question(record: dict[str, Any]) -> str:
    prompt = record["prompt"]
    return prompt[-1]["content"] if isinstance(prompt, list) else str(prompt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("completions", nargs="+", type=Path, help="posttrain eval --completions files, one per model")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="the evaluations' token budget")
    parser.add_argument("--samples", type=int, default=0, help="problems whose replies to print")
    parser.add_argument("--sample-variants", default="bare,boxed,reason_first",
                        help="comma-separated variants to print replies under")
    parser.add_argument("--figure", type=Path, help="also draw each model's accuracy per variant into this PNG")
    args = parser.parse_args()
    print(report(args.completions, args.max_new_tokens, args.samples, args.sample_variants.split(",")))
    if args.figure:
        draw(args.completions, args.figure)


if __name__ == "__main__":
    main()
