"""Views of the presets for ``posttrain algorithms``: every preset in one table, or a few side by side."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from posttrain.algorithms.presets import (
    AFTER_THE_SEED,
    ALGORITHMS,
    DESCRIPTIVE_FIELDS,
    POLICY_PAIRS_RPO_ALPHA,
    OnlineAlgorithm,
    PreferenceAlgorithm,
    SupervisedAlgorithm,
    algorithm,
)
from posttrain.algorithms.registry import PREFERENCE_LOSSES


def _fmt(value: Any) -> str:
    if isinstance(value, float) and len(str(value)) > 8:  # GMPO's 1 - e^-0.4: 0.3297, not 17 digits
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def _text_table(rows: list[list[str]]) -> str:
    """Left-aligned columns; the first row is the header, underlined."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _url(paper: str) -> str:
    match = re.search(r"https://\S+", paper)
    return match.group(0).rstrip(";,") if match else paper


_TABLE_COLUMNS = ("name", "paper", "summary", "update_structure", "advantage", "ratio", "clip", "eps_low",
                  "eps_high", "aggregation", "loss", "kl_placement", "kl_estimator", "beta", "mini_batches",
                  "num_epochs")


def _online_extras(a: OnlineAlgorithm) -> str:
    """The fields outside the table's columns that differ from the defaults, as `field=value`."""
    return ", ".join(f"{f.name}={_fmt(getattr(a, f.name))}" for f in dataclasses.fields(a)
                     if f.name not in _TABLE_COLUMNS and getattr(a, f.name) != f.default)


def _updates(a: OnlineAlgorithm) -> str:
    """Optimizer steps per rollout, as mini-batches x epochs."""
    return f"{a.mini_batches} x {a.num_epochs}"


def format_presets_table() -> str:
    """Every preset, one row each with its key settings and paper: online, preference, then supervised."""
    header = ["preset", "advantage", "ratio/clip", "eps_low, eps_high", "aggregation", "KL", "updates", "extras",
              "paper"]
    online, after_the_seed = [header], [header]
    for a in (p for p in ALGORITHMS.values() if isinstance(p, OnlineAlgorithm)):
        kl = "none" if a.kl_placement == "none" else f"{a.kl_estimator} in {a.kl_placement}, beta {_fmt(a.beta)}"
        (after_the_seed if a.name in AFTER_THE_SEED else online).append([
            a.name, a.advantage, f"{a.ratio}/{a.clip}", f"{_fmt(a.eps_low)}, {_fmt(a.eps_high)}",
            a.aggregation + (" NLL" if a.loss == "nll" else ""), kl, _updates(a), _online_extras(a), _url(a.paper)])
    preference = [["preset", "loss", "coefficients", "reference", "paper"]]
    for p in (p for p in ALGORITHMS.values() if isinstance(p, PreferenceAlgorithm)):
        coefficients = ", ".join(f"{name} {_fmt(getattr(p, name))}" for name in PREFERENCE_LOSSES[p.loss].coefficients)
        preference.append([p.name, p.loss, coefficients, "yes" if p.needs_reference else "no", _url(p.paper)])
    supervised = [["preset", "objective", "settings", "paper"]]
    for p in (p for p in ALGORITHMS.values() if isinstance(p, SupervisedAlgorithm)):
        settings = ", ".join(f"{f.name} {_fmt(getattr(p, f.name))}" for f in dataclasses.fields(p)
                             if f.name not in (*DESCRIPTIVE_FIELDS, "objective") and getattr(p, f.name) is not None)
        supervised.append([p.name, p.objective, settings or "-", _url(p.paper)])
    return (f"Online (RL) presets\n\n{_text_table(online)}\n\nOnline presets after the seed's lineage (trust regions "
            f"after the clip, advantages, entropy control, distillation)\n\n{_text_table(after_the_seed)}"
            f"\n\nPreference presets\n\n{_text_table(preference)}"
            f"\n\nSupervised presets (the RLHF pipeline's first stages)\n\n{_text_table(supervised)}")


def _update_line(preset: OnlineAlgorithm | PreferenceAlgorithm) -> str:
    if isinstance(preset, PreferenceAlgorithm):
        return _default_data_line(preset)
    if not isinstance(preset, OnlineAlgorithm):
        return ""
    return f"\n    updates per rollout: {_updates(preset)} (mini-batches x epochs), {preset.update_structure}"


def _default_data_line(preset: PreferenceAlgorithm) -> str:
    """What a run on a built-in task trains on by default, and the term it adds to the paper's loss."""
    line = ("\n    default data on a built-in task (no --dataset): pairs sampled from the policy as it trains, a correct "
            "completion chosen over an incorrect one (pairs_from auto)")
    if PREFERENCE_LOSSES[preset.loss].takes_rpo_alpha and preset.rpo_alpha is None:
        line += (f"; adds {_fmt(POLICY_PAIRS_RPO_ALPHA)} x the chosen completions' per-token NLL (RPO) to the paper's "
                 "loss there: --rpo-alpha 0 for the loss alone")
    return line


def format_side_by_side(names: Sequence[str]) -> str:
    """The named presets as columns, fields as rows; `*` marks the rows whose values differ."""
    if not names:
        raise ValueError(f"name at least one preset; valid names: {', '.join(ALGORITHMS)}")
    presets = [algorithm(name) for name in names]
    kinds = {type(p) for p in presets}
    if len(kinds) > 1:
        by_kind: dict[type, list[str]] = {}  # in the order the names were given
        for p in presets:
            by_kind.setdefault(type(p), []).append(p.name)
        listed = "; ".join(f"{kind.__name__}: {', '.join(names)}" for kind, names in by_kind.items())
        raise ValueError(f"cannot compare presets of different kinds ({listed}): their fields differ; compare "
                         "each kind on its own")
    kind = kinds.pop()
    rows = [["", "field", *(p.name for p in presets)]]
    shown = [f.name for f in dataclasses.fields(kind) if f.name not in DESCRIPTIVE_FIELDS]
    derived = [name for name, value in vars(kind).items() if isinstance(value, property)]
    for name in [*shown, *derived]:
        values = [_fmt(getattr(p, name)) for p in presets]
        rows.append(["*" if len(set(values)) > 1 else "", name, *values])
    header = "\n".join(f"{p.name}: {p.summary}\n    {p.paper}" + _update_line(p) for p in presets)
    return f"{header}\n\n{_text_table(rows)}"
