"""Failures lose nothing and explain themselves: bad rewards, NaN losses, kills, bad configs, bad data."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from posttrain.training.checkpoint import latest_checkpoint
from posttrain.config import Config, ConfigError
from posttrain.data.prompts import DataError, read_rows
from posttrain.tracking.metrics import read_metrics
from posttrain.training.online import train_step
from posttrain.training.runner import run_training
from posttrain.data.scoring import RewardError
from posttrain.training.session import OnlineSession, evaluate

from test_online import make_config

FAILING_REWARDS = '''
def fails_on_sevens(prompts, completions, **columns):
    if any("7" in c for c in completions):
        raise ValueError("cannot score a 7")
    return [float(len(c)) for c in completions]
'''


@pytest.fixture()
def failing_reward_file(tmp_path):
    path = tmp_path / "failing.py"
    path.write_text(FAILING_REWARDS)
    return path


def test_reward_that_raises_stops_the_run_with_the_sample(tiny_model_dir, failing_reward_file):
    s = OnlineSession.create(make_config(tiny_model_dir, failing_reward_file, reward="fails_on_sevens"))
    with pytest.raises(RewardError, match=r"(?s)failed on sample \d+.*completion: '.*7.*ValueError: cannot score a 7"):
        train_step(s)


def test_skip_policy_drops_the_groups_of_failed_samples_and_counts_them(tiny_model_dir, failing_reward_file):
    config = make_config(tiny_model_dir, failing_reward_file, reward="fails_on_sevens", reward_errors="skip",
                         prompts_per_step=8)
    s = OnlineSession.create(config)
    metrics = train_step(s)
    failures = metrics["reward_failures/fails_on_sevens"]
    assert failures > 0
    assert metrics["groups_trained"] < 8
    assert not any("7" in text for text in s.last_groups.texts)


def test_non_finite_loss_skips_the_step_and_stops_after_max_bad_steps(tiny_model_dir, reward_file):
    s = OnlineSession.create(make_config(tiny_model_dir, reward_file, max_bad_steps=2))
    before = [p.detach().clone() for p in s.policy.parameters()]
    assert train_step(s)["skipped_steps"] == 0  # one good step
    good = [p.detach().clone() for p in s.policy.parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(before, good))

    from posttrain.training import online

    real_forward = online.forward

    def nan_forward(model, batch, **kw):  # the training forward's log-probs (not generation) become NaN
        out = real_forward(model, batch, **kw)
        out.logprobs = out.logprobs * float("nan")
        return out

    online.forward = nan_forward
    try:
        metrics = train_step(s)
        assert metrics["skipped_steps"] == 1
        assert all(torch.equal(a, b) for a, b in zip(good, s.policy.parameters()))  # nothing applied
        with pytest.raises(FloatingPointError, match="2 consecutive optimizer steps"):
            train_step(s)
    finally:
        online.forward = real_forward


KILLER = textwrap.dedent('''
    import os, signal, sys
    from posttrain.config import Config, load_yaml
    from posttrain.training import checkpoint, online
    from posttrain.training.runner import run_training
    from posttrain.training.session import OnlineSession, evaluate

    flat, kill = load_yaml(sys.argv[1]), sys.argv[2]
    config = Config.from_flat(flat)
    if kill.startswith("train:"):  # die in the middle of training step N (after its update)
        at, real = int(kill[6:]), online.train_step
        def train_step(s):
            metrics = real(s)
            if s.step + 1 == at:
                os.kill(os.getpid(), signal.SIGKILL)
            return metrics
    else:  # die while the checkpoint of step N is being written (files there, manifest not yet)
        at, real_manifest, train_step = int(kill[5:]), checkpoint._write_manifest, online.train_step
        def manifest(directory):
            if directory.name.startswith(f".tmp-step_{at:06d}"):
                os.kill(os.getpid(), signal.SIGKILL)
            real_manifest(directory)
        checkpoint._write_manifest = manifest
    run_training(OnlineSession.create(config), config, train_step, evaluate)
''')


@pytest.mark.parametrize("kill", ["train:3", "save:4"])
def test_killed_run_resumes_to_the_same_final_weights(kill, tiny_model_dir, reward_file, tmp_path):
    common = dict(max_steps=6, eval_every=0, save_every=2, log_samples_every=0)
    whole = make_config(tiny_model_dir, reward_file, "grpo", output=str(tmp_path / "whole"), **common)
    run_training(OnlineSession.create(whole), whole, train_step, evaluate)

    killed = make_config(tiny_model_dir, reward_file, "grpo", output=str(tmp_path / "killed"), **common)
    (tmp_path / "killed.yaml").write_text(json.dumps(killed.to_flat()))
    script = tmp_path / "killer.py"
    script.write_text(KILLER)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    result = subprocess.run([sys.executable, str(script), str(tmp_path / "killed.yaml"), kill],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
    assert latest_checkpoint(tmp_path / "killed").name == "step_000002"

    resumed = Config.from_flat({**killed.to_flat(), "resume": str(tmp_path / "killed")})
    run_training(OnlineSession.create(resumed), resumed, train_step, evaluate)
    a = load_file(tmp_path / "whole" / "final_model" / "model.safetensors")
    b = load_file(tmp_path / "killed" / "final_model" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["step"] for r in read_metrics(tmp_path / "killed")] == list(range(7))


def test_resume_with_another_preset_is_a_clear_error(tiny_model_dir, reward_file, tmp_path):
    from posttrain.training.checkpoint import CheckpointError

    first = make_config(tiny_model_dir, reward_file, "grpo", output=str(tmp_path / "run"), max_steps=1,
                        eval_every=0)
    run_training(OnlineSession.create(first), first, train_step, evaluate)
    other = Config.from_flat({**first.to_flat(), "algorithm": "dr_grpo", "beta": 0.0, "kl_estimator": None,
                              "resume": str(tmp_path / "run"), "max_steps": 2})
    with pytest.raises(CheckpointError, match="algorithm grpo.*dr_grpo"):
        run_training(OnlineSession.create(other), other, train_step, evaluate)


@pytest.mark.parametrize("flat, field", [
    ({"prompts_per_step": 0}, "prompts_per_step"),
    ({"group_size": 0}, "group_size"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"temperature": 0.0}, "temperature"),
    ({"learning_rate": -1.0}, "learning_rate"),
    ({"micro_batch_size": 0}, "micro_batch_size"),
    ({"dataset": "no/such/file.jsonl"}, "dataset"),
    ({"reward": ["no/such/file.py:fn"]}, "reward"),
    ({"reward": ["rewards.py"]}, "reward"),
    ({"resume": "no/such/run"}, "resume"),
    ({"dtype": "float16"}, "dtype"),
    ({"reward_errors": "ignore"}, "reward_errors"),
    ({"learning_rat": 1e-4}, "learning_rat"),
])
def test_bad_config_values_name_their_field(flat, field):
    with pytest.raises(ConfigError, match=field):
        Config.from_flat(flat)


def test_group_estimators_need_two_samples_before_any_model_loads(reward_file):
    with pytest.raises(ConfigError, match="group_size >= 2"):
        OnlineSession.create(make_config("not/a/model", reward_file, "rloo", group_size=1))


def test_dapo_binary_reward_on_a_dataset_without_correctness_says_what_to_change(tmp_path, reward_file):
    """The preset's own binary_reward is dropped on a dataset run (decision 6); one the user gives is refused."""
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1="}\n' * 8)
    config = make_config("not/a/model", reward_file, "dapo", task=None, dataset=str(data), binary_reward=(-1.0, 1.0))
    with pytest.raises(ConfigError, match="binary_reward.*--binary-reward none"):
        OnlineSession.create(config)


