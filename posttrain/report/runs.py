"""What ``posttrain report`` reads off run directories: the runs, their curves across seeds, the
figures, and the table's columns and cells. The page that shows them is :mod:`posttrain.report.html`
(its docstring says what the report holds and the decisions behind it)."""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from posttrain.algorithms.presets import ALGORITHMS
from posttrain.config import load_yaml
from posttrain.tracking.metrics import read_metrics
from posttrain.tracking.plots import _series, line_through

REPORT_FILE = "report.html"
SUMMARY_FILE = "summary.md"
TAIL_STEPS = 50  # "at the end of training" for the behaviour table: the last 50 logged steps
FIGURES_DIR = "figures"
RESOURCES_FILE = "resources.json"  # written by posttrain.report.compare
HEADLINE_KEYS = {"eval/accuracy": "held-out accuracy", "eval/pairwise_accuracy": "held-out pairwise accuracy",
                 "eval/reward": "held-out reward"}  # the first one logged is the headline (decision 3)


@dataclass(frozen=True)
class FigureSpec:
    name: str  # figures/<name>.png
    title: str
    panels: tuple[tuple[str, str], ...]  # (metric key, x axis: "step" or "time")
    caption: str  # what to look for


FIGURES: tuple[FigureSpec, ...] = (
    FigureSpec("heldout_accuracy", "Held-out accuracy (greedy)", (("eval/accuracy", "step"), ("eval/accuracy", "time")),
               "Held-out accuracy: higher and earlier is better; the right panel charges each preset for its "
               "time per step (DAPO's dynamic sampling generates extra groups, ReMax an extra greedy decode)."),
    FigureSpec("heldout_reward", "Held-out reward (greedy)", (("eval/reward", "step"), ("eval/reward", "time")),
               "Held-out reward of the task's reward functions: the same ranking as accuracy unless a preset "
               "games a partial-credit reward term."),
    FigureSpec("pairwise_accuracy", "Held-out pairwise accuracy",
               (("eval/pairwise_accuracy", "step"), ("eval/pairwise_accuracy", "time")),
               "Pairwise accuracy: how often the preset's implicit reward ranks the chosen completion above the "
               "rejected one; 0.5 is chance."),
    FigureSpec("train_reward", "Training reward (sampled completions)", (("reward/mean", "step"),),
               "Training reward: DAPO's +-1 reward and overlong penalty put it on its own scale, so compare "
               "shapes, not levels, across presets."),
    FigureSpec("entropy", "Policy entropy (nats per token)", (("entropy", "step"),),
               "Entropy: a fast fall means the policy stops exploring (GRPO's symmetric clip tends to collapse "
               "first); DAPO's clip-higher and CISPO's clipped IS weight should keep it up longer."),
    FigureSpec("clip_fraction", "Clip fraction (share of tokens clipped)", (("clip_fraction", "step"),),
               "Clip fraction: 0 while each rollout gets one update as soon as it is sampled (the ratio is "
               "exactly 1: GRPO, ReMax, RLOO); the presets whose papers take several mini-batches per rollout "
               "show how far updates push past the trust region (GSPO's clip range is 3e-4 to 4e-4 wide)."),
    FigureSpec("zero_gradient_fraction", "Tokens without a gradient (share of tokens)",
               (("zero_gradient_fraction", "step"),),
               "Tokens whose policy term sends no gradient although their advantage is not 0: PPO-style "
               "clipping drops a clipped token's gradient, CISPO's clipped IS weight keeps it (its share stays 0 "
               "while its clip fraction does not)."),
    FigureSpec("kl", "KL to the reference", (("kl", "step"),),
               "KL to the reference (k3), for the presets that keep one (KTO: its reference point z): a steep "
               "climb means the policy drifts faster than the KL penalty holds it."),
    FigureSpec("completion_length", "Completion length (tokens)",
               (("completion_length/correct", "step"), ("completion_length/incorrect", "step")),
               "Length of correct and incorrect completions, one panel each: GRPO's per-sequence mean lets wrong "
               "answers grow long (the bias Dr.GRPO removes); token-mean and constant normalisers should not."),
    FigureSpec("zero_variance_groups", "Zero-variance groups (share of prompts)", (("zero_variance_groups", "step"),),
               "Zero-variance groups: prompts whose samples all got the same reward have zero group advantage and "
               "teach nothing; the share rises as prompts become all-solved (DAPO logs it before its filter)."),
    FigureSpec("reward_margin", "Implicit reward margin (chosen - rejected)", (("rewards/margin", "step"),),
               "Reward margin on the training batch should grow; a margin that keeps growing while held-out "
               "pairwise accuracy stalls is overfitting."),
    FigureSpec("preference_logps", "Log-probs of the training pairs",
               (("logps/chosen", "step"), ("logps/rejected", "step")),
               "Chosen and rejected log-probs: DPO-style losses may push both down, as only the gap "
               "counts; a falling chosen log-prob is the failure that ORPO's NLL term counters."),
    FigureSpec("loss", "Training loss", (("loss", "step"),),
               "Loss: the presets' losses differ in form and normaliser, so read each curve's shape, not levels "
               "across presets."),
)


