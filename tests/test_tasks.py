"""The addition task: hand-written scratchpads, a disjoint seeded split, strict answer parsing."""

import re

import pytest

from posttrain.data.tasks import TASKS, get_task
from posttrain.data.tasks.addition import FORMAT_PATTERN, accuracy, correct, make_rows, scratchpad, scratchpad_format


@pytest.mark.parametrize(
    "a, b, expected",
    [
        (47, 385, "7+5=12,4+8+1=13,0+3+1=4|432"),  # shorter operand padded with 0, carries written as +1
        (3, 4, "3+4=7|7"),  # shortest completion: 7 characters
        (5, 7, "5+7=12|12"),  # final carry becomes the leading digit
        (0, 0, "0+0=0|0"),
        (100, 5, "0+5=5,0+0=0,1+0=1|105"),
        (969, 8, "9+8=17,6+0+1=7,9+0=9|977"),
        (999, 999, "9+9=18,9+9+1=19,9+9+1=19|1998"),  # longest: 29 characters
    ],
)
def test_scratchpad_by_hand(a, b, expected):
    assert scratchpad(a, b) == expected
    assert re.fullmatch(FORMAT_PATTERN, expected)


def test_split_is_disjoint_seeded_and_consistent():
    task = get_task("addition", seed=0)
    assert len(task.train) == 20_000 and len(task.test) == 500
    train_prompts = {row["prompt"] for row in task.train}
    test_prompts = {row["prompt"] for row in task.test}
    assert len(train_prompts) == 20_000 and len(test_prompts) == 500  # no duplicates inside a split
    assert not train_prompts & test_prompts
    assert get_task("addition", seed=0).test == task.test  # same seed, same split
    assert get_task("addition", seed=1).test != task.test
    for row in task.train[:2000] + task.test:
        a, b = map(int, row["prompt"].removesuffix("=").split("+"))
        assert row["answer"] == str(a + b) and row["solution"] == scratchpad(a, b)
    lengths = [len(row["solution"]) for row in task.train]
    assert min(lengths) >= 7 and max(lengths) <= 29
    # max_new_tokens fits the longest reference plus EOS
    assert task.max_new_tokens >= max(lengths) + 1


def test_digit_counts_are_mixed():
    train, _ = make_rows(seed=0, n_train=3000, n_test=0)
    widths = {len(row["prompt"].removesuffix("=").split("+")[0]) for row in train}
    assert widths == {1, 2, 3}


def test_correct_and_accuracy_on_exact_strings():
    prompts = ["47+385="] * 6
    completions = [
        "7+5=12,4+8+1=13,0+3+1=4|432",  # right
        "7+5=12,4+8+1=13,0+3+1=4|431",  # wrong sum
        "7+5=12,4+8+1=13,0+3+1=4",  # no delimiter: no answer
        "432",  # bare number without '|' does not count
        "garbage|432",  # only the final answer is checked, not the steps
        "",
    ]
    answer = ["432"] * 6
    assert correct(prompts, completions, answer=answer) == [True, False, False, False, True, False]
    assert accuracy(prompts, completions, answer=answer) == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    assert scratchpad_format(prompts, completions) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert scratchpad_format.__name__ == "format"


def test_reference_solutions_get_full_reward():
    task = get_task("addition")
    rows = task.test
    prompts = [r["prompt"] for r in rows]
    solutions = [r["solution"] for r in rows]
    columns = {k: [r[k] for r in rows] for k in rows[0] if k != "prompt"}
    # one reward function (a loop over none would check nothing), and it gives every reference full reward
    assert [fn(prompts, solutions, **columns) for fn in task.reward_funcs] == [[1.0] * len(rows)]
    assert all(task.correct(prompts, solutions, **columns))
    assert task.reward_weights == (1.0,) and task.default_model == "tiny-addition"


def test_unknown_task_lists_valid_names():
    with pytest.raises(ValueError, match="valid tasks: addition"):
        get_task("multiplication")
    assert "addition" in TASKS
