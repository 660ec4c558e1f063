"""The comparison report from hand-made run directories: seeds grouped by the config's algorithm
and seed, the table's numbers worked out by hand, curves aligned by step and by training time,
missing metrics and empty runs drawn around, and a page that needs nothing but itself."""

from __future__ import annotations

import base64
import json
import math
import re
from html.parser import HTMLParser

import pytest

from posttrain.cli import main
from posttrain.config import Config, save_yaml
from posttrain.tracking.metrics import MetricsLogger
from posttrain.report.html import build_report
from posttrain.report.runs import across_runs, curve, group_runs, load_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class _SummaryTable(HTMLParser):
    """The rows of ``<table id="summary">``: {column title: {"text", "value", "std", "best"}}."""

    def __init__(self, table_id: str) -> None:
        super().__init__()
        self.table_id, self.inside, self.header, self.rows, self.cell = table_id, False, [], [], None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "table" and attrs.get("id") == self.table_id:
            self.inside = True
        elif self.inside and tag == "tr":
            self.rows.append([])
        elif self.inside and tag in ("td", "th"):
            self.cell = {"text": "", "value": attrs.get("data-value"), "std": attrs.get("data-std"),
                         "best": attrs.get("class") == "best", "th": tag == "th"}

    def handle_data(self, data):
        if self.cell is not None:
            self.cell["text"] += data

    def handle_endtag(self, tag):
        if tag == "table":
            self.inside = False
        elif self.inside and tag in ("td", "th"):
            self.rows[-1].append(self.cell)
            self.cell = None


def summary_table(page: str, table_id: str = "summary") -> dict[str, dict[str, dict]]:
    """algorithm -> column title -> cell, parsed from the report's HTML."""
    parser = _SummaryTable(table_id)
    parser.feed(page)
    titles = [c["text"] for c in parser.rows[0]]
    return {row[0]["text"]: dict(zip(titles, row)) for row in parser.rows[1:]}


def embedded_pngs(page: str) -> list[bytes]:
    return [base64.b64decode(data) for data in re.findall(r'src="data:image/png;base64,([^"]+)"', page)]


def make_run(root, algorithm, seed, evals, *, steps=4, step_time=1.0, metrics=None, resources=None):
    """A run directory: eval/accuracy at the steps of ``evals``, ``time/step`` and ``metrics(step)`` each step."""
    run_dir = root / algorithm / f"seed{seed}"
    run_dir.mkdir(parents=True)
    save_yaml(Config.from_flat({"algorithm": algorithm, "seed": seed, "max_steps": steps}), run_dir / "config.yaml")
    with MetricsLogger.open(run_dir, report_to="none") as logger:
        logger.log(0, {"eval/accuracy": evals[0]})
        for step in range(1, steps + 1):
            row = {"time/step": step_time, **(metrics(step) if metrics else {})}
            if step in evals:
                row["eval/accuracy"] = evals[step]
            logger.log(step, row)
    if resources is not None:
        (run_dir / "resources.json").write_text(json.dumps(resources))
    return run_dir


@pytest.fixture
def four_runs(tmp_path):
    """grpo and dapo, two seeds each, evaluated at steps 0, 2 and 4."""
    def entropy(step):
        return {"entropy": 2.0 - 0.1 * step, "clip_fraction": 0.0}

    return [
        make_run(tmp_path, "grpo", 0, {0: 0.2, 2: 0.4, 4: 0.6}, step_time=1.0, metrics=entropy,
                 resources={"wall_seconds": 10.0, "peak_rss_mib": 500.0}),
        make_run(tmp_path, "grpo", 1, {0: 0.2, 2: 0.6, 4: 0.8}, step_time=2.0, metrics=entropy,
                 resources={"wall_seconds": 14.0, "peak_rss_mib": 700.0}),
        make_run(tmp_path, "dapo", 0, {0: 0.2, 2: 0.3, 4: 0.4}, step_time=3.0,
                 resources={"wall_seconds": 20.0, "peak_rss_mib": 300.0}),
        make_run(tmp_path, "dapo", 1, {0: 0.2, 2: 0.3, 4: 0.5}, step_time=3.0,
                 resources={"wall_seconds": 22.0, "peak_rss_mib": 400.0}),
    ]