@pytest.mark.parametrize("content, message", [
    (b'{"prompt": "1+1="}\n{"prompt": \n', r"prompts.jsonl:2: malformed JSON"),
    (b'{"prompt": "1+1="}\n{"prompt": "\xff\xfe"}\n', r"prompts.jsonl:2: line is not valid UTF-8"),
    (b'{"prompt": "1+1="}\n[1, 2]\n', r"prompts.jsonl:2: expected a JSON object"),
])
def test_bad_jsonl_lines_name_the_line(tmp_path, content, message):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError, match=message):
        read_rows(str(path))


@pytest.mark.parametrize("rows, message", [
    ('{"prompt": "1+1="}\n{"question": "2+2="}\n', "row 2 has no 'prompt' column"),
    ('{"prompt": "1+1="}\n{"prompt": "  "}\n', "row 2 has an empty prompt"),
])
def test_bad_rows_name_the_row(tmp_path, reward_file, rows, message):
    data = tmp_path / "prompts.jsonl"
    data.write_text(rows)
    config = make_config("not/a/model", reward_file, "grpo", task=None, dataset=str(data), prompts_per_step=1)
    with pytest.raises(DataError, match=message):
        OnlineSession.create(config)


def _prompts_file(tmp_path, prompts) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return str(path)


