"""The HTML pieces of ``posttrain report`` (see posttrain/report.py): the summary table with the
best value per column marked, the target sentence, the shared settings, how the presets differ,
and the list of runs. Plain strings, every value escaped."""

from __future__ import annotations

import dataclasses
import html
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from posttrain.report import TAIL_STEPS, HEADLINE_KEYS, Column, Run, best_rows, cell, colours, default_target


CSS = """
body { font: 15px/1.5 system-ui, -apple-system, Segoe UI, Helvetica, Arial, sans-serif; max-width: 1180px;
       margin: 2em auto; padding: 0 1em; color: #222; }
h1 { font-size: 1.6em; } h2 { margin-top: 2em; border-bottom: 1px solid #ddd; }
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
    from posttrain.algorithms import ALGORITHMS, OnlineAlgorithm, PreferenceAlgorithm

    kinds = {type(ALGORITHMS.get(run.algorithm)) for run in runs}
    per_kind = {OnlineAlgorithm: ("prompts_per_step", "group_size", "max_new_tokens", "temperature"),
                PreferenceAlgorithm: ("pairs_per_step",)}
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
    from posttrain.algorithms import ALGORITHMS, algorithm

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
            rows.append(f"<tr><td>{_e(name)}</td><td>{run.seed}</td><td>{last} / {_e(total)}</td>"
                        f"<td>{status}</td><td>{_e(final_with_interval(run))}</td><td>{_e(where)}</td></tr>")
    return ("<table><tr><th>algorithm</th><th>seed</th><th>steps</th><th>status</th>"
            "<th>final held-out accuracy (95% CI)</th><th>run directory</th></tr>" + "".join(rows) + "</table>")


def final_with_interval(run: Run, key: str = "eval/accuracy") -> str:
    """The run's last evaluation of ``key`` with the Wilson interval logged next to it."""
    values = run.values(key)
    if not values:
        return "—"
    step = max(values)
    low, high = run.values(f"{key}_low").get(step), run.values(f"{key}_high").get(step)
    interval = "" if low is None or high is None else f" ({low:.3f}-{high:.3f})"
    return f"{values[step]:.3f}{interval}"
