"""Plot a run's main training curves from its ``metrics.jsonl``.

One panel per curve that the run logged (``PANELS``, with the accuracy on each ``eval_tasks`` entry
beside the held-out accuracy, and the held-out reward of a run that logs no accuracy; missing keys
are skipped), step on the x axis, each logged value as a faint point under a smoothed line. The smoothing is TensorBoard's:
a bias-corrected exponential moving average (weight ``SMOOTHING``), so the first points are not
pulled towards zero. Only a dense series is smoothed: one logged at every step or at least every
other, with ``MIN_POINTS_TO_SMOOTH`` points or more. Any other (held-out evaluations every
``eval_every`` steps, a short run) is joined point to point: each evaluation is already an average
over the held-out prompts, and averaging them again would only make the line lag behind them (at 11
evaluations of the default run, it ended 5 points under the last one). NaN and infinite values are
left out of the curves (they are in ``metrics.jsonl``). A red dashed line on the held-out panels marks
where the reward-hacking guard fired (``eval/diverged``). The figure is drawn with matplotlib's Agg
canvas directly, without ``pyplot``: no display, no global figure state.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from posttrain.tracking.metrics import VARIANT_SEPARATOR, read_metrics

# (panel title, metric keys drawn in it)
PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Reward: mean over sampled completions", ("reward/mean",)),
    ("Eval accuracy on held-out prompts", ("eval/accuracy",)),
    ("Eval reward on held-out prompts", ("eval/reward",)),
    ("Policy entropy: mean token entropy (nats)", ("entropy",)),
    ("KL to the reference policy (k3, mean)", ("kl",)),
    ("Clip fraction: share of tokens clipped", ("clip_fraction",)),
    (
        "Completion length (tokens): mean, correct, incorrect",
        ("completion_length/mean", "completion_length/correct", "completion_length/incorrect"),
    ),
    ("Training loss", ("loss",)),
)
SMOOTHING = 0.8
MIN_POINTS_TO_SMOOTH = 10
CURVES_FILE = "curves.png"


def with_eval_tasks(panels: tuple[tuple[str, tuple[str, ...]], ...],
                    rows: Sequence[dict]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``panels`` with each ``eval_tasks`` accuracy the run logged (``eval/LABEL/accuracy``) drawn next to
    ``eval/accuracy``: transfer to other tasks reads against the run's own held-out curve. A task asked
    under prompt variants is drawn as its mean and worst over them (``eval/LABEL/variants_mean``,
    ``variants_worst``), not one line per variant."""
    extra = sorted({key for row in rows for key in row
                    if key.startswith("eval/") and key.count("/") == 2 and VARIANT_SEPARATOR not in key
                    and key.endswith(("/accuracy", "/variants_mean", "/variants_worst"))})
    return tuple((title, keys + tuple(extra) if "eval/accuracy" in keys else keys) for title, keys in panels)


def without_repeated_held_out_reward(panels: tuple[tuple[str, tuple[str, ...]], ...],
                                     rows: Sequence[dict]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``panels`` without the held-out reward panel when it repeats the held-out accuracy: a built-in task's
    reward is its accuracy. A ``--dataset`` run (no answer check) has only the reward to show, and a run
    against a proxy (a reward model) shows both: reward hacking is the one rising as the other falls."""
    both = [row for row in rows if "eval/accuracy" in row and "eval/reward" in row]
    if both and all(row["eval/accuracy"] == row["eval/reward"] for row in both):
        return tuple(panel for panel in panels if panel[1] != ("eval/reward",))
    return panels


def plot_run(
    run_dir: str | os.PathLike, out_path: str | os.PathLike | None = None, keys: Sequence[str] | None = None
) -> Path:
    """Draw the run's curves (``PANELS``, or one panel per key of ``keys``) into ``out_path``
    (default ``run_dir/curves.png``) and return its path. Raises ValueError when the run has
    logged none of the keys."""
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    panels = without_repeated_held_out_reward(with_eval_tasks(PANELS, rows), rows) if keys is None else tuple((key, (key,)) for key in keys)
    drawn = [(title, {key: _series(rows, key) for key in panel_keys}) for title, panel_keys in panels]
    drawn = [(title, {k: s for k, s in series.items() if s[0]}) for title, series in drawn]
    drawn = [(title, series) for title, series in drawn if series]
    if not drawn:
        wanted = sorted({key for _, panel_keys in panels for key in panel_keys})
        raise ValueError(f"{run_dir} has logged none of {wanted}: nothing to plot")

    diverged = [row["step"] for row in rows if row.get("eval/diverged")]  # the reward-hacking guard fired
    ncols = min(3, len(drawn))
    nrows = math.ceil(len(drawn) / ncols)
    figure = Figure(figsize=(5 * ncols, 3.4 * nrows), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, (title, series) in zip(axes, drawn):
        for color, (key, (steps, values)) in enumerate(series.items()):
            ax.plot(steps, values, "o", color=f"C{color}", alpha=0.25, markersize=3)
            ax.plot(steps, line_through(steps, values), "-", color=f"C{color}", linewidth=1.5, label=key)
        if any(key.startswith("eval/") for key in series):
            for step in diverged:
                ax.axvline(step, color="red", linestyle="--", linewidth=1)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend(fontsize=8)
    for ax in axes[len(drawn):]:
        ax.set_visible(False)
    figure.suptitle(f"{run_dir.name}: training curves")
    out = Path(out_path) if out_path is not None else run_dir / CURVES_FILE
    figure.savefig(out, dpi=100)
    return out


def line_through(steps: Sequence[int], values: Sequence[float]) -> list[float]:
    """The line drawn through a series: smoothed where it is dense, its own values elsewhere."""
    dense = len(values) >= MIN_POINTS_TO_SMOOTH and 2 * len(steps) >= steps[-1] - steps[0] + 1
    return smooth(values) if dense else list(values)


def smooth(values: Sequence[float], weight: float = SMOOTHING) -> list[float]:
    """Bias-corrected EMA: ``m_t = w m_{t-1} + (1 - w) x_t``, ``out_t = m_t / (1 - w^t)`` (m_0 = 0)."""
    out, average = [], 0.0
    for t, value in enumerate(values, start=1):
        average = weight * average + (1 - weight) * value
        out.append(average / (1 - weight**t))
    return out


def _series(rows: Sequence[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows that logged a finite value for ``key``."""
    pairs = [(row["step"], float(row[key])) for row in rows if key in row]
    pairs = [(step, value) for step, value in pairs if math.isfinite(value)]
    return [step for step, _ in pairs], [value for _, value in pairs]