# ---------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------


@dataclass
class Run:
    run_dir: Path
    config: dict[str, Any]  # config.yaml, flat
    rows: list[dict[str, Any]]  # metrics.jsonl
    resources: dict[str, Any] | None  # resources.json, when posttrain compare trained it

    @property
    def algorithm(self) -> str:
        return str(self.config.get("algorithm", "?"))

    @property
    def seed(self) -> int:
        return int(self.config.get("seed", 0))

    def values(self, key: str) -> dict[int, float]:
        """step -> the finite value logged for ``key``."""
        return dict(zip(*_series(self.rows, key)))

    def elapsed(self) -> dict[int, float]:
        """step -> training seconds to reach it (decision 1); empty when ``time/step`` was never logged."""
        out, total = {0: 0.0}, 0.0
        for row in self.rows:
            if "time/step" in row:
                total += row["time/step"]
                out[row["step"]] = total
        return out if len(out) > 1 else {}


def load_run(run_dir: str | os.PathLike) -> Run:
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").exists():
        raise FileNotFoundError(f"{run_dir} is not a run directory: it has no config.yaml")
    path = run_dir / RESOURCES_FILE
    return Run(run_dir, load_yaml(run_dir / "config.yaml"), read_metrics(run_dir),
               json.loads(path.read_text()) if path.exists() else None)


def find_runs(paths: Sequence[str | os.PathLike]) -> list[Path]:
    """Each path that is a run directory (has config.yaml), else the run directories below it."""
    runs = []
    for path in map(Path, paths):
        found = [path] if (path / "config.yaml").exists() else sorted(p.parent for p in path.rglob("config.yaml"))
        if not found:
            raise FileNotFoundError(f"{path} holds no run directory (no config.yaml in or below it)")
        runs += found
    return runs


def group_runs(runs: Sequence[Run], order: Sequence[str] | None = None) -> dict[str, list[Run]]:
    """Algorithm -> its runs by seed; algorithms in ``order``, then in the preset registry's order."""
    rank = {name: i for i, name in enumerate([*(order or []), *ALGORITHMS])}
    names = sorted({run.algorithm for run in runs}, key=lambda n: (rank.get(n, len(rank)), n))
    return {name: sorted((r for r in runs if r.algorithm == name), key=lambda r: r.seed) for name in names}


# ---------------------------------------------------------------------------------------
# Curves across seeds
# ---------------------------------------------------------------------------------------


def across_runs(per_run: Sequence[Mapping[int, float]]) -> dict[int, tuple[float, float, float]]:
    """step -> (mean, min, max) over the runs that have that step, steps ascending (decision 2)."""
    out = {}
    for step in sorted(set().union(*per_run)):
        values = [run[step] for run in per_run if step in run]
        out[step] = (statistics.fmean(values), min(values), max(values))
    return out


def _smoothed(values: dict[int, float]) -> dict[int, float]:
    return dict(zip(values, line_through(list(values), list(values.values()))))


def curve(runs: Sequence[Run], key: str, x: str) -> tuple[list[float], list[float], list[float], list[float]]:
    """(x, mean, min, max) of ``key`` across ``runs``; x is the step or the mean training seconds."""
    per_run = [s for s in (_smoothed(run.values(key)) for run in runs) if s]
    stats = across_runs(per_run) if per_run else {}
    steps = list(stats)
    xs: list[float] = list(steps)
    if x == "time":
        times = across_runs([e for e in (run.elapsed() for run in runs) if e])
        steps = [s for s in steps if s in times]
        xs = [times[s][0] for s in steps]
    return xs, [stats[s][0] for s in steps], [stats[s][1] for s in steps], [stats[s][2] for s in steps]


def colours(names: Sequence[str]) -> dict[str, tuple[str, str]]:
    """One (colour, line style) per algorithm, the same in every figure: tab10, dashed after ten."""
    return {name: (f"C{i % 10}", "-" if i < 10 else "--") for i, name in enumerate(names)}


