"""Preference data: the truncation rule and its count, an error naming the row and field for each bad
row, the file formats, chat rendering, unpairing, and the built-in addition pairs."""

from __future__ import annotations

import json
import re

import pytest

from posttrain.data.prompts import DataError
from posttrain.models.tiny import char_tokenizer
from posttrain.data.preference import check_rows, completion_text, encode, load_rows, truncate, unpair
from posttrain.data.tasks.addition import FORMAT_PATTERN, make_rows, scratchpad
from posttrain.data.tasks.addition_pairs import make_task, pair_row, wrong_scratchpad

GOOD = {"prompt": "1+2=", "chosen": "1+2=3|3", "rejected": "1+2=4|4", "score_chosen": 1.0, "score_rejected": 0.0}
GOOD_KTO = {"prompt": "1+2=", "completion": "1+2=3|3", "label": True}


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer("0123456789+=,|")


def test_truncation_keeps_the_prompt_end_and_the_completion_start():
    prompt, completions = list(range(10)), [[20] * 8, [30] * 3]
    # max_prompt_length 6: prompt -> its last 6 tokens 4..9; then 12 - 6 = 6 tokens left for each completion.
    kept_prompt, kept, cut = truncate(prompt, completions, max_length=12, max_prompt_length=6)
    assert kept_prompt == [4, 5, 6, 7, 8, 9] and kept == [[20] * 6, [30] * 3] and cut
    assert truncate([1, 2], [[3, 4]], max_length=4, max_prompt_length=2) == ([1, 2], [[3, 4]], False)
    # Only the completion too long: 10 - 3 = 7 tokens kept.
    assert truncate([1, 2, 3], [[5] * 9], max_length=10, max_prompt_length=5) == ([1, 2, 3], [[5] * 7], True)


def test_encode_counts_truncated_examples(tokenizer):
    rows = [dict(GOOD), {**GOOD, "prompt": "123+456="}, {**GOOD, "chosen": "7+9=16,1+0+1=2|216"}]
    # prompt "1+2=" is 5 tokens with BOS, "123+456=" 9; completions 8 tokens with EOS, the long one 19.
    data = encode(rows, tokenizer, paired=True, with_scores=True, max_length=16, max_prompt_length=6)
    assert data.truncated.tolist() == [False, True, True]
    assert [len(p) for p in data.prompt_ids] == [5, 6, 5]
    assert [len(c) for c in data.completion_ids[0]] == [8, 8, 11]
    assert tokenizer.decode(data.prompt_ids[1]) == "3+456="  # the end of the prompt
    assert data.completion_ids[0][0][-1] == tokenizer.eos_token_id  # EOS appended once
    assert data.scores.tolist() == [[1.0] * 3, [0.0] * 3]


BAD_ROWS = [
    ({"chosen": "1", "rejected": "2"}, "row 2 has no 'prompt'"),
    ({**GOOD, "chosen": ""}, "row 2: 'chosen' is empty"),
    ({**GOOD, "rejected": "  "}, "row 2: 'rejected' is empty"),
    ({k: v for k, v in GOOD.items() if k != "rejected"}, "row 2 has no 'rejected'"),
    ({**GOOD, "chosen": 3}, "row 2: 'chosen' must be a string or a list"),
    ({**GOOD, "prompt": [{"role": "user", "content": "hi"}]}, "row 2: 'prompt' and 'chosen' must both be"),
    ({**GOOD, "prompt": [], "chosen": [], "rejected": []}, "row 2: 'prompt' is empty"),
]
BAD_SCORES = [
    ({k: v for k, v in GOOD.items() if k != "score_rejected"}, "row 2 has no 'score_rejected'"),
    ({**GOOD, "score_chosen": 0.5, "score_rejected": 0.5}, r"row 2: ODPO needs score_chosen > score_rejected"),
    ({**GOOD, "score_chosen": 0.1, "score_rejected": 0.7}, r"row 2: ODPO needs score_chosen > score_rejected"),
    ({**GOOD, "score_chosen": "high"}, "row 2: 'score_chosen' must be a finite number"),
]
BAD_KTO = [
    ({k: v for k, v in GOOD_KTO.items() if k != "label"}, "row 2 has no 'label'"),
    ({**GOOD_KTO, "label": "yes"}, "row 2: 'label' must be true or false"),
    ({**GOOD_KTO, "completion": ""}, "row 2: 'completion' is empty"),
]


@pytest.mark.parametrize("row, message", BAD_ROWS)
def test_each_bad_pair_names_its_row_and_field(row, message):
    with pytest.raises(DataError, match=re.escape(message)):
        check_rows([GOOD, row], "pairs.jsonl", paired=True)


@pytest.mark.parametrize("row, message", BAD_SCORES)
def test_odpo_rows_need_ordered_scores(row, message):
    check_rows([GOOD, row], "pairs.jsonl", paired=True)  # fine without ODPO
    with pytest.raises(DataError, match=message):
        check_rows([GOOD, row], "pairs.jsonl", paired=True, needs_scores=True)


@pytest.mark.parametrize("row, message", BAD_KTO)
def test_each_bad_unpaired_row_names_its_row_and_field(row, message):
    with pytest.raises(DataError, match=re.escape(message)):
        check_rows([GOOD_KTO, row], "kto.jsonl", paired=False)


def test_empty_dataset_is_an_error():
    with pytest.raises(DataError, match="no rows"):
        check_rows([], "pairs.jsonl", paired=True)


