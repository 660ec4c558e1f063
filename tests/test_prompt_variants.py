"""Prompt variants, the answer parser behind them, and evaluation across them."""

from __future__ import annotations

import json

import pytest

from posttrain.cli import main
from posttrain.config import ConfigError
from posttrain.data.prompt_variants import (
    BUILTIN_VARIANTS,
    TRAINING_VARIANTS,
    PromptVariant,
    ask,
    ask_each_differently,
    resolve_variants,
)
from posttrain.data.rewards import final_answer
from posttrain.tracking.stats import across_variants, pass_at_k, pass_ks, summarise, wilson_interval

QUESTION = "Ann has 3 pens and buys 4 more. How many pens does she have?"


# --- the built-in variants render as documented --------------------------------------------


def test_each_evaluation_variant_renders_as_documented():
    rendered = {name: variant.render(QUESTION) for name, variant in BUILTIN_VARIANTS.items()}
    user = {name: messages[-1]["content"] for name, messages in rendered.items()}
    assert user["bare"] == QUESTION
    assert user["answer_line"] == (f'{QUESTION}\n\nWork it out briefly, then end your reply with "Answer:" followed '
                                   "by the final answer alone.")
    assert user["answer_is"] == f'{QUESTION}\nEnd your reply with "The answer is N." where N is the final number.'
    assert user["hashes"] == (f"{QUESTION}\nSolve the problem, then write the final answer on the last line after "
                              '"####".')
    assert user["boxed"] == f"{QUESTION}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
    assert user["reason_first"].startswith("Solve the following word problem. Reason step by step, then finish "
                                           "with a sentence that states the answer.\n\n")
    assert user["reason_first"].endswith(QUESTION)  # the instruction before the question
    assert user["system"] == QUESTION
    assert rendered["system"][0] == {"role": "system", "content": "You are a careful math tutor. Solve the user's "
                                     'problem and end with "The answer is N."'}
    assert all(len(messages) == 1 for name, messages in rendered.items() if name != "system")  # no system turn


def test_training_phrasings_are_not_evaluation_phrasings():
    eval_texts = {(v.user, v.system) for v in BUILTIN_VARIANTS.values()}
    assert len(TRAINING_VARIANTS) == 10
    assert not eval_texts & {(v.user, v.system) for v in TRAINING_VARIANTS.values()}
    for variant in TRAINING_VARIANTS.values():  # each renders its question once, in the user turn
        assert variant.render(QUESTION)[-1]["content"].count(QUESTION) == 1


def test_a_spec_names_a_set_or_variants_and_an_unknown_name_is_refused():
    assert [v.name for v in resolve_variants("eval")] == list(BUILTIN_VARIANTS)
    assert [v.name for v in resolve_variants("bare, boxed,bare")] == ["bare", "boxed"]  # repeats once
    with pytest.raises(ConfigError, match="unknown variant 'boxd'"):
        resolve_variants("bare,boxd")


# --- a user's template file ----------------------------------------------------------------


