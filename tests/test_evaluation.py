"""Evaluation: the estimators against hand-computed values, and ``posttrain eval`` on a custom
dataset and a task in one call."""

from __future__ import annotations

import json

import pytest

from posttrain.cli import main
from posttrain.tracking.stats import majority_index, mean_interval, pass_at_k, summarise, wilson_interval


@pytest.mark.parametrize("n, c, k, expected", [
    (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2) / C(5,2)
    (10, 3, 1, 0.3),  # pass@1 is the share of correct samples
    (4, 0, 2, 0.0),
    (4, 4, 1, 1.0),
    (3, 1, 3, 1.0),  # k == n: whether any sample is correct
    (8, 1, 4, 1 - 35 / 70),  # 1 - C(7,4) / C(8,4)
])
def test_pass_at_k_is_the_unbiased_estimator(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_refuses_impossible_counts():
    with pytest.raises(ValueError, match="n=4, c=5, k=1"):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError, match="k=5"):
        pass_at_k(4, 1, 5)


def test_wilson_interval_by_hand():
    # 8 of 10: p = 0.8, z^2 = 3.8415; centre (0.8 + 0.19207) / 1.38415 = 0.71679,
    # half 1.96 * sqrt(0.016 + 0.0096037) / 1.38415 = 0.22661
    assert wilson_interval(8, 10) == pytest.approx((0.4902, 0.9433), abs=1e-4)
    low, high = wilson_interval(0, 10)  # never the degenerate [0, 0] of the normal interval
    assert low == 0.0 and high == pytest.approx(0.2775, abs=1e-4)
    assert wilson_interval(5, 5) == pytest.approx((0.5655, 1.0), abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_mean_interval_is_normal_over_problems_and_clipped():
    # mean 0.5, sample std sqrt(0.125 / 3) = 0.20412, half 1.96 * 0.20412 / 2 = 0.20004
    mean, low, high = mean_interval([0.5, 0.25, 0.75, 0.5])
    assert (mean, low, high) == pytest.approx((0.5, 0.29996, 0.70004), abs=1e-4)
    assert mean_interval([1.0, 0.0, 1.0, 0.0])[1:] == (0.0, 1.0)  # half-width 0.566: clipped to [0, 1]
    assert mean_interval([0.3]) == (0.3, 0.0, 1.0)  # one problem says nothing about the spread


@pytest.mark.parametrize("answers, expected", [
    (["3", "4", "3", None], 0),
    (["4", "3", "3", "4"], 0),  # a tie goes to the answer given first
    ([None, "5", "6", "6"], 2),
    ([None, None], None),
])
def test_majority_index_votes_over_given_answers(answers, expected):
    assert majority_index(answers) == expected


def test_summarise_by_hand():
    # 3 problems: greedy right, wrong, right; 2 samples each: (T, F), (F, F), (T, T);
    # answers: problem 0 votes "7" (its first sample, correct), problem 1 "2" (wrong),
    # problem 2 ties "5"/"6": the first, correct
    m = summarise([True, False, True], [1.0, 0.0, 1.0], [10.0, 20.0, 30.0],
                  sampled=[[True, False], [False, False], [True, True]],
                  sampled_answers=[["7", "8"], ["2", None], ["5", "6"]])
    assert m["accuracy"] == pytest.approx(2 / 3) and m["reward"] == pytest.approx(2 / 3)
    assert (m["accuracy_low"], m["accuracy_high"]) == pytest.approx(wilson_interval(2, 3))
    assert m["completion_length"] == 20.0
    assert m["pass@1"] == pytest.approx((0.5 + 0 + 1) / 3)
    assert m["pass@2"] == pytest.approx((1 + 0 + 1) / 3)
    assert m["maj@2"] == pytest.approx(2 / 3)
    assert (m["maj@2_low"], m["maj@2_high"]) == pytest.approx(wilson_interval(2, 3))
    # pass@k's intervals are normal over the 3 problems: pass@1 per problem (0.5, 0, 1), sample std 0.5,
    # half-width 1.96 * 0.5 / sqrt(3) = 0.566: clipped to [0, 1] on both sides; pass@2 per problem
    # (1, 0, 1), std sqrt(1/3), half-width 1.96 * sqrt(1/3) / sqrt(3) = 1.96 / 3: [2/3 - 0.653, 1]
    assert (m["pass@1_low"], m["pass@1_high"]) == (0.0, 1.0)
    assert (m["pass@2_low"], m["pass@2_high"]) == pytest.approx(((2 - 1.959964) / 3, 1.0), abs=1e-6)


def test_eval_scores_a_custom_dataset_and_a_task_in_one_call(tiny_model_dir, reward_file, tmp_path, capsys):
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": f"{a}+{a}="}) + "\n" for a in range(7)))
    output = tmp_path / "eval.json"
    code = main(["eval", "--model", str(tiny_model_dir), "--task", "addition", "--dataset", str(dataset),
                 "--reward", f"{reward_file}:ones", "--eval-size", "5", "--samples", "3", "--max-new-tokens", "4",
                 "--output", str(output), "--completions", str(tmp_path / "completions.jsonl")])
    assert code == 0
    results = json.loads(output.read_text())["tasks"]
    assert list(results) == ["addition", str(dataset)]
    custom = results[str(dataset)]
    # every completion earns the constant reward 1.0 >= the success threshold: all correct
    assert custom["problems"] == 5 and custom["accuracy"] == 1.0 and custom["pass@1"] == 1.0
    assert custom["pass@3"] == 1.0
    assert (custom["accuracy_low"], custom["accuracy_high"]) == pytest.approx(wilson_interval(5, 5))
    addition = results["addition"]  # a random model does not add: no greedy or sampled completion is right
    assert addition["problems"] == 5 and addition["accuracy"] == addition["pass@3"] == addition["maj@3"] == 0.0
    records = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert [r["task"] for r in records] == ["addition"] * 5 + [str(dataset)] * 5
    assert records[5]["prompt"] == "0+0=" and records[5]["correct"] and records[5]["reward"] == 1.0
    right = sum(r["correct"] for r in records[:5])
    assert right / 5 == addition["accuracy"]
    # Wilson's interval of the greedy count over the 5 problems: (0, 0.434) for 0 of 5, not a normal (0, 0)
    assert (addition["accuracy_low"], addition["accuracy_high"]) == pytest.approx(wilson_interval(right, 5))
    printed = capsys.readouterr().out
    assert "on addition (5 problems)" in printed and "pass@3" in printed and "95% CI" in printed


def test_eval_on_a_dataset_without_a_reward_says_so(tmp_path, capsys):
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text(json.dumps({"prompt": "1+1="}) + "\n")
    assert main(["eval", "--dataset", str(dataset), "--model", "unused"]) == 2
    assert "reward: a --dataset needs at least one --reward" in capsys.readouterr().err


def test_eval_refuses_zero_samples(capsys):
    assert main(["eval", "--samples", "0"]) == 2
    assert "samples: got 0" in capsys.readouterr().err
