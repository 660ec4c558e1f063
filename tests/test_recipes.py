"""The shipped recipes (recipes/*.yaml) load, validate and name tasks that parse, without loading a model."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.config import Config, load_yaml
from posttrain.training.workload import eval_label, load_eval_workloads, load_workload

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))


def test_there_are_recipes():
    assert RECIPES


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_loads_and_validates(path):
    pytest.importorskip("reasoning_gym")
    config = Config.from_flat(load_yaml(path))
    assert config.model.model == "smollm2-135m"
    work = load_workload(config)  # the task spec parses and draws its split
    assert work.train_rows and work.test_rows
    extra = load_eval_workloads(config, work.max_new_tokens)
    assert list(extra) == [eval_label(spec) for spec in config.data.eval_tasks]
    train_families = {row["rg_entry"]["family"] for row in work.train_rows if "rg_entry" in row}
    assert not train_families & set(extra), "an eval_tasks family is also trained on: it would not measure transfer"
    assert 0 < config.run.max_minutes < 60