@pytest.mark.parametrize("suffix", ["jsonl", "csv", "parquet"])
def test_pairs_load_from_each_file_format(suffix, tmp_path):
    import datasets

    rows = [GOOD, {**GOOD, "prompt": "3+4=", "chosen": "3+4=7|7"}]
    path = tmp_path / f"pairs.{suffix}"
    if suffix == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif suffix == "csv":
        datasets.Dataset.from_list(rows).to_csv(str(path), index=False)
    else:
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    train, test, task = load_rows(str(path), str(path), None, paired=True, needs_scores=True)
    assert train == rows and test == rows and task is None
    kto, _, _ = load_rows(str(path), str(path), None, paired=False, needs_scores=False)  # pairs given to KTO
    assert [(r["completion"], r["label"]) for r in kto[:2]] == [("1+2=3|3", True), ("1+2=4|4", False)]


def test_file_errors_name_the_file_and_row(tmp_path):
    path = tmp_path / "odpo.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps({**GOOD, "score_chosen": -1.0}) + "\n")
    with pytest.raises(DataError, match=rf"{re.escape(str(path))}: row 2: ODPO needs"):
        load_rows(str(path), None, None, paired=True, needs_scores=True)


def test_unpair_keeps_every_completion_with_its_label():
    assert unpair([GOOD]) == [{"prompt": "1+2=", "completion": "1+2=3|3", "label": True},
                              {"prompt": "1+2=", "completion": "1+2=4|4", "label": False}]


def test_chat_rows_follow_trl():
    tok = char_tokenizer("abcdefghijklmnopqrstuvwxyz:;0123456789+=,|")
    tok.chat_template = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}"
                         "{% if add_generation_prompt %}a:{% endif %}")
    prompt = [{"role": "user", "content": "1+2"}]
    chosen = [{"role": "assistant", "content": "3"}]
    assert completion_text(tok, prompt, chosen, "row 1") == "3;"  # what the template adds after "u:1+2;a:"
    row = {"prompt": prompt, "chosen": chosen, "rejected": [{"role": "assistant", "content": "4"}]}
    data = encode([row], tok, paired=True, with_scores=False, max_length=64, max_prompt_length=32)
    assert tok.decode(data.prompt_ids[0]) == "u:1+2;a:"  # the template, which adds no BOS here
    assert tok.decode(data.completion_ids[0][0]) == "3;<eos>" and tok.decode(data.completion_ids[1][0]) == "4;<eos>"


class Draws:
    """A stand-in for random.Random: fixed draws."""

    def __init__(self, drop: bool, sign: int = -1):
        self.drop, self.sign = drop, sign

    def random(self) -> float:
        return 0.0 if self.drop else 0.99

    def choice(self, options):
        return self.sign if options == [-1, 1] else options[0]

    def randrange(self, n: int) -> int:
        return 0


def test_wrong_scratchpads_by_hand():
    # 47+385: 7+5=12 (carry), 4+8+1=13 (carry), 0+3+1=4 -> 432.
    assert scratchpad(47, 385) == "7+5=12,4+8+1=13,0+3+1=4|432"
    # Dropped carry in the first column that has one (tens): 4+8=12, the answer 10 short.
    assert wrong_scratchpad(47, 385, Draws(drop=True)) == ("7+5=12,4+8=12,0+3+1=4|422", 422)
    # Slip in the units, one too low: 7+5=11, the rest unchanged, the answer 1 short.
    assert wrong_scratchpad(47, 385, Draws(drop=False)) == ("7+5=11,4+8+1=13,0+3+1=4|431", 431)
    # A slip that creates a carry propagates it: 5+4=10 makes the tens 1+2+1=4.
    assert wrong_scratchpad(15, 24, Draws(drop=False, sign=1)) == ("5+4=10,1+2+1=4|40", 40)
    # No carry to drop: a slip instead; a column sum of 0 can only go up.
    assert wrong_scratchpad(10, 20, Draws(drop=True)) == ("0+0=1,1+2=3|31", 31)


def test_addition_pairs_are_plausible_wrong_and_deterministic():
    train, _ = make_rows(seed=3, n_train=300, n_test=0)
    pairs = [pair_row(r) for r in train]
    assert pairs == [pair_row(r) for r in train]  # same prompt, same pair
    kinds = set()
    for pair, row in zip(pairs, train):
        assert pair["chosen"] == row["solution"] and pair["rejected"] != pair["chosen"]
        assert re.fullmatch(FORMAT_PATTERN, pair["rejected"])
        chosen_steps = pair["chosen"].split("|")[0].split(",")
        rejected_steps = pair["rejected"].split("|")[0].split(",")
        error = abs(int(pair["rejected"].split("|")[1]) - int(row["answer"]))
        column = len(str(error)) - 1
        assert error == 10**column  # one mistake in one column
        assert chosen_steps[:column] == rejected_steps[:column]  # right up to that column
        assert pair["score_rejected"] == -column and pair["score_chosen"] == 1.0
        kinds.add("dropped carry" if "+1" in chosen_steps[column] and "+1" not in rejected_steps[column] else "slip")
    assert kinds == {"slip", "dropped carry"}


def test_addition_pair_task_splits_like_the_addition_task():
    task = make_task(seed=0, n_train=20, n_test=5)
    assert [p["prompt"] for p in task.train] == [r["prompt"] for r in task.source.train]
    assert [p["prompt"] for p in task.test] == [r["prompt"] for r in task.source.test]
    assert task.source.default_model == "tiny-addition"