def test_prompts_over_max_prompt_length_are_an_error_naming_the_first(tiny_model_dir, reward_file, tmp_path):
    """The tiny tokenizer is one token per character, plus <bos>: "1+1=" is 5 tokens, "12+34=" 7."""
    data = _prompts_file(tmp_path, ["1+1=", "12+34=", "2+2=", "99+99="])
    config = make_config(tiny_model_dir, reward_file, task=None, dataset=data, prompts_per_step=2, max_prompt_length=6)
    with pytest.raises(DataError, match=rf"{data}: 2 of 4 prompts are longer than max_prompt_length 6 tokens "
                                        r"\(the first: row 2, 7 tokens\); raise max_prompt_length, shorten them, "
                                        r"or set long_prompts drop"):
        OnlineSession.create(config)


def test_long_prompts_drop_leaves_them_out_and_counts_them(tiny_model_dir, reward_file, tmp_path, capsys):
    data = _prompts_file(tmp_path, ["1+1=", "12+34=", "2+2=", "99+99="])
    config = make_config(tiny_model_dir, reward_file, task=None, dataset=data, prompts_per_step=2,
                         max_prompt_length=6, long_prompts="drop")
    s = OnlineSession.create(config)
    assert [row["prompt"] for row in s.train_rows] == ["1+1=", "2+2="]
    assert [len(ids) for ids in s.encoded_prompts] == [5, 5]
    assert "dropped 2 of 4 prompts longer than max_prompt_length 6 tokens" in capsys.readouterr().err
    train_step(s)  # trains on what is left


@pytest.mark.parametrize("limit, per_step, message", [
    (4, 1, r"4 of 4 prompts are longer .*; no prompt is left; raise max_prompt_length, shorten them$"),
    (6, 3, r"2 prompts are left within max_prompt_length, fewer than prompts_per_step 3"),
])
def test_dropping_long_prompts_must_leave_a_step(limit, per_step, message, tiny_model_dir, reward_file, tmp_path):
    data = _prompts_file(tmp_path, ["1+1=", "12+34=", "2+2=", "99+99="])
    config = make_config(tiny_model_dir, reward_file, task=None, dataset=data, prompts_per_step=per_step,
                         max_prompt_length=limit, long_prompts="drop")
    with pytest.raises(DataError, match=message):
        OnlineSession.create(config)


def test_a_tokenizer_without_a_pad_token_trains_online_and_offline(tiny_model_dir, reward_file, tmp_path):
    """Llama's and Qwen's base tokenizers have no pad token: padding then uses EOS (masked out everywhere)."""
    import shutil

    from posttrain.training.preference import PreferenceSession
    from posttrain.training.preference import train_step as preference_step

    model = tmp_path / "no-pad"
    shutil.copytree(tiny_model_dir, model)
    settings = json.loads((model / "tokenizer_config.json").read_text())
    settings.pop("pad_token", None)
    (model / "tokenizer_config.json").write_text(json.dumps(settings))
    s = OnlineSession.create(make_config(model, reward_file))
    assert s.tokenizer.pad_token_id == s.tokenizer.eos_token_id
    assert math.isfinite(train_step(s)["loss"])
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "chosen": str(2 * i), "rejected": str(2 * i + 1)})
                             + "\n" for i in range(4)))
    config = Config.from_flat({"algorithm": "dpo", "model": str(model), "dataset": str(pairs), "pairs_per_step": 2,
                               "max_steps": 1, "eval_size": 0, "progress": False, "report_to": "none"})
    p = PreferenceSession.create(config)
    assert math.isfinite(preference_step(p)["loss"])