def test_summary_table_holds_the_hand_computed_numbers(four_runs, tmp_path):
    page = build_report(four_runs, tmp_path / "report").read_text()
    # start 0.2; best final: grpo's mean (0.6 + 0.8) / 2 = 0.7; target halfway: 0.2 + (0.7 - 0.2) / 2 = 0.45
    assert "held-out accuracy ≥ 0.450" in page and "halfway between the start (0.200" in page
    table = summary_table(page)
    assert list(table) == ["grpo", "dapo"]  # grouped by algorithm, in the registry's order
    grpo, dapo = table["grpo"], table["dapo"]
    assert grpo["seeds"]["text"] == "0, 1"
    final = "final held-out accuracy"
    assert float(grpo[final]["value"]) == pytest.approx(0.7)
    assert float(grpo[final]["std"]) == pytest.approx(math.sqrt(2 * 0.1**2))  # sample std of 0.6, 0.8
    assert float(dapo[final]["value"]) == pytest.approx(0.45) and grpo[final]["best"] and not dapo[final]["best"]
    # grpo reaches 0.45 at step 4 (seed 0, 4 x 1 s) and step 2 (seed 1, 2 x 2 s): 3 steps, 4 s on average
    assert float(grpo["steps to target"]["value"]) == 3.0
    assert float(grpo["training time to target (s)"]["value"]) == 4.0
    # dapo: seed 0 never gets there (0.4), seed 1 at step 4 (4 x 3 s); an incomplete cell is never the best
    assert dapo["steps to target"]["text"] == "4.0 (1/2 seeds)"
    assert float(dapo["training time to target (s)"]["value"]) == 12.0
    assert grpo["steps to target"]["best"] and not dapo["steps to target"]["best"]
    # training time: grpo (4 + 8) / 2 = 6 s, dapo 12 s; peak RSS is the largest seed's, lower is better
    assert float(grpo["training time (s)"]["value"]) == 6.0 and grpo["training time (s)"]["best"]
    assert float(grpo["wall time (s)"]["value"]) == 12.0
    assert float(grpo["peak RSS (MiB)"]["value"]) == 700.0 and float(dapo["peak RSS (MiB)"]["value"]) == 400.0
    assert dapo["peak RSS (MiB)"]["best"] and not grpo["peak RSS (MiB)"]["best"]


def test_gain_and_what_the_presets_do_differently_with_a_markdown_copy(four_runs, tmp_path):
    page = build_report(four_runs, tmp_path / "report").read_text()
    table = summary_table(page)
    # gain = last evaluation - first: grpo 0.4 and 0.6, dapo 0.2 and 0.3
    assert float(table["grpo"]["gain"]["value"]) == pytest.approx(0.5) and table["grpo"]["gain"]["best"]
    assert float(table["dapo"]["gain"]["value"]) == pytest.approx(0.25)
    behaviour = summary_table(page, "behaviour")
    # grpo logs entropy 2.0 - 0.1 * step at steps 1-4: mean 1.75 (fewer than 50 steps: all of them); no best
    entropy = behaviour["grpo"]["entropy (last 50 steps)"]
    assert float(entropy["value"]) == pytest.approx(1.75) and not entropy["best"]
    assert behaviour["dapo"]["entropy (last 50 steps)"]["text"] == "—"  # dapo logged none
    assert "KL to reference (last 50 steps)" not in behaviour["grpo"]  # no run logged kl: no column
    markdown = (tmp_path / "report" / "summary.md").read_text()
    assert "| algorithm | seeds | final held-out accuracy | gain |" in markdown
    assert "| grpo | 0, 1 | **0.700 ± 0.141** | **0.500 ± 0.141** |" in markdown
    assert "| grpo | 0, 1 | 0.0000 ± 0.0000 | 1.750 ± 0.000 |" in markdown  # clip fraction, entropy


def test_given_target_replaces_the_default(four_runs, tmp_path):
    page = build_report(four_runs, tmp_path / "report", target=0.35).read_text()
    assert "held-out accuracy ≥ 0.350</b> (given with" in page
    # dapo now: seed 0 at step 4 (0.4), seed 1 at step 4 (0.5); grpo: step 2 for both seeds
    table = summary_table(page)
    assert float(table["dapo"]["steps to target"]["value"]) == 4.0
    assert float(table["grpo"]["steps to target"]["value"]) == 2.0


