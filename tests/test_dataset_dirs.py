"""A dataset directory as the user keeps it: saved by ``datasets``' ``save_to_disk`` (a Dataset, or a
DatasetDict whose split ``--dataset-split``/``--eval-dataset-split`` chooses), or a directory of data-file
shards read in name order; a directory that is none of these is refused, naming what it holds."""

from __future__ import annotations

import json

import datasets
import pytest

from posttrain.config import Config
from posttrain.data.preference import load_rows
from posttrain.data.prompts import DataError, HubSplits, read_rows
from posttrain.training.session import load_workload

ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]]


def saved_dict(path, splits: dict[str, list[dict]]) -> str:
    datasets.DatasetDict({name: datasets.Dataset.from_list(rows) for name, rows in splits.items()}).save_to_disk(path)
    return str(path)


def test_a_saved_dataset_is_read_whatever_the_split(tmp_path):
    datasets.Dataset.from_list(ROWS).save_to_disk(tmp_path / "saved")
    assert read_rows(str(tmp_path / "saved")) == ROWS
    assert read_rows(str(tmp_path / "saved"), split="test") == ROWS  # one dataset: no split to choose


def test_a_saved_dataset_dict_gives_the_split_asked_for(tmp_path):
    path = saved_dict(tmp_path / "saved", {"train": ROWS[:3], "test": ROWS[3:]})
    assert read_rows(path, split="train") == ROWS[:3]
    assert read_rows(path, split="test") == ROWS[3:]
    with pytest.raises(DataError, match=r"the saved DatasetDict has no split 'validation'; its splits: train, test \("
                                        r"choose with --dataset-split, or --eval-dataset-split for --eval-dataset\)"):
        read_rows(path, split="validation")


def test_a_run_trains_on_one_split_of_a_saved_dataset_dict_and_holds_out_another(tmp_path):
    path = saved_dict(tmp_path / "saved", {"train": ROWS[:3], "held_out": ROWS[3:]})
    work = load_workload(Config.from_flat({"dataset": path, "eval_dataset": path, "eval_dataset_split": "held_out",
                                           "reward": ["numeric_match"], "max_new_tokens": 4}))
    assert (work.train_rows, work.test_rows) == (ROWS[:3], ROWS[3:])


def test_preference_pairs_from_a_saved_dataset_dict(tmp_path):
    pairs = [{"prompt": r["prompt"], "chosen": r["answer"], "rejected": "0"} for r in ROWS]
    path = saved_dict(tmp_path / "pairs", {"train": pairs[:3], "test": pairs[3:]})
    train, test, _ = load_rows(path, path, None, paired=True, needs_scores=False, hub=HubSplits())
    assert (train, test) == (pairs[:3], pairs[3:])


def write_shard(path, rows: list[dict]) -> None:
    frame = datasets.Dataset.from_list(rows)
    {".parquet": frame.to_parquet, ".csv": lambda p: frame.to_csv(p, index=False), ".json": frame.to_json,
     ".jsonl": frame.to_json}[path.suffix](str(path))


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl", ".json", ".csv"])
def test_shards_of_one_kind_are_read_in_name_order(tmp_path, suffix):
    shards = tmp_path / "shards"
    shards.mkdir()
    for name, part in [("part-00002", ROWS[3:]), ("part-00000", ROWS[:1]), ("part-00001", ROWS[1:3])]:  # written out of order
        write_shard(shards / f"{name}{suffix}", part)
    (shards / "_SUCCESS").touch()  # what Spark leaves beside its shards
    (shards / f".part-00000{suffix}.crc").touch()
    (shards / "README.md").write_text("the data's card")
    rows = read_rows(str(shards))
    if suffix == ".csv":  # CSV has no types: the answers come back as numbers
        rows = [{**row, "answer": str(row["answer"])} for row in rows]
    assert rows == ROWS


def test_a_bad_shard_line_is_named_by_file_and_line(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    (tmp_path / "b.jsonl").write_text(json.dumps(ROWS[1]) + "\n{not json\n")
    with pytest.raises(DataError, match=r"b\.jsonl:2: malformed JSON"):
        read_rows(str(tmp_path))


def test_a_directory_of_mixed_kinds_or_without_data_is_refused_naming_what_it_holds(tmp_path):
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for name in ("a.jsonl", "b.jsonl", "c.parquet"):
        write_shard(mixed / name, ROWS)
    with pytest.raises(DataError, match=r"data files of several kinds \(2 \.jsonl, 1 \.parquet\); keep the shards of "
                                        "one kind in it"):
        read_rows(str(mixed))
    empty = tmp_path / "no_data"
    (empty / "train").mkdir(parents=True)
    (empty / "notes.txt").write_text("prompts to come")
    with pytest.raises(DataError, match=r"no data file in the directory \(found: notes\.txt, train/\)"):
        read_rows(str(empty))
    (tmp_path / "nothing").mkdir()
    with pytest.raises(DataError, match=r"\(found: nothing\)"):
        read_rows(str(tmp_path / "nothing"))
