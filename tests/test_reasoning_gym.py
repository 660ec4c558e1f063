"""reasoning-gym as a task source: spec parsing and its errors, the weighted mix, rewards equal to
each family's own scorer, a held-out split that shares no problem with training, determinism."""

from __future__ import annotations

import importlib.util
from collections import Counter

import pytest

reasoning_gym = pytest.importorskip("reasoning_gym")

from posttrain.config import ConfigError  # noqa: E402
from posttrain.data.tasks import get_task  # noqa: E402
from posttrain.data.tasks.reasoning_gym import INSTRUCTION, Component, apportion, make_task, parse_spec  # noqa: E402

SMALL_SPACE = "reasoning-gym:chain_sum(min_terms=2,max_terms=2,min_digits=1,max_digits=1)"
"""Sums of two one-digit numbers: few enough problems that distant seeds repeat some."""


def _chat(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


# --- the spec --------------------------------------------------------------------------------


def test_single_family_has_weight_one_and_no_settings():
    assert parse_spec("reasoning-gym:chain_sum") == [Component("chain_sum", {}, 1.0)]


def test_mix_with_weights_and_settings():
    spec = ("reasoning-gym:chain_sum(min_terms=2,max_terms=4)=2, "
            "basic_arithmetic(operators=('+','-'),format_style=natural)=0.5,gcd")
    assert parse_spec(spec) == [
        Component("chain_sum", {"min_terms": 2, "max_terms": 4}, 2.0),
        Component("basic_arithmetic", {"operators": ("+", "-"), "format_style": "natural"}, 0.5),  # bare word: a string
        Component("gcd", {}, 1.0),
    ]


@pytest.mark.parametrize("body, message", [
    ("chain_summ", r"unknown reasoning-gym family 'chain_summ' \(did you mean chain_sum or decimal_chain_sum\?\); "
                   r"the \d+ families are ab, acre, .*, \.\.\. and \d+ more"),
    ("chain_sum=0", "weight of reasoning-gym family 'chain_sum' must be a positive number, got '0'"),
    ("chain_sum=-1", "weight of reasoning-gym family 'chain_sum' must be a positive number, got '-1'"),
    ("chain_sum=lots", "weight of reasoning-gym family 'chain_sum' must be a positive number, got 'lots'"),
    ("chain_sum=nan", "weight of reasoning-gym family 'chain_sum' must be a positive number, got 'nan'"),
    ("chain_sum(min_term=2)", "family 'chain_sum' has no setting 'min_term'; its settings: min_terms, max_terms"),
    ("chain_sum(seed=1)", "family 'chain_sum' has no setting 'seed' \\(the split sets it\\)"),
    ("chain_sum(min_terms=abc)", "setting min_terms='abc' of reasoning-gym family 'chain_sum' must be of type int"),
    ("chain_sum(min_terms=True)", "setting min_terms=True of reasoning-gym family 'chain_sum' must be of type int"),
    ("chain_sum(allow_negation=1)",
     "setting allow_negation=1 of reasoning-gym family 'chain_sum' must be of type bool"),
    ("chain_sum(min_terms)", "setting 'min_terms' of reasoning-gym family 'chain_sum' is not NAME=VALUE"),
    ("chain_sum(min_terms=2,min_terms=3)", "setting 'min_terms' of reasoning-gym family 'chain_sum' is given twice"),
    ("chain_sum(min_terms=2", "the settings must close with '\\)'"),
    ("chain_sum,chain_sum=2", "family 'chain_sum' appears twice"),
    ("chain_sum,", "empty family"),
])
def test_spec_errors_name_the_problem(body, message):
    with pytest.raises(ConfigError, match=message):
        parse_spec("reasoning-gym:" + body)


def test_settings_the_family_rejects_name_the_family_and_settings():
    expected = r"'chain_sum' rejects the settings \{'min_terms': 5, 'max_terms': 2\}: max_terms must be >= min_terms"
    with pytest.raises(ConfigError, match=expected):
        make_task("reasoning-gym:chain_sum(min_terms=5,max_terms=2)", n_train=4, n_test=2)


def test_settings_reach_the_generator():
    task = make_task("reasoning-gym:chain_sum(min_terms=3,max_terms=3,min_digits=1,max_digits=1)", n_train=20, n_test=5)
    for row in task.train:
        expression = row["rg_entry"]["metadata"]["expression"]
        assert expression.count("+") + expression.count("-") == 2  # three one-digit terms
        assert all(len(term.strip()) == 1 for term in expression.replace("-", "+").split("+"))


# --- the mix -------------------------------------------------------------------------------


@pytest.mark.parametrize("n, weights, counts", [
    (10, [2, 1], [7, 3]),  # quotas 6.67, 3.33: floors 6 + 3 = 9, the one row left goes to the larger remainder .67
    (2000, [2, 1], [1333, 667]),  # 1333.33, 666.67: floors 1333 + 666, the row left to the .67
    (5, [1, 1, 1], [2, 2, 1]),  # 1.67 each: floors 1 + 1 + 1, two rows left, ties go to the earlier families
    (200, [1], [200]),
    (3, [1, 100], [0, 3]),  # 0.03, 2.97: floors 0 + 2, the row left to the .97
])
def test_apportion_by_largest_remainder(n, weights, counts):
    assert apportion(n, weights) == counts


def test_mix_draws_rows_in_proportion_to_the_weights():
    task = make_task("reasoning-gym:chain_sum=2,basic_arithmetic=1", n_train=30, n_test=9)
    families = [row["rg_entry"]["family"] for row in task.train]
    assert Counter(families) == {"chain_sum": 20, "basic_arithmetic": 10}  # 30 * 2/3, 30 * 1/3
    assert families != ["chain_sum"] * 20 + ["basic_arithmetic"] * 10  # shuffled together
    assert Counter(row["rg_entry"]["family"] for row in task.test) == {"chain_sum": 6, "basic_arithmetic": 3}
    assert "chain_sum (67%), basic_arithmetic (33%)" in task.description


# --- rows and rewards ----------------------------------------------------------------------


def test_rows_are_chat_prompts_with_the_entry_the_scorer_needs():
    task = make_task("reasoning-gym:chain_sum", n_train=3, n_test=2)
    entry = reasoning_gym.create_dataset("chain_sum", seed=0, size=3)[0]
    row = next(r for r in task.train if r["rg_entry"]["question"] == entry["question"])
    assert row == {
        "prompt": [{"role": "user", "content": f"{entry['question']}\n\n{INSTRUCTION}"}],
        "answer": entry["answer"],
        "question": entry["question"],
        "rg_entry": {"family": "chain_sum", **entry},
    }


def test_rewards_equal_the_family_scorer():
    task = make_task("reasoning-gym:chain_sum", n_train=5, n_test=3)
    reward, scorer = task.reward_funcs[0], reasoning_gym.get_score_answer_fn("chain_sum")
    rows = task.test[:3]
    gold = [row["answer"] for row in rows]
    wrong = str(int(gold[1]) + 1)
    completions = [
        f"Adding the terms step by step.\nAnswer: {gold[0]}",
        f"Answer: {wrong}",
        "I am not sure.",  # no answer at all: 0.0
    ]
    entries = [row["rg_entry"] for row in rows]
    prompts = [row["prompt"] for row in rows]
    scores = reward(prompts, [_chat(c) for c in completions], rg_entry=entries)
    assert scores == [scorer(gold[0], entries[0]), scorer(wrong, entries[1]), 0.0] == [1.0, 0.0, 0.0]
    assert task.correct(prompts, [_chat(c) for c in completions], rg_entry=entries, answer=gold) == [True, False, False]


def test_without_the_delimiter_the_answer_is_read_as_extract_answer_reads_it():
    task = make_task("reasoning-gym:chain_sum", n_train=5, n_test=2)
    row = task.test[0]
    completions = [f"So the answer is {row['answer']}.", f"The sum: \\boxed{{{row['answer']}}}", f"= {row['answer']}"]
    assert task.reward_funcs[0]([row["prompt"]] * 3, completions, rg_entry=[row["rg_entry"]] * 3) == [1.0, 1.0, 1.0]


def test_partial_scores_are_the_scorer_s_and_a_missing_answer_is_zero():
    """countdown's scorer: 1.0 for an expression of exactly the given numbers that makes the target,
    0.05 for one of the right numbers that misses it, and 0.01 for no answer, which the reward makes 0.0."""
    task = make_task("reasoning-gym:countdown", n_train=2, n_test=1)
    row = task.test[0]
    entry = row["rg_entry"]
    numbers = entry["metadata"]["numbers"]
    wrong = " + ".join(str(n) for n in numbers)
    assert eval(wrong) != entry["metadata"]["target"]  # the plain sum misses this target
    scorer = reasoning_gym.get_score_answer_fn("countdown")
    assert (scorer(entry["answer"], entry), scorer(wrong, entry), scorer(None, entry)) == (1.0, 0.05, 0.01)
    completions = [f"Answer: {entry['answer']}", f"Answer: {wrong}", "No idea.", "Answer:"]
    assert task.reward_funcs[0]([row["prompt"]] * 4, completions, rg_entry=[entry] * 4) == [1.0, 0.05, 0.0, 0.0]


# --- splits --------------------------------------------------------------------------------


def test_held_out_split_shares_no_problem_with_training():
    """Sums of two one-digit numbers repeat across distant seeds: the repeats are dropped from held-out."""
    task = make_task(SMALL_SPACE, n_train=200, n_test=50)
    train = {row["rg_entry"]["question"] for row in task.train}
    test = [row["rg_entry"]["question"] for row in task.test]
    assert not train & set(test)
    assert len(set(test)) == len(test)
    assert len(task.train) == 200 and len(test) < 50  # some were dropped: the check did something
    assert f"{50 - len(test)} held-out problem(s) dropped" in task.description


def test_same_seed_same_splits_other_seed_other_splits():
    spec = "reasoning-gym:chain_sum=2,gsm_symbolic=1"
    first, again, other = (make_task(spec, seed, n_train=12, n_test=6) for seed in (3, 3, 4))
    assert (first.train, first.test) == (again.train, again.test)
    assert first.train != other.train and first.test != other.test


def test_get_task_builds_a_reasoning_gym_task_end_to_end():
    task = get_task("reasoning-gym:chain_sum", 0)
    assert (task.name, len(task.train), task.max_new_tokens, task.default_model) == (
        "reasoning-gym:chain_sum", 2000, 256, "smollm2-135m")
    assert 190 <= len(task.test) <= 200  # 200 drawn, the rare repeats of a training problem dropped
    row = task.test[0]
    completions = [_chat(f"Answer: {row['answer']}"), _chat(f"Answer: {row['answer']}0")]
    columns = {"answer": [row["answer"]] * 2, "rg_entry": [row["rg_entry"]] * 2}
    # chain_sum's scorer gives partial credit to an answer that contains the gold one: len(gold) / len(answer)
    partial = len(row["answer"]) / (len(row["answer"]) + 1)
    assert task.reward_funcs[0]([row["prompt"]] * 2, completions, **columns) == [1.0, partial]
    assert task.correct([row["prompt"]] * 2, completions, **columns) == [True, False]


def test_missing_package_names_the_extra(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "reasoning_gym" else find_spec(name, *args))
    with pytest.raises(ConfigError, match=r"needs the reasoning-gym package: pip install 'posttrain\[reasoning-gym\]'"):
        get_task("reasoning-gym:chain_sum")


def test_unknown_task_mentions_reasoning_gym():
    with pytest.raises(ValueError, match="or reasoning-gym:FAMILY"):
        get_task("multiplication")


# --- posttrain's own family ------------------------------------------------------------------


def test_gsm_templates_family_draws_the_gsm_task_s_problems_and_scores_exact_numbers():
    from posttrain.data.tasks import gsm

    task = make_task("reasoning-gym:gsm_templates(easy_share=0.0)", seed=3, n_train=40, n_test=10)
    templates = {row["rg_entry"]["metadata"]["template"] for row in task.train}
    assert templates <= {t.__name__ for t in gsm.HARDER}  # easy_share 0: no one-operation template
    row = task.train[0]
    assert row["prompt"][0]["content"].endswith(INSTRUCTION)
    entry = row["rg_entry"]
    gold = entry["answer"]
    texts = [f"so {gold} in all.\nAnswer: {gold}", f"Answer: ${gold}.00", f"Answer: {gold} apples",
             f"Answer: {int(gold) + 1}", "no answer at all", f"Answer: {int(gold) + 1} or {gold}",
             f"The answer is 2 + {int(gold) - 2} = {gold}.", f"#### {gold}", f"\\boxed{{{gold}}}"]
    scores = task.reward_funcs[0]([row["prompt"]] * len(texts), [_chat(t) for t in texts], rg_entry=[entry] * len(texts))
    # the answer's number counts, units and all, however it is written; a second number in the answer
    # earns nothing (no credit for merely containing the reference)
    assert scores == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0]


def test_gsm_templates_mixes_with_reasoning_gym_families_and_holds_out_disjointly():
    task = make_task("reasoning-gym:gsm_templates=3,chain_sum", seed=0, n_train=400, n_test=100)
    counts = Counter(row["rg_entry"]["family"] for row in task.train)
    assert counts == {"gsm_templates": 300, "chain_sum": 100}
    train_questions = {row["rg_entry"]["question"] for row in task.train}
    assert not train_questions & {row["rg_entry"]["question"] for row in task.test}
    with pytest.raises(ConfigError, match="easy_share"):
        make_task("reasoning-gym:gsm_templates(easy_share=2.0)", seed=0, n_train=4, n_test=2)