def test_seeds_are_aligned_by_step_and_by_training_time(four_runs):
    groups = group_runs([load_run(d) for d in four_runs])
    xs, mean, low, high = curve(groups["grpo"], "eval/accuracy", "step")
    assert xs == [0, 2, 4] and mean == pytest.approx([0.2, 0.5, 0.7])
    assert low == pytest.approx([0.2, 0.4, 0.6]) and high == pytest.approx([0.2, 0.6, 0.8])
    # on the time axis step 2 sits at the seeds' mean time to reach it: (2 x 1 s + 2 x 2 s) / 2 = 3 s
    xs, mean, _, _ = curve(groups["grpo"], "eval/accuracy", "time")
    assert xs == pytest.approx([0.0, 3.0, 6.0]) and mean == pytest.approx([0.2, 0.5, 0.7])


def test_across_runs_averages_the_runs_that_logged_each_step():
    assert across_runs([{0: 1.0, 1: 2.0}, {0: 3.0, 2: 5.0}]) == {0: (2.0, 1.0, 3.0), 1: (2.0, 2.0, 2.0),
                                                                2: (5.0, 5.0, 5.0)}


def test_page_is_self_contained_and_embeds_every_figure(four_runs, tmp_path):
    path = build_report(four_runs, tmp_path / "report")
    page = path.read_text()
    files = sorted(p.name for p in (path.parent / "figures").iterdir())
    assert "entropy.png" in files and "heldout_accuracy.png" in files
    assert "kl.png" not in files and "pairwise_accuracy.png" not in files  # nobody logged them
    pngs = embedded_pngs(page)
    assert len(pngs) == len(files) and all(png.startswith(PNG_SIGNATURE) for png in pngs)
    assert sorted(pngs) == sorted((path.parent / "figures" / name).read_bytes() for name in files)
    assert not re.search(r'(src|href)="(?!data:)', page) and "<script" not in page and "<link" not in page
    assert page.count("<figcaption>") == len(files)


def test_missing_metrics_and_empty_runs_do_not_break_the_report(tmp_path):
    online = make_run(tmp_path, "cispo", 0, {0: 0.1, 2: 0.3}, steps=2)  # no entropy, KL, lengths, resources
    preference = tmp_path / "dpo" / "seed0"
    preference.mkdir(parents=True)
    save_yaml(Config.from_flat({"algorithm": "dpo", "max_steps": 3}), preference / "config.yaml")
    with MetricsLogger.open(preference, report_to="none") as logger:
        logger.log(0, {"eval/pairwise_accuracy": 0.5})
        logger.log(1, {"loss": 0.69, "rewards/margin": 0.01, "logps/chosen": -9.0, "time/step": 0.5})
    killed = tmp_path / "gspo" / "seed0"  # killed before its first log line
    killed.mkdir(parents=True)
    save_yaml(Config.from_flat({"algorithm": "gspo", "max_steps": 3}), killed / "config.yaml")

    path = build_report([online, preference, killed], tmp_path / "report")
    page = path.read_text()
    table = summary_table(page)
    assert float(table["cispo"]["final held-out accuracy"]["value"]) == pytest.approx(0.3)
    assert table["dpo"]["final held-out accuracy"]["text"] == "—"
    assert table["gspo"]["final held-out accuracy"]["text"] == table["gspo"]["training time (s)"]["text"] == "—"
    assert "peak RSS (MiB)" not in table["cispo"]  # no run has resources.json: no column
    figures = {p.stem for p in (path.parent / "figures").iterdir()}
    assert {"heldout_accuracy", "pairwise_accuracy", "reward_margin", "preference_logps", "loss"} <= figures
    assert not figures & {"entropy", "kl", "completion_length", "clip_fraction"}
    assert "0 / 3</td><td>incomplete" in page


def test_report_command_finds_the_runs_below_a_directory(four_runs, tmp_path):
    assert main(["report", str(tmp_path / "grpo"), str(tmp_path / "dapo")]) == 0
    page = (tmp_path / "report.html").read_text()  # default output: the runs' common parent
    table = summary_table(page)
    assert table["grpo"]["seeds"]["text"] == "0, 1" and table["dapo"]["seeds"]["text"] == "0, 1"
    assert main(["report", str(four_runs[0]), "--output", str(tmp_path / "one")]) == 0  # a single run
    assert summary_table((tmp_path / "one" / "report.html").read_text())["grpo"]["seeds"]["text"] == "0"
    assert main(["report", str(tmp_path / "nothing-here")]) == 2  # a user error, said in one line
