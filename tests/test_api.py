"""``posttrain.train(...)`` from Python: model objects, rows, reward callables, a preset and overrides."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import posttrain
from posttrain.config import ConfigError, load_yaml
from posttrain.tracking.metrics import read_metrics

QUICK = dict(max_steps=2, prompts_per_step=2, group_size=4, max_new_tokens=6, eval_size=4, report_to="none",
             progress=False, eval_every=0, save_every=0)
PROMPTS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 2), (9, 1)]]


def test_a_model_object_rows_and_a_lambda_reward(tmp_path, tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    calls = []

    def count_sevens(prompts, completions, **columns):
        calls.append(columns["answer"])
        return [c.count("7") / 6 for c in completions]

    result = posttrain.train(model=model, tokenizer=tokenizer, algorithm="rloo", train_dataset=PROMPTS,
                             eval_dataset=PROMPTS[:4], reward_funcs=[count_sevens], output=str(tmp_path / "run"),
                             learning_rate=1e-2, **QUICK)
    run = result["run_dir"]
    assert [row["step"] for row in read_metrics(run) if "loss" in row] == [1, 2]
    assert set(result["after"]) >= {"eval/reward", "eval/completion_length"}
    assert [len(answers) for answers in calls] == [4, 8, 8, 4]  # held-out before, 2 steps of 2 x 4, held-out after
    saved = load_yaml(run / "config.yaml")
    assert saved["algorithm"] == "rloo" and saved["learning_rate"] == 1e-2
    assert [json.loads(line) for line in (run / "inputs" / "train.jsonl").read_text().splitlines()] == PROMPTS
    assert saved["dataset"] == str((run / "inputs" / "train.jsonl").resolve())
    assert saved["reward"] == []  # a closure cannot be named in a file: a resume needs it given again
    trained = dict(model.named_parameters())  # the object itself was trained
    start = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters())
    assert any(not torch.equal(trained[n], start[n]) for n in start)


def test_a_reward_defined_in_a_file_is_recorded_so_the_run_resumes(tmp_path, tiny_model_dir, reward_file):
    import importlib.util

    spec = importlib.util.spec_from_file_location("user_rewards", reward_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = posttrain.train(model=str(tiny_model_dir), train_dataset=PROMPTS, reward_funcs=module.sevens,
                             reward_weights=[2.0], output=str(tmp_path / "run"), **QUICK)
    saved = load_yaml(result["run_dir"] / "config.yaml")
    assert saved["reward"] == [f"{reward_file.resolve()}:sevens"] and saved["reward_weights"] == [2.0]


def test_rewards_by_name_are_recorded_as_named(tmp_path, tiny_model_dir):
    result = posttrain.train(model=str(tiny_model_dir), train_dataset=PROMPTS,
                             reward_funcs=["numeric_match", "length_penalty(max_chars=4)"], reward_weights=[1.0, 0.5],
                             output=str(tmp_path / "run"), **QUICK)
    saved = load_yaml(result["run_dir"] / "config.yaml")
    assert (saved["reward"], saved["reward_weights"]) == (["numeric_match", "length_penalty(max_chars=4)"], [1.0, 0.5])
    logged = [row for row in read_metrics(result["run_dir"]) if "loss" in row]
    assert all(-1.0 <= row["reward/length_penalty"] <= 0.0 for row in logged) and len(logged) == 2
    with pytest.raises(ConfigError, match="unknown reward 'numeric' \\(did you mean numeric_match\\?\\)"):
        posttrain.train(model=str(tiny_model_dir), train_dataset=PROMPTS, reward_funcs="numeric",
                        output=str(tmp_path / "bad"), **QUICK)


def test_a_config_file_with_overrides(tmp_path, tiny_model_dir, reward_file):
    config = tmp_path / "run.yaml"
    config.write_text(f"algorithm: dr_grpo\nmodel: {tiny_model_dir}\nreward: ['{reward_file}:sevens']\n"
                      "max_steps: 5\n")
    result = posttrain.train(config, **{**QUICK, "max_steps": 1}, output=str(tmp_path / "run"))
    saved = load_yaml(result["run_dir"] / "config.yaml")
    assert (saved["algorithm"], saved["max_steps"], saved["task"]) == ("dr_grpo", 1, "addition")


def test_preference_rows_from_python(tmp_path, tiny_model_dir):
    pairs = [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)} for a, b in
             [(1, 2), (3, 4), (5, 6), (7, 8)]]
    result = posttrain.train(model=str(tiny_model_dir), algorithm="dpo", train_dataset=pairs, eval_dataset=pairs,
                             max_steps=2, pairs_per_step=2, eval_size=4, report_to="none", progress=False,
                             output=str(tmp_path / "run"))
    # the 4 Python pairs were scored against the reference: before training, the policy is the reference,
    # so every pair's implicit reward margin is 0: all ties, counted half
    before = result["before"]
    assert (before["eval/pairwise_accuracy"], before["eval/reward_margin"]) == (0.5, 0.0)
    assert (result["run_dir"] / "inputs" / "eval.jsonl").exists()
    with pytest.raises(ConfigError, match="reward_funcs: preference presets learn from chosen/rejected pairs"):
        posttrain.train(model=str(tiny_model_dir), algorithm="dpo", train_dataset=pairs, reward_funcs=lambda *a, **k: [],
                        output=str(tmp_path / "other"), report_to="none", progress=False)


def test_bad_input_is_named(tmp_path, tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(ConfigError, match="tokenizer: a model object needs its tokenizer"):
        posttrain.train(model=model, train_dataset=PROMPTS, reward_funcs=lambda p, c, **k: [0.0] * len(c),
                        output=str(tmp_path / "a"), **QUICK)
    with pytest.raises(ConfigError, match="train_dataset: row 2 is a str, not a mapping"):
        posttrain.train(model=str(tiny_model_dir), train_dataset=[PROMPTS[0], "3+4="], output=str(tmp_path / "b"),
                        reward_funcs=lambda p, c, **k: [0.0] * len(c), **QUICK)
    with pytest.raises(ConfigError, match="reward_weights: 2 weight\\(s\\) for 1 reward function"):
        posttrain.train(model=str(tiny_model_dir), train_dataset=PROMPTS, reward_funcs=lambda p, c, **k: [0.0] * len(c),
                        reward_weights=[1.0, 2.0], output=str(tmp_path / "c"), **QUICK)
    with pytest.raises(ConfigError, match="unknown config field 'num_generation'"):
        posttrain.train(model=str(tiny_model_dir), num_generation=4, output=str(tmp_path / "d"))


def test_evaluate_returns_what_posttrain_eval_prints(tiny_model_dir, reward_file, tmp_path, capsys):
    from posttrain.cli import main
    from posttrain.tracking.stats import wilson_interval

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(row) + "\n" for row in PROMPTS))
    output = tmp_path / "eval.json"
    assert main(["eval", "--model", str(tiny_model_dir), "--task", "addition", "--dataset", str(rows),
                 "--reward", f"{reward_file}:sevens", "--reward", "numeric_match", "--eval-size", "5",
                 "--samples", "3", "--seed", "1", "--max-new-tokens", "8", "--output", str(output)]) == 0
    printed = capsys.readouterr().out
    evaluation = posttrain.evaluate(tiny_model_dir, tasks="addition", dataset=rows,
                                    reward=[f"{reward_file}:sevens", "numeric_match"], eval_size=5, samples=3, seed=1,
                                    max_new_tokens=8)
    assert str(evaluation) in printed and "pass@3" in str(evaluation)
    assert evaluation.to_dict() == json.loads(output.read_text())  # --output's numbers, all of them
    addition = evaluation["addition"]
    assert (addition.problems, len(addition.greedy)) == (5, 5)
    assert addition.metrics["accuracy"] == addition.correct / 5
    assert (addition.metrics["accuracy_low"], addition.metrics["accuracy_high"]) == wilson_interval(addition.correct, 5)
    assert {"pass@1", "pass@3", "maj@3"} <= set(addition.metrics)
    # the dataset's rows are its own problems: the first eval_size of them, scored by the rewards given
    assert evaluation[str(rows)].problems == 5
    with pytest.raises(KeyError, match="'gsm' was not evaluated"):
        evaluation["gsm"]


def test_evaluate_names_a_bad_setting_and_an_unnamed_reward(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="eval_sizes: not a setting of posttrain.evaluate; its settings: "
                                          "reward_weights, eval_size, samples"):
        posttrain.evaluate(tiny_model_dir, eval_sizes=5)
    with pytest.raises(ConfigError, match="reward: posttrain.evaluate takes rewards by name"):
        posttrain.evaluate(tiny_model_dir, dataset=tmp_path, reward=lambda p, c, **k: [0.0] * len(c))