def _time_unit(groups: Mapping[str, Sequence[Run]]) -> tuple[str, float]:
    longest = max((max(e.values()) for runs in groups.values() for e in (r.elapsed() for r in runs) if e), default=0)
    if longest > 10 * 3600:
        return "h", 3600.0
    return ("min", 60.0) if longest > 600 else ("s", 1.0)


def draw_figure(spec: FigureSpec, groups: Mapping[str, Sequence[Run]]) -> Figure | None:
    """The figure of ``spec`` with the panels some run logged; None when there are none."""
    curves = {(key, x): {name: curve(runs, key, x) for name, runs in groups.items()} for key, x in spec.panels}
    panels = {panel: {n: c for n, c in per_alg.items() if c[0]} for panel, per_alg in curves.items()}
    panels = {panel: per_alg for panel, per_alg in panels.items() if per_alg}
    if not panels:
        return None
    style, (unit, scale) = colours(list(groups)), _time_unit(groups)
    figure = Figure(figsize=(5.2 * len(panels) + 1.4, 3.6), layout="constrained")
    FigureCanvasAgg(figure)
    handles = {}
    for ax, ((key, x), per_alg) in zip(figure.subplots(1, len(panels), squeeze=False)[0], panels.items()):
        for name, (xs, mean, low, high) in per_alg.items():
            xs = [v / scale for v in xs] if x == "time" else xs
            colour, line = style[name]
            handles[name], = ax.plot(xs, mean, line, color=colour, linewidth=1.6, label=name,
                                     marker="o" if len(xs) <= 30 else None, markersize=3)
            if len(groups[name]) > 1:
                ax.fill_between(xs, low, high, color=colour, alpha=0.15, linewidth=0)
        ax.set_title(key, fontsize=10)
        ax.set_xlabel("step" if x == "step" else f"training time ({unit})")
        ax.grid(alpha=0.3)
    names = [name for name in groups if name in handles]
    figure.legend([handles[name] for name in names], names, loc="outside right upper", fontsize=8)
    figure.suptitle(spec.title)
    return figure


# ---------------------------------------------------------------------------------------
# The summary table
# ---------------------------------------------------------------------------------------


def final_value(run: Run, key: str) -> float | None:
    values = run.values(key)
    return values[max(values)] if values else None


def first_step_reaching(run: Run, key: str, target: float) -> int | None:
    return next((step for step, value in sorted(run.values(key).items()) if value >= target), None)


def time_to_target(run: Run, key: str, target: float) -> float | None:
    step = first_step_reaching(run, key, target)
    return None if step is None else run.elapsed().get(step)


def training_seconds(run: Run) -> float | None:
    elapsed = run.elapsed()
    return elapsed[max(elapsed)] if elapsed else None


def gain(run: Run, key: str) -> float | None:
    """The last evaluation minus the first: what training added."""
    values = run.values(key)
    return values[max(values)] - values[min(values)] if len(values) > 1 else None


def run_mean(run: Run, key: str, last: int | None = None) -> float | None:
    """Mean of ``key`` over the run's logged steps (``last``: over its last ``last`` of them)."""
    values = list(run.values(key).values())[-last:] if last else list(run.values(key).values())
    return statistics.fmean(values) if values else None


# The behaviour table: what distinguishes the presets (the seed's claims), each over the steps named.
BEHAVIOUR: tuple[tuple[str, str, int | None, int], ...] = (
    # (column title, metric key, last N steps or None for the whole run, digits)
    ("clip fraction", "clip_fraction", None, 4),
    ("tokens without gradient", "zero_gradient_fraction", None, 4),
    (f"entropy (last {TAIL_STEPS} steps)", "entropy", TAIL_STEPS, 3),
    (f"incorrect length (last {TAIL_STEPS} steps)", "completion_length/incorrect", TAIL_STEPS, 1),
    (f"KL to reference (last {TAIL_STEPS} steps)", "kl", TAIL_STEPS, 3),
)


def behaviour_columns(runs: Sequence[Run]) -> list[Column]:
    """The ``BEHAVIOUR`` columns some run logged; no best is marked (higher is not better)."""
    return [Column(title, lambda r, k=key, n=last: run_mean(r, k, n), "none", digits, spread=True)
            for title, key, last, digits in BEHAVIOUR if any(run.values(key) for run in runs)]


def _resource(name: str) -> Callable[[Run], float | None]:
    return lambda run: None if run.resources is None else run.resources.get(name)


