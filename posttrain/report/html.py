"""The comparison report: figures and one self-contained HTML page from run directories.

``build_report(run_dirs, output)`` groups the runs by their config's ``algorithm`` (seeds by its
``seed``) and writes ``output/figures/*.png`` and ``output/report.html``, which embeds the same
PNGs as base64 data URIs, with inline CSS and no script: it opens offline and travels as one file.

The page holds:

1. a summary table, one row per algorithm: final held-out accuracy and reward (mean ± sample std
   over seeds) and the headline's gain over its first evaluation, steps and training time to
   reach a target accuracy, total training time, process wall time and peak memory
   (``resources.json``, written by ``posttrain compare``); the best value of each column is bold.
   The target defaults to halfway between the start (the runs' mean first evaluation) and the
   best algorithm's mean final value, and the page says so. The same table is written as
   Markdown to ``output/summary.md``, for a README or an issue;
   a second table, what the presets do differently (``BEHAVIOUR``): clip fraction and the share
   of tokens left without a gradient over the whole run, entropy, the length of incorrect
   answers and the KL to the reference over the last ``TAIL_STEPS`` steps;
2. the figures of ``FIGURES``, each with a caption saying what to look for: every curve is the
   mean across seeds with a shaded min-max band, one colour per algorithm in every figure. A
   panel whose metric no run logged is left out; a figure left without panels is not drawn;
3. the settings the runs share, the preset fields that differ between the algorithms, the runs.

Decisions:

1. **Time is training time**: the cumulative sum of the logged ``time/step`` (sample, generate,
   score, update), without evaluations, checkpoints and model loading, which cost every preset
   the same. A resumed run re-logs the steps it redoes, so this clock stays exact where a process
   clock would not. On a time axis each step sits at the seeds' mean time to reach it.
2. **Seeds are aligned by step**: mean, min and max over the runs that logged that step (a run
   cut short counts until it stops). Each run's series is smoothed first exactly as in
   ``posttrain.tracking.plots`` (bias-corrected EMA of dense series only, so evaluations every
   ``eval_every`` steps stay raw); summary numbers use the raw values.
3. **The headline metric** is ``eval/accuracy`` when any run logged it, else
   ``eval/pairwise_accuracy`` (preference runs on a dataset), else ``eval/reward``.
4. A column's best is chosen among the algorithms with a value for every seed (for "to target":
   every seed reached it). Table cells carry the exact mean in ``data-value`` (the text is
   rounded), so scripts and tests can read the page back.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from posttrain.algorithms.presets import (
    ALGORITHMS,
    OnlineAlgorithm,
    PreferenceAlgorithm,
    SupervisedAlgorithm,
    algorithm,
)
from posttrain.report.runs import (
    FIGURES,
    FIGURES_DIR,
    HEADLINE_KEYS,
    REPORT_FILE,
    SUMMARY_FILE,
    TAIL_STEPS,
    Column,
    Run,
    behaviour_columns,
    best_rows,
    cell,
    colours,
    default_target,
    draw_figure,
    group_runs,
    headline_key,
    load_run,
    summary_columns,
    summary_markdown,
)

CSS = """
body { font: 15px/1.5 system-ui, -apple-system, Segoe UI, Helvetica, Arial, sans-serif; max-width: 1180px;
       margin: 2em auto; padding: 0 1em; color: #222; }
h1 { font-size: 1.6em; } h2 { margin-top: 2em; border-bottom: 1px solid #ddd; }
img.sample { width: 96px; image-rendering: pixelated; border: 1px solid #ccc; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.92em; }
th, td { border: 1px solid #ddd; padding: 0.3em 0.6em; text-align: right; }
th:first-child, td:first-child { text-align: left; } th { background: #f4f4f4; }
td.best { font-weight: bold; } .note { color: #555; font-size: 0.92em; }
figure { margin: 1.5em 0; } figure img { max-width: 100%; }
figcaption { color: #444; font-size: 0.95em; } .swatch { display: inline-block; width: 0.9em; height: 0.9em;
       margin-right: 0.4em; vertical-align: -0.1em; }
"""


def _e(value: Any) -> str:
    return html.escape(str(value))


def _format(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(map(_format, value)) or "—"
    return str(value)


def behaviour_html(groups: Mapping[str, Sequence[Run]], columns: Sequence[Column]) -> str:
    """The behaviour table (what the presets do differently), when any run logged its metrics."""
    if not columns:
        return ""
    return ("<h2>What the presets do differently</h2>\n" + table_html(groups, columns, table_id="behaviour")
            + "\n<p class=note>Mean over seeds (± sample std): clip fraction and tokens without gradient (a "
              "nonzero advantage, no gradient: PPO-style clipping) over every step; entropy, incorrect-answer "
              f"length and KL over the last {TAIL_STEPS} steps.</p>")


def table_html(groups: Mapping[str, Sequence[Run]], columns: Sequence[Column], table_id: str = "summary") -> str:
    cells = {c.title: {name: cell(c, runs) for name, runs in groups.items()} for c in columns}
    best = {c.title: best_rows(c, cells[c.title]) for c in columns}
    style = colours(list(groups))
    head = "".join(f"<th>{_e(c.title)}</th>" for c in columns)
    lines = [f'<table id="{table_id}"><tr><th>algorithm</th><th>seeds</th>{head}</tr>']
    for name, runs in groups.items():
        colour = style[name][0]
        swatch = f'<span class="swatch" style="background:{_swatch(colour)}"></span>'
        row = [f"<td>{swatch}{_e(name)}</td>", f"<td>{_e(', '.join(str(r.seed) for r in runs))}</td>"]
        for c in columns:
            value = cells[c.title][name]
            attrs = "" if value.value is None else f' data-value="{value.value!r}"'
            attrs += "" if value.std is None else f' data-std="{value.std!r}"'
            klass = ' class="best"' if name in best[c.title] else ""
            row.append(f"<td{klass}{attrs}>{_e(value.text(c))}</td>")
        lines.append(f'<tr data-algorithm="{_e(name)}">{"".join(row)}</tr>')
    return "\n".join(lines + ["</table>"])


def _swatch(colour: str) -> str:
    from matplotlib.colors import to_hex

    return to_hex(colour)


def target_html(groups: Mapping[str, Sequence[Run]], key: str | None, target: float | None) -> tuple[str, float | None]:
    """The sentence that states the target, and the target."""
    if key is None:
        return "<p class=note>No run logged a held-out metric: no target.</p>", None
    if target is not None:
        return f"<p>Target: <b>{HEADLINE_KEYS[key]} ≥ {target:.3f}</b> (given with <code>--target</code>).</p>", target
    target, start, best, name = default_target(groups, key)
    text = (f"<p>Target: <b>{HEADLINE_KEYS[key]} ≥ {target:.3f}</b> (<code>{key}</code>), halfway between the "
            f"start ({start:.3f}, the runs' mean first evaluation) and the best final value ({best:.3f}, {_e(name)}).")
    if best <= start:
        text += " No preset improved on the start, so every run reaches it at its first evaluation."
    return text + "</p>", target


def settings_html(runs: Sequence[Run]) -> str:
    """The fields every run shares (a chosen few) and every field that differs beyond algorithm and seed."""
    kinds = {type(ALGORITHMS.get(run.algorithm)) for run in runs}
    per_kind = {OnlineAlgorithm: ("prompts_per_step", "group_size", "max_new_tokens", "temperature"),
                PreferenceAlgorithm: ("pairs_per_step",), SupervisedAlgorithm: ("pairs_per_step",)}
    shown = ("model", "task", "dataset", "eval_dataset", "reward", "max_steps",
             *(name for kind, names in per_kind.items() if kind in kinds for name in names),
             "learning_rate", "eval_size", "eval_every", "device")
    skip = {"algorithm", "seed", "output", "resume", "progress"}
    keys = sorted({k for run in runs for k in run.config} - skip)
    differ = [k for k in keys if len({json.dumps(run.config.get(k), sort_keys=True) for run in runs}) > 1]
    shared = [k for k in shown if k in keys and k not in differ and runs[0].config.get(k) not in (None, [])]
    items = "".join(f"<tr><td>{_e(k)}</td><td>{_e(_format(runs[0].config.get(k)))}</td></tr>" for k in shared)
    text = f"<table>{items}</table>"
    if differ:
        text += f"<p class=note>Fields that differ between runs besides algorithm and seed: {_e(', '.join(differ))}</p>"
    return text


def presets_html(groups: Mapping[str, Sequence[Run]]) -> str:
    """The preset fields (overrides applied) whose values differ between the algorithms."""
    presets = {}
    for name, runs in groups.items():
        if name in ALGORITHMS:
            names = {f.name for f in dataclasses.fields(ALGORITHMS[name])}
            overrides = {k: v for k, v in runs[0].config.items() if k in names}
            presets[name] = dataclasses.asdict(algorithm(name, **overrides))
    if len(presets) < 2:
        return ""
    fields = list(dict.fromkeys(k for p in presets.values() for k in p if k not in ("name", "paper", "summary")))
    differ = [f for f in fields if len({json.dumps(p.get(f), default=str) for p in presets.values()}) > 1]
    head = "".join(f"<th>{_e(n)}</th>" for n in presets)
    rows = "".join(f"<tr><td>{_e(f)}</td>{''.join(f'<td>{_e(_format(p.get(f)))}</td>' for p in presets.values())}</tr>"
                   for f in differ)
    return f"<h2>How the presets differ</h2><table><tr><th>field</th>{head}</tr>{rows}</table>"


def runs_html(groups: Mapping[str, Sequence[Run]], output: Path) -> str:
    rows = []
    for name, runs in groups.items():
        for run in runs:
            last = run.rows[-1]["step"] if run.rows else 0
            total = run.config.get("max_steps", "?")
            status = "finished" if last == total else ("stopped early" if run.resources else "incomplete")
            where = os.path.relpath(run.run_dir, output)
            fired = sorted(run.values("eval/diverged"))  # the reward-hacking guard's firings
            warning = f"reward hacking suspected at step {', '.join(map(str, fired))}" if fired else ""
            rows.append(f"<tr><td>{_e(name)}</td><td>{run.seed}</td><td>{last} / {_e(total)}</td>"
                        f"<td>{status}</td><td>{_e(final_with_interval(run))}</td><td>{_e(warning)}</td>"
                        f"<td>{_e(where)}</td></tr>")
    return ("<table><tr><th>algorithm</th><th>seed</th><th>steps</th><th>status</th>"
            "<th>final held-out accuracy (95% CI)</th><th>warnings</th><th>run directory</th></tr>"
            + "".join(rows) + "</table>")


def final_with_interval(run: Run, key: str = "eval/accuracy") -> str:
    """The run's last evaluation of ``key`` with the Wilson interval logged next to it."""
    values = run.values(key)
    if not values:
        return "—"
    step = max(values)
    low, high = run.values(f"{key}_low").get(step), run.values(f"{key}_high").get(step)
    interval = "" if low is None or high is None else f" ({low:.3f}-{high:.3f})"
    return f"{values[step]:.3f}{interval}"


def samples_html(groups: Mapping[str, Sequence[Run]]) -> str:
    """For an image task: each algorithm's first run's held-out images with the answer and the model's greedy
    answers at the first and the last evaluation (``heldout_samples.jsonl``); '' when no run has them."""
    sections = []
    for name, runs in groups.items():
        run = next((r for r in runs if (r.run_dir / "heldout_samples.jsonl").is_file()), None)
        if run is None:
            continue
        records = [json.loads(line) for line in (run.run_dir / "heldout_samples.jsonl").read_text().splitlines()]
        first, last = min(r["step"] for r in records), max(r["step"] for r in records)
        by_row: dict[int, dict[int, dict[str, Any]]] = {}
        for record in records:
            by_row.setdefault(record["row"], {})[record["step"]] = record
        rows = []
        for row, steps in sorted(by_row.items()):
            any_record = next(iter(steps.values()))
            pictures = "".join(
                f'<img class=sample alt="held-out row {row + 1}" src="data:image/png;base64,'
                f'{base64.b64encode((run.run_dir / image).read_bytes()).decode("ascii")}">'
                for image in any_record["images"] if (run.run_dir / image).is_file())
            cells = [_answer_cell(steps.get(step)) for step in (first, last)]
            rows.append(f"<tr><td>{pictures}</td><td>{_e(any_record.get('answer'))}</td>{''.join(cells)}</tr>")
        sections.append(f"<h3>{_e(name)} (seed {run.seed})</h3><table><tr><th>image</th><th>answer</th>"
                        f"<th>step {first}</th><th>step {last}</th></tr>{''.join(rows)}</table>")
    if not sections:
        return ""
    return ("<h2>Held-out images, before and after</h2><p class=note>The first held-out rows of an image task with "
            "each algorithm's greedy answer at its first and last evaluation (✓ right, ✗ wrong).</p>"
            + "".join(sections))


def _answer_cell(record: dict[str, Any] | None) -> str:
    if record is None:
        return "<td></td>"
    mark = {True: " ✓", False: " ✗"}.get(record.get("correct"), "")
    return f"<td><code>{_e(record['completion'])}</code>{mark}</td>"


def build_report(run_dirs: Sequence[str | os.PathLike], output: str | os.PathLike, *, target: float | None = None,
                 order: Sequence[str] | None = None) -> Path:
    """Write ``output/figures/*.png``, ``output/report.html`` and ``output/summary.md`` for ``run_dirs``;
    return the page's path."""
    runs = [load_run(d) for d in run_dirs]
    if not runs:
        raise FileNotFoundError("report: no run directories given")
    output = Path(output)
    (output / FIGURES_DIR).mkdir(parents=True, exist_ok=True)
    groups = group_runs(runs, order)
    key = headline_key(runs)
    target_text, target = target_html(groups, key, target)
    figures = []
    for spec in FIGURES:
        figure = draw_figure(spec, groups)
        if figure is not None:
            path = output / FIGURES_DIR / f"{spec.name}.png"
            figure.savefig(path, dpi=100)
            data = base64.b64encode(path.read_bytes()).decode("ascii")
            figures.append(f'<figure id="fig-{spec.name}"><img alt="{_e(spec.title)}" src="data:image/png;base64,'
                           f'{data}"><figcaption>{_e(spec.caption)}</figcaption></figure>')
    names = ", ".join(groups)
    seeds = sorted({len(g) for g in groups.values()})
    summary, behaviour = summary_columns(runs, key, target), behaviour_columns(runs)
    markdown = summary_markdown(groups, summary)
    if behaviour:
        markdown += "\n" + summary_markdown(groups, behaviour)
    (output / SUMMARY_FILE).write_text(markdown, encoding="utf-8")
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>posttrain comparison: {_e(names)}</title>
<style>{CSS}</style></head><body>
<h1>Comparison: {_e(names)}</h1>
<p class=note>{len(runs)} runs, {_e('/'.join(map(str, seeds)))} seed(s) per algorithm; written
{_e(time.strftime('%Y-%m-%d %H:%M'))} by <code>posttrain report</code>.</p>
<h2>Summary</h2>
{target_text}
{table_html(groups, summary)}
<p class=note>Mean over seeds (± sample std for the final values; "k/n seeds" when only k seeds have a value, e.g.
reached the target). Training time sums the logged <code>time/step</code>: sampling, generation, scoring and updates,
without evaluations and checkpoints. Wall time is the training process's whole <code>train()</code> call; peak
RSS is the largest seed's peak resident memory. Bold: the best value among algorithms with a value for every seed.</p>
{behaviour_html(groups, behaviour)}
<h2>Settings shared by every run</h2>
{settings_html(runs)}
<h2>Curves</h2>
<p class=note>Mean across seeds, shaded from the seeds' minimum to their maximum; training metrics smoothed
(bias-corrected EMA), held-out evaluations raw.</p>
{''.join(figures) or '<p>No run logged any of the plotted metrics.</p>'}
{samples_html(groups)}
{presets_html(groups)}
<h2>Runs</h2>
{runs_html(groups, output)}
</body></html>
"""
    path = output / REPORT_FILE
    path.write_text(page, encoding="utf-8")
    return path