def test_a_template_file_loads_with_names_and_system_messages(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text('- name: polite\n  user: "Could you solve this? {question}"\n  system: Be kind.\n'
                    '- "{question} Reply with a number in {{braces}}."\n')
    first, second = resolve_variants(str(path))
    assert first.render("1+1?") == [{"role": "system", "content": "Be kind."},
                                    {"role": "user", "content": "Could you solve this? 1+1?"}]
    assert second.name == "file:2" and second.render("2+2?")[0]["content"] == "2+2? Reply with a number in {braces}."


@pytest.mark.parametrize("entry, message", [
    ({"user": "Solve it."}, r"must hold \{question\} exactly once, it holds it 0 times"),
    ({"user": "{question} and {question}"}, "exactly once, it holds it 2 times"),
    ({"user": "{question} in {units}"}, r"unknown field \{units\}"),
    ({"user": "{question}", "sytem": "x"}, "unknown field 'sytem'; the fields are name, user, system"),
    ({"user": "{question}", "system": "About {question}"}, "the system message may not hold"),
    ({"name": "x"}, "needs a user template"),
    ({"user": "{question"}, "is not a format string"),
])
def test_a_bad_template_file_says_which_template_and_what(tmp_path, entry, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([{"user": "{question}"}, entry]))
    with pytest.raises(ConfigError, match=message) as raised:
        resolve_variants(str(path))
    assert "template 2" in str(raised.value)


def test_a_template_file_must_be_a_list_with_distinct_names(tmp_path):
    path = tmp_path / "v.yaml"
    path.write_text("user: '{question}'\n")
    with pytest.raises(ConfigError, match="expected a non-empty list"):
        resolve_variants(str(path))
    path.write_text("- {name: a, user: '{question}'}\n- {name: a, user: 'Q: {question}'}\n")
    with pytest.raises(ConfigError, match="two templates are named 'a'"):
        resolve_variants(str(path))
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_variants(str(tmp_path / "missing.yaml"))


# --- asking rows ---------------------------------------------------------------------------


def test_asking_replaces_the_prompt_and_keeps_the_columns():
    rows = [{"prompt": "old", "question": QUESTION, "answer": "7"}]
    assert ask(rows, BUILTIN_VARIANTS["bare"], "data") == [{"prompt": [{"role": "user", "content": QUESTION}],
                                                             "question": QUESTION, "answer": "7"}]
    with pytest.raises(ConfigError, match="data row 2 has no 'question' column"):
        ask([*rows, {"prompt": "1+1="}], BUILTIN_VARIANTS["bare"], "data")


def test_training_prompts_draw_a_variant_each_and_the_draw_is_seeded():
    rows = [{"prompt": "", "question": f"q{i}"} for i in range(200)]
    variants = list(TRAINING_VARIANTS.values())
    asked = ask_each_differently(rows, variants, seed=3, source="t")
    assert asked == ask_each_differently(rows, variants, seed=3, source="t")
    drawn = [[v.name for v in variants if v.render(row["question"]) == row["prompt"]] for row in asked]
    assert all(len(names) == 1 for names in drawn)  # each prompt is exactly one variant's rendering
    assert {names[0] for names in drawn} == set(TRAINING_VARIANTS)  # 200 draws of 10: every one appears


# --- the answer parser on real SmolLM2-135M-Instruct replies --------------------------------

REAL_REPLIES = [
    # (the end of a reply, the question's numbers where they matter, the answer a reader takes from it):
    # SmolLM2-135M-Instruct's greedy replies to gsm_templates problems under the evaluation variants
    ("In 10 years, Olivia will be 12 years old.\n\nSo, the answer is: 12 + 15 = 27", None, "27"),
    ("The answer is 4 + 4 = 8 dollars.\n\nSo, Hugo spends 8 dollars on a pen.", None, "8"),
    ("Jack has 6 + 9 = 15 marbles.\nJack gets 15 - 9 = 2 marbles.\nJack has now 2 marbles.\n#### 2\n"
     "The answer is: 2", None, "2"),
    ("The total number of books Grace has now is 5 + 12 = 17 books.\n#### 1\nGrace has 17 books now.", None, "1"),
    ("Grace has 7 books.\n5 more books = 7 + 5 = 12 books\nGrace has 12 books now.\n\nAnswer: 12 + 1 = 13", None,
     "13"),
    ("Rosa: 20 (Rosa's 1 card) - 1 (Rosa's 1 card) = 1 card left\n\nAnswer: 1 card left", None, "1"),
    ("12 + 9 = 21\n\nSo, the answer is 21.\n\nThe final answer is within \\boxed{}.", None, "21"),
    ("He spends $39 on a game, so he spends $77 - $39 = $21.\n#### 2\nThe answer is 2.\n\nFinn ends his reply "
     'with "Answer:" followed by the final answer alone.', None, "2"),
    ("The total cost of 3 sandwiches is 3 x $3 = $9.\n\nSo, Hugo spends $9 on 3 sandwiches.",
     "A sandwich costs $3. Hugo buys 3 sandwiches. How many dollars does Hugo spend?", "9"),
    ("Dev has 20 + 20 = 40 marbles.\n\nSo, Dev has 40 - 20 = 20 marbles.\n\nIn conclusion, Dev has 20 marbles.",
     None, "20"),
    ("6. 20 + 20 = 40 pages Tara reads in 2 weeks.\n\nSo, the answer is 40.", None, "40"),
    ("Therefore, Jack has 9 marbles now.\n\nSo, the answer is: 9", None, "9"),
    ("Noah had 19 apples, and 5 of them were given to Dev. So, Noah has 19 - 5 = 9 apples left.", None, "9"),
    # the conventions, written by hand
    ("First, 9 + 5 = 14. So she has $\\boxed{14}$ cupcakes.", None, "14"),
    ("Tom has 6 bags of 21 marbles, so the answer is 6 x 21 = 126", None, "126"),
    ("4 x 4 = 16\n#### 16", None, "16"),
]


@pytest.mark.parametrize("reply, question, answer", REAL_REPLIES)
def test_the_answer_parser_reads_every_convention(reply, question, answer):
    assert final_answer(reply, question) == answer


def test_cues_that_state_nothing_leave_the_last_sentence_and_no_number_no_answer():
    assert final_answer("so the answer is \\boxed{12") == "12"  # cut off inside the box: its last number
    assert final_answer("Answer: Friday") == "Friday"
    assert final_answer("no number here") is None


# --- statistics ----------------------------------------------------------------------------


def test_pass_at_k_from_16_samples_by_hand():
    # 2 of 16 right: pass@8 = 1 - C(14, 8) / C(16, 8) = 1 - 3003 / 12870
    assert pass_at_k(16, 2, 8) == pytest.approx(1 - 3003 / 12870)
    assert pass_ks(16) == [1, 2, 4, 8, 16] and pass_ks(8) == [1, 2, 4, 8] and pass_ks(6) == [1, 2, 4, 6]
    m = summarise([False, False], [0.0, 0.0], [1.0, 1.0], sampled=[[True] * 2 + [False] * 14, [False] * 16])
    assert m["pass@8"] == pytest.approx((1 - 3003 / 12870) / 2)
    assert m["pass@16"] == pytest.approx(0.5) and m["pass@1"] == pytest.approx(2 / 16 / 2)


def test_across_variants_by_hand():
    # 4 problems under 3 variants: right counts 3, 2, 1 -> accuracies 0.75, 0.5, 0.25, mean 0.5
    summary = across_variants({"a": [1, 1, 1, 0], "b": [1, 1, 0, 0], "c": [0, 1, 0, 0]})
    assert summary["mean"] == pytest.approx(0.5)
    assert summary["worst"] == 0.25 and summary["worst_variant"] == "c"
    assert (summary["worst_low"], summary["worst_high"]) == pytest.approx(wilson_interval(1, 4))
    # per-problem shares 2/3, 1, 1/3, 0: sample std 0.4303, half-width 1.96 * 0.4303 / 2 = 0.4217
    assert (summary["mean_low"], summary["mean_high"]) == pytest.approx((0.5 - 0.42170, 0.5 + 0.42170), abs=1e-4)
    with pytest.raises(ValueError, match="same problems"):
        across_variants({"a": [1], "b": [1, 0]})


# --- posttrain eval --prompt-variants ------------------------------------------------------


@pytest.fixture
def chat_model_dir(printable_model_dir, tmp_path):
    """The printable tiny model with a chat template, saved beside the test."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(printable_model_dir)
    tokenizer.chat_template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}[assistant]"
    tokenizer.save_pretrained(tmp_path / "chat")
    AutoModelForCausalLM.from_pretrained(printable_model_dir).save_pretrained(tmp_path / "chat")
    return tmp_path / "chat"


def test_eval_asks_every_problem_each_way_and_summarises(chat_model_dir, tmp_path, capsys):
    dataset = tmp_path / "problems.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": f"{a}+1", "question": f"What is {a}+1?", "answer": a + 1}) + "\n"
                               for a in range(3)))
    output, completions = tmp_path / "eval.json", tmp_path / "completions.jsonl"
    code = main(["eval", "--model", str(chat_model_dir), "--dataset", str(dataset), "--reward",
                 "math_answer", "--prompt-variants", "bare,system", "--max-new-tokens", "3",
                 "--output", str(output), "--completions", str(completions)])
    assert code == 0
    payload = json.loads(output.read_text())
    assert list(payload["tasks"]) == [f"{dataset} [bare]", f"{dataset} [system]"]
    records = [json.loads(line) for line in completions.read_text().splitlines()]
    assert [r["variant"] for r in records] == ["bare"] * 3 + ["system"] * 3
    assert records[0]["prompt"] == [{"role": "user", "content": "What is 0+1?"}]
    assert records[3]["prompt"][0]["role"] == "system"
    by_variant = {v: [r["correct"] for r in records if r["variant"] == v] for v in ("bare", "system")}
    assert payload["across_variants"][str(dataset)] == pytest.approx(across_variants(by_variant))
    assert "across 2 prompt variants: mean accuracy" in capsys.readouterr().out


def test_eval_variants_need_a_question_column_and_say_so_before_loading(reward_file, tmp_path, capsys):
    dataset = tmp_path / "problems.jsonl"
    dataset.write_text(json.dumps({"prompt": "1+1"}) + "\n")
    assert main(["eval", "--model", "unused", "--dataset", str(dataset), "--reward", f"{reward_file}:ones",
                 "--prompt-variants", "bare", "--max-new-tokens", "3"]) == 2
    assert "row 1 has no 'question' column" in capsys.readouterr().err


def test_a_built_in_word_problem_task_carries_its_question():
    from posttrain.data.tasks import gsm

    row = gsm.make_task(0).test[0]
    assert row["prompt"][0]["content"] == f"{row['question']}\n{gsm.INSTRUCTION}"
    assert PromptVariant("x", "Q: {question}").render(row["question"])[0]["content"] == f"Q: {row['question']}"


# --- in a training run ---------------------------------------------------------------------


def test_a_run_trains_on_varied_prompts_and_scores_its_eval_task_under_each_variant(chat_model_dir, tmp_path):
    from posttrain.tracking.metrics import read_metrics
    from posttrain.training.session import OnlineSession

    dataset = tmp_path / "problems.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": f"{a}+1=", "question": f"What is {a}+1?", "answer": a + 1}) + "\n"
                               for a in range(6)))
    flags = ["--model", str(chat_model_dir), "--dataset", str(dataset), "--reward", "math_answer",
             "--train-prompt-variants", "bare,system", "--eval-tasks", "gsm", "--eval-prompt-variants",
             "bare,boxed", "--eval-size", "3", "--max-steps", "1", "--eval-every", "1", "--max-new-tokens", "4",
             "--prompts-per-step", "2", "--group-size", "2", "--save-every", "0", "--log-samples-every", "0",
             "--output", str(tmp_path / "run")]
    from posttrain.cli import build_parser, resolve_config

    session = OnlineSession.create(resolve_config(build_parser().parse_args(["train", *flags])))
    asked = {json.dumps(row["prompt"]) for row in session.work.train_rows}
    bare = {json.dumps([{"role": "user", "content": f"What is {a}+1?"}]) for a in range(6)}
    assert asked <= bare | {json.dumps(BUILTIN_VARIANTS["system"].render(f"What is {a}+1?")) for a in range(6)}
    assert asked & bare and asked - bare  # both variants drawn over 6 rows (seed 0)
    assert list(session.eval_workloads) == ["gsm@bare", "gsm@boxed"]
    boxed_prompt = session.eval_workloads["gsm@boxed"].test_rows[0]["prompt"][0]["content"]
    assert boxed_prompt.endswith("put your final answer within \\boxed{}.")
    assert main(["train", *flags]) == 0
    for row in (r for r in read_metrics(tmp_path / "run") if "eval/gsm/variants_mean" in r):
        accuracies = [row["eval/gsm@bare/accuracy"], row["eval/gsm@boxed/accuracy"]]
        assert row["eval/gsm/variants_mean"] == pytest.approx(sum(accuracies) / 2)
        assert row["eval/gsm/variants_worst"] == min(accuracies)


def test_eval_prompt_variants_need_eval_tasks():
    from posttrain.config import Config

    with pytest.raises(ConfigError, match="eval_prompt_variants: asks the eval_tasks' problems several ways"):
        Config.from_flat({"eval_prompt_variants": "eval"})