@dataclass(frozen=True)
class Column:
    title: str
    per_run: Callable[[Run], float | None]
    better: str  # "max", "min" or "none" (no best marked)
    digits: int
    spread: bool = False  # show ± the sample std over seeds
    reduce: str = "mean"  # or "max" (peak memory: the largest seed's)


@dataclass(frozen=True)
class Cell:
    value: float | None  # mean (or max) over the seeds with a value
    std: float | None
    seeds: int  # seeds with a value
    of: int  # seeds in the group

    def text(self, column: Column) -> str:
        if self.value is None:
            return "—"
        text = f"{self.value:.{column.digits}f}"
        if column.spread and self.std is not None:
            text += f" ± {self.std:.{column.digits}f}"
        return text if self.seeds == self.of else f"{text} ({self.seeds}/{self.of} seeds)"


def cell(column: Column, runs: Sequence[Run]) -> Cell:
    values = [v for v in map(column.per_run, runs) if v is not None and math.isfinite(v)]
    if not values:
        return Cell(None, None, 0, len(runs))
    value = max(values) if column.reduce == "max" else statistics.fmean(values)
    return Cell(value, statistics.stdev(values) if len(values) > 1 else None, len(values), len(runs))


def headline_key(runs: Sequence[Run]) -> str | None:
    return next((k for k in HEADLINE_KEYS if any(run.values(k) for run in runs)), None)


def default_target(groups: Mapping[str, Sequence[Run]], key: str) -> tuple[float, float, float, str]:
    """(target, start, best final, best algorithm): halfway between the mean first value and the best mean final."""
    starts = [v[min(v)] for v in (run.values(key) for runs in groups.values() for run in runs) if v]
    final = Column("", lambda r: final_value(r, key), "max", 3)
    finals = {name: cell(final, runs).value for name, runs in groups.items()}
    best_name = max((n for n in finals if finals[n] is not None), key=lambda n: finals[n])
    start, best = statistics.fmean(starts), finals[best_name]
    return start + (best - start) / 2, start, best, best_name


def summary_columns(runs: Sequence[Run], key: str | None, target: float | None) -> list[Column]:
    """The table's columns; those no run can fill (no headline, no resources.json) are left out."""
    logged = [k for k in HEADLINE_KEYS if any(run.values(k) for run in runs)]  # the headline first
    columns = [Column(f"final {HEADLINE_KEYS[k]}", lambda r, k=k: final_value(r, k), "max", 3, spread=True)
               for k in logged]
    if key is not None:
        columns.insert(1, Column("gain", lambda r: gain(r, key), "max", 3, spread=True))
    if key is not None and target is not None:
        columns += [Column("steps to target", lambda r: first_step_reaching(r, key, target), "min", 1),
                    Column("training time to target (s)", lambda r: time_to_target(r, key, target), "min", 1)]
    columns.append(Column("training time (s)", training_seconds, "min", 1))
    for name, title, reduce in (("wall_seconds", "wall time (s)", "mean"), ("peak_rss_mib", "peak RSS (MiB)", "max"),
                                ("peak_cuda_mib", "peak GPU memory (MiB)", "max")):
        if any(_resource(name)(run) is not None for run in runs):
            columns.append(Column(title, _resource(name), "min", 0 if "MiB" in title else 1, reduce=reduce))
    return columns


def best_rows(column: Column, cells: Mapping[str, Cell]) -> set[str]:
    """Algorithms holding the column's best value, among those with a value for every seed (decision 4)."""
    complete = {name: c.value for name, c in cells.items() if c.value is not None and c.seeds == c.of}
    if not complete or column.better == "none":
        return set()
    best = (max if column.better == "max" else min)(complete.values())
    return {name for name, value in complete.items() if value == best}


def summary_markdown(groups: Mapping[str, Sequence[Run]], columns: Sequence[Column]) -> str:
    """The summary table as GitHub Markdown, best values bold, as the page shows it."""
    cells = {c.title: {name: cell(c, runs) for name, runs in groups.items()} for c in columns}
    best = {c.title: best_rows(c, cells[c.title]) for c in columns}
    lines = ["| algorithm | seeds | " + " | ".join(c.title for c in columns) + " |",
             "|---|---|" + "---|" * len(columns)]
    for name, runs in groups.items():
        texts = [cells[c.title][name].text(c) for c in columns]
        texts = [f"**{t}**" if name in best[c.title] else t for c, t in zip(columns, texts)]
        lines.append(f"| {name} | {', '.join(str(r.seed) for r in runs)} | " + " | ".join(texts) + " |")
    return "\n".join(lines) + "\n"
