"""The documentation site stays true to the code.

- Every metric a short real run of each trainer kind logs has an entry in the metrics glossary
  (``posttrain.tracking.glossary``), and every entry that claims to be logged every step or at every
  evaluation is logged by the runs of the kinds it names.
- The committed ``docs/reference/*.md`` are what ``scripts/gen_reference.py`` produces from the code now.
- ``mkdocs build --strict`` passes: no broken link, no page left out of the navigation.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import posttrain
from posttrain.tracking.glossary import EVALUATIONS, EVERY_STEP, GLOSSARY, TRAINERS, MetricEntry, describe
from posttrain.tracking.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]

QUICK = dict(max_steps=2, eval_size=4, eval_every=1, save_every=0, report_to="none", progress=False)
RUNS = {
    # name: (trainer kind, posttrain.train settings); together they reach every piece of each step
    "grpo": ("online", dict(algorithm="grpo", prompts_per_step=2, group_size=4, max_new_tokens=6,
                            eval_tasks=("addition-process",))),
    "ppo": ("online", dict(algorithm="ppo", prompts_per_step=2, group_size=4, max_new_tokens=6)),
    "orpo": ("preference", dict(algorithm="orpo", pairs_per_step=2, pairs_from="dataset")),
    "kto": ("preference", dict(algorithm="kto", pairs_per_step=2, pairs_from="dataset")),
    "sft": ("sft", dict(algorithm="sft")),
    "reward_model": ("reward_model", dict(algorithm="reward_model", pairs_per_step=2)),
}


@pytest.fixture(scope="module")
def logged(tmp_path_factory, tiny_model_dir) -> dict[str, set[str]]:
    """Run name -> the metric names its metrics.jsonl holds (a few seconds each on the 1-layer model)."""
    keys = {}
    for name, (_, settings) in RUNS.items():
        output = tmp_path_factory.mktemp(name) / "run"
        posttrain.train(model=str(tiny_model_dir), task="addition", output=str(output), **QUICK, **settings)
        keys[name] = {key for row in read_metrics(output) for key in row} - {"step"}
    return keys


@pytest.mark.parametrize("run", RUNS)
def test_every_logged_metric_is_in_the_glossary(run, logged):
    undocumented = sorted(name for name in logged[run] if describe(name) is None)
    assert not undocumented, (f"the {run} run logs metrics posttrain/tracking/glossary.py does not describe: "
                              f"{undocumented}; add an entry, then `make docs`")


@pytest.mark.parametrize("run", RUNS)
def test_metrics_said_to_be_always_logged_are(run, logged):
    """An entry logged "every step" or "at evaluations" by a trainer kind must be in every run of that kind
    (each run evaluates at every step); an entry whose condition is not met here says so in its ``when``."""
    kind = RUNS[run][0]
    always = [entry for entry in GLOSSARY if kind in entry.trainers and entry.when in (EVERY_STEP, EVALUATIONS)]
    missing = sorted(entry.pattern for entry in always if not any(entry.matches(name) for name in logged[run]))
    assert not missing, f"the {run} run does not log {missing}, which the glossary says a {kind} run always logs"


def test_the_runs_cover_every_trainer_kind():
    assert {kind for kind, _ in RUNS.values()} == set(TRAINERS)


def test_a_pattern_matches_one_segment():
    function = MetricEntry("reward/<function>", "", "", ("online",))
    assert function.matches("reward/correctness") and function.matches("reward/reward_model")
    assert not function.matches("reward/a/b") and not function.matches("rewards/correctness")
    assert not function.matches("reward/")
    nested = MetricEntry("eval/<task>/<metric>", "", "", ("online",))
    assert nested.matches("eval/gsm_templates/accuracy_low") and not nested.matches("eval/accuracy")


def test_an_exact_entry_wins_over_a_pattern():
    assert describe("reward/mean").pattern == "reward/mean"
    assert describe("reward/correctness").pattern == "reward/<function>"
    assert describe("no_such_metric") is None


def test_glossary_entries_are_distinct_and_name_known_trainers():
    patterns = [entry.pattern for entry in GLOSSARY]
    assert len(patterns) == len(set(patterns))
    assert all(entry.trainers and set(entry.trainers) <= set(TRAINERS) for entry in GLOSSARY)
    assert all(entry.meaning.endswith(".") for entry in GLOSSARY)


# ---------------------------------------------------------------------------------------
# The generated reference pages, and the site build
# ---------------------------------------------------------------------------------------


def test_reference_pages_are_generated_from_the_code():
    """In a process of its own: pieces other tests register must not reach the registries' page."""
    done = subprocess.run([sys.executable, "scripts/gen_reference.py", "--check"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def test_the_functional_reference_names_every_function():
    import posttrain.functional as F

    functional = (ROOT / "docs" / "reference" / "functional.md").read_text()
    assert [name for name in F.__all__ if f"## F.{name}\n" not in functional] == []
    for name in ("process_advantages", "bradley_terry_loss", "chosen_nll"):  # once named in no doc
        assert f"{name}(" in functional


def test_the_metrics_reference_lists_the_glossary():
    metrics = (ROOT / "docs" / "reference" / "metrics.md").read_text()
    assert all(f"| `{entry.pattern}` |" in metrics for entry in GLOSSARY)


def test_the_site_builds_strictly(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.skip("mkdocs and mkdocs-material are not installed (they are in the dev extra: "
                    "pip install -e '.[dev]')")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, f"mkdocs build --strict fails:\n{done.stderr[-4000:]}"
    assert (tmp_path / "site" / "reference" / "metrics" / "index.html").is_file()
