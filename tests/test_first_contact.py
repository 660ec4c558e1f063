"""The traps a new user met on a first run, each with the test that failed before it was fixed: DAPO on
their own reward, a Hugging Face dataset by name, config errors one per run, eval's traceback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from posttrain.cli import main


def write_prompts(path: Path, count: int) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(count)))
    return path


def test_dapo_on_a_users_reward_trains_on_its_values(tmp_path, reward_file, tiny_model_dir, capsys):
    """DAPO's preset maps a task's answer check to +-1; a --reward file has no check, so the rewards
    train as they are (the run used to stop, advising a setting whose value it then refused)."""
    prompts = write_prompts(tmp_path / "my.jsonl", 8)
    argv = ["train", "--algorithm", "dapo", "--model", str(tiny_model_dir), "--dataset", str(prompts),
            "--reward", f"{reward_file}:sevens", "--max-new-tokens", "6", "--max-steps", "1", "--prompts-per-step",
            "2", "--group-size", "4", "--mini-batches", "1", "--eval-size", "0", "--report-to", "none",
            "--no-progress", "--output", str(tmp_path / "run")]
    assert main(argv) == 0
    assert "dapo: your rewards train as they are" in capsys.readouterr().err
    assert (tmp_path / "run" / "final_model").is_dir()
    # given explicitly, binary_reward is refused with the exact value that works
    assert main(argv[:-2] + ["--output", str(tmp_path / "run2"), "--binary-reward=-1,1"]) == 2
    assert "pass --binary-reward none" in capsys.readouterr().err


def test_every_config_problem_of_a_command_line_is_reported_at_once(tmp_path, reward_file, capsys):
    prompts = write_prompts(tmp_path / "my.jsonl", 3)
    code = main(["train", "--dataset", str(prompts), "--reward", f"{reward_file}:sevens", "--max-new-tokens", "0",
                 "--top-p", "2", "--eval-dataset", "missing.jsonl", "--eval-tasks", "nonexistent", "--beta", "-1"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("posttrain: error: 6 problems:\n")
    for expected in ("max_new_tokens: got 0", "top_p: got 2", "eval_dataset: file 'missing.jsonl' does not exist",
                     "eval_tasks: unknown task 'nonexistent'", "beta=-1.0 must be >= 0",
                     "prompts_per_step: 32 is more than the 3 prompts"):
        assert expected in err, expected


def test_eval_of_an_unknown_task_is_one_line_not_a_traceback(capsys):
    assert main(["eval", "--task", "nonexistent"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("posttrain: error: task: unknown task 'nonexistent'") and "Traceback" not in err


@pytest.fixture
def cached_hub_dataset(tmp_path, monkeypatch):
    """``owner/tiny`` in a local Hugging Face cache (configs ``default`` and ``small``, splits train and test),
    read offline, as ``datasets.load_dataset`` leaves it after a download."""
    import datasets
    from datasets.packaged_modules.json.json import Json

    cache = tmp_path / "hf-cache"
    for config, count in (("default", 5), ("small", 2)):
        files = {split: str(write_prompts(tmp_path / f"{config}-{split}.jsonl", count)) for split in ("train", "test")}
        builder = Json(cache_dir=str(tmp_path / "build" / config), dataset_name="tiny", data_files=files,
                       config_name=config)
        builder.download_and_prepare()
        shutil.copytree(builder.cache_dir, cache / "owner___tiny" / config / "0.0.0" / "fixture")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return "owner/tiny"


def test_a_dataset_by_hugging_face_name_reads_its_config_and_split_from_the_cache(cached_hub_dataset):
    from posttrain.config import hub_dataset_name
    from posttrain.data.prompts import read_rows

    assert len(read_rows(cached_hub_dataset, "default")) == 5
    assert len(read_rows("hf:" + cached_hub_dataset, "small", "test")) == 2  # the hf: prefix still works
    assert [hub_dataset_name(s) for s in ("owner/tiny", "hf:owner/tiny", "data/prompts.jsonl", "x.csv")] == \
        ["owner/tiny", "owner/tiny", None, None]


def test_a_hub_dataset_that_is_not_cached_names_the_command_that_fetches_it(cached_hub_dataset, tmp_path, capsys):
    assert main(["train", "--dataset", "owner/absent", "--dataset-config", "main", "--reward", "exact_match",
                 "--max-new-tokens", "8"]) == 2
    err = capsys.readouterr().err
    assert "owner/absent: the Hugging Face dataset is not in the local cache" in err
    assert "datasets.load_dataset('owner/absent', 'main')" in err
    assert main(["train", "--dataset", cached_hub_dataset, "--dataset-config", "small", "--dataset-split", "validation", "--reward",
                 "exact_match", "--max-new-tokens", "8"]) == 2
    assert "Unknown split \"validation\"" in capsys.readouterr().err


@pytest.mark.parametrize("module", ["posttrain.data.preference", "posttrain.data.sft"])
def test_offline_trainers_read_the_hub_datasets_config_and_splits(module, monkeypatch):
    """--dataset-config, --dataset-split and --eval-dataset-split reach the preference, reward-model and SFT
    data too, not only the online trainer's."""
    import importlib

    from posttrain.data.prompts import DataError, HubSplits, hub_splits
    from posttrain.config import Config

    data = importlib.import_module(module)
    calls = []

    def read_rows(path, config=None, split="train"):
        calls.append((path, config, split))
        raise DataError("stop here")

    monkeypatch.setattr(data, "read_rows", read_rows)
    config = Config.from_flat({"dataset": "owner/pairs", "eval_dataset": "owner/pairs", "dataset_config": "small",
                               "dataset_split": "train[:90%]", "eval_dataset_split": "validation"})
    assert hub_splits(config.data) == HubSplits("small", "train[:90%]", "validation")
    paired = {"paired": True, "needs_scores": False} if module.endswith("preference") else {"completion_only_loss": True}
    with pytest.raises(DataError, match="stop here"):
        data.load_rows("owner/pairs", "owner/pairs", None, hub=hub_splits(config.data), **paired)
    assert calls == [("owner/pairs", "small", "train[:90%]")]
    calls.clear()
    monkeypatch.setattr(data, "read_rows", lambda path, config=None, split="train": calls.append(split) or [])
    with pytest.raises(DataError):  # no rows
        data.load_rows("owner/pairs", "owner/pairs", None, hub=hub_splits(config.data), **paired)
    assert calls == ["train[:90%]", "validation"]
