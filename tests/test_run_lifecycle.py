"""A run's life as a user drives it: extended with --resume, stopped by max_minutes, resumed from
another directory, and the errors of a resume that cannot work."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from posttrain.training.checkpoint import latest_checkpoint
from posttrain.cli import main
from posttrain.config import Config
from posttrain.data.prompts import DataError
from posttrain.tracking.metrics import read_metrics
from posttrain.tracking.stats import wilson_interval
from posttrain.training.online import train_step
from posttrain.training.runner import run_training
from posttrain.training.session import OnlineSession, evaluate

from test_online import make_config


def _train(config: Config, step_fn=train_step) -> dict:
    return run_training(OnlineSession.create(config), config, step_fn, evaluate)


def test_extending_a_run_with_resume_continues_its_schedule_and_loses_no_step(tiny_model_dir, reward_file, tmp_path):
    """Four linear-schedule steps, then --resume --max-steps 6: steps 5 and 6 follow the 6-step schedule.
    Loading the saved scheduler used to restore the 4-step schedule's last rate, 0: step 5 changed nothing."""
    run = tmp_path / "run"
    common = dict(lr_schedule="linear", learning_rate=1e-3, eval_every=0, save_every=1, log_samples_every=0,
                  output=str(run))
    _train(make_config(tiny_model_dir, reward_file, max_steps=4, **common))
    changed = []

    def step_and_compare(session):
        before = [p.detach().clone() for p in session.policy.parameters()]
        metrics = train_step(session)
        changed.append(any(not torch.equal(a, p) for a, p in zip(before, session.policy.parameters())))
        return metrics

    _train(make_config(tiny_model_dir, reward_file, max_steps=6, resume=str(run), **common), step_and_compare)
    lrs = {row["step"]: row["lr"] for row in read_metrics(run) if "lr" in row}
    assert lrs[4] == pytest.approx(1e-3 * 0.25)  # the first run's last step: 1 - 3/4
    assert [lrs[5], lrs[6]] == pytest.approx([1e-3 * (1 - 4 / 6), 1e-3 * (1 - 5 / 6)])
    assert changed == [True, True]


def test_a_resumed_run_takes_a_new_learning_rate(tiny_model_dir, reward_file, tmp_path):
    run = tmp_path / "run"
    common = dict(lr_schedule="constant", eval_every=0, save_every=1, log_samples_every=0, output=str(run))
    _train(make_config(tiny_model_dir, reward_file, max_steps=1, learning_rate=1e-3, **common))
    _train(make_config(tiny_model_dir, reward_file, max_steps=2, learning_rate=5e-4, resume=str(run), **common))
    assert [row["lr"] for row in read_metrics(run) if "lr" in row] == pytest.approx([1e-3, 5e-4])


def test_a_run_stopped_by_max_minutes_logs_its_result_and_resumes(tiny_model_dir, reward_file, tmp_path):
    """It printed its final accuracy but logged only step 0's, and saved no checkpoint to resume from."""
    run = tmp_path / "run"
    config = make_config(tiny_model_dir, reward_file, max_steps=5, max_minutes=0.001, eval_every=0,
                         save_every=0, log_samples_every=0, output=str(run))

    def slow_step(session):
        time.sleep(0.1)  # past max_minutes (60 ms) after one step
        return train_step(session)

    result = _train(config, slow_step)
    rows = read_metrics(run)
    evaluations = [row for row in rows if "eval/accuracy" in row]
    assert [row["step"] for row in evaluations] == [0, 1]
    assert evaluations[-1]["eval/accuracy"] == result["after"]["eval/accuracy"]
    assert latest_checkpoint(run).name == "step_000001"
    resumed = Config.from_flat({**config.to_flat(), "max_minutes": 0.0, "resume": str(run)})
    _train(resumed)
    assert [row["step"] for row in read_metrics(run) if "eval/accuracy" in row] == [0, 1, 5]


def test_resuming_a_finished_run_with_fewer_steps_trains_nothing_and_leaves_it_as_it_was(tiny_model_dir, reward_file,
                                                                                          tmp_path, capsys):
    run = tmp_path / "run"
    _train(make_config(tiny_model_dir, reward_file, max_steps=2, eval_every=0, save_every=1, output=str(run)))
    saved, logged = (run / "config.yaml").read_text(), (run / "metrics.jsonl").read_text()
    shorter = make_config(tiny_model_dir, reward_file, max_steps=1, eval_every=0, resume=str(run))
    assert _train(shorter)["complete"]
    assert "complete: step 2 of max_steps 1" in capsys.readouterr().err
    assert (run / "config.yaml").read_text() == saved and (run / "metrics.jsonl").read_text() == logged


@pytest.mark.parametrize("make, message", [
    (lambda tmp: "notarun", "resume: run directory 'notarun' does not exist"),
    (lambda tmp: str(tmp), "is not a run directory (it has no config.yaml)"),
])
def test_resume_of_something_that_is_not_a_run_names_resume(make, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--resume", make(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "config:" not in err


def test_a_run_with_relative_paths_resumes_from_another_directory(tiny_model_dir, reward_file, tmp_path, monkeypatch):
    """config.yaml kept the paths as typed, so a resume from elsewhere failed ("dataset: file
    'prompts.jsonl' does not exist")."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+{i}="}) + "\n" for i in range(8)))
    (work / "rewards.py").write_text(reward_file.read_text())
    monkeypatch.chdir(work)
    flat = dict(model=os.path.relpath(tiny_model_dir, work), dataset="prompts.jsonl", reward=["rewards.py:sevens"],
                prompts_per_step=2, group_size=2, max_new_tokens=4, eval_size=0, max_steps=1, progress=False,
                report_to="none", save_every=1, log_samples_every=0, output="run")
    _train(Config.from_flat(flat))
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--resume", "work/run", "--max-steps", "2", "--no-progress"]) == 0
    assert latest_checkpoint(work / "run").name == "step_000002"


def test_chat_prompts_with_a_tokenizer_without_a_chat_template_name_the_row(tiny_model_dir, reward_file, tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{i}+1="}]}) + "\n" for i in range(4)))
    config = make_config(tiny_model_dir, reward_file, dataset=str(data), eval_size=0, output=str(tmp_path / "run"))
    with pytest.raises(DataError, match="training prompts: row 1: the prompt is a list of chat messages, but the "
                                        "model's tokenizer has no chat template"):
        OnlineSession.create(config)


@pytest.mark.parametrize("saved, report_to, project", [
    ({"tensorboard": True, "wandb_project": None}, ("tensorboard",), "posttrain"),
    ({"tensorboard": False, "wandb_project": "mine"}, ("wandb",), "mine"),
    ({"tensorboard": False, "wandb_project": None}, ("none",), "posttrain"),
])
def test_a_run_saved_before_report_to_resumes_with_its_trackers(saved, report_to, project, tmp_path):
    import yaml

    from posttrain.cli import build_parser, resolve_config

    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"algorithm": "grpo", "max_steps": 4, **saved}))
    config = resolve_config(build_parser().parse_args(["train", "--resume", str(tmp_path), "--max-steps", "6"]))
    assert (config.run.report_to, config.run.project, config.run.max_steps) == (report_to, project, 6)


def test_evaluations_during_training_score_the_subset_and_the_last_one_every_prompt(tiny_model_dir, reward_file,
                                                                                     tmp_path):
    """eval_subset 3 of eval_size 8: steps 0 and 3 (the last) score 8 prompts, steps 1 and 2 score 3."""
    scored = []

    def counting_evaluate(session, limit=None):
        metrics = evaluate(session, limit)
        scored.append(len(session.work.test_rows[:limit]))
        return metrics

    config = make_config(tiny_model_dir, reward_file, max_steps=3, eval_every=1, eval_size=8, eval_subset=3,
                         save_every=0, log_samples_every=0, output=str(tmp_path / "run"))
    run_training(OnlineSession.create(config), config, train_step, counting_evaluate)
    assert scored == [8, 3, 3, 8]
    rows = [row for row in read_metrics(tmp_path / "run") if "eval/accuracy" in row]
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    # each interval is Wilson's over the prompts that evaluation scored: 3 for the subset, 8 for the full
    for row, n in zip(rows, scored, strict=True):
        right = round(row["eval/accuracy"] * n)
        assert row["eval/accuracy"] == pytest.approx(right / n)
        assert (row["eval/accuracy_low"], row["eval/accuracy_high"]) == pytest.approx(wilson_interval(right, n))


def test_eval_tasks_score_other_tasks_at_every_evaluation(tiny_model_dir, reward_file, tmp_path):
    """An eval_tasks entry is scored with the run's policy on its own held-out rows and check: the same
    task as the run's gives the run's own greedy accuracy, under eval/LABEL/."""
    config = make_config(tiny_model_dir, reward_file, max_steps=2, eval_every=1, eval_size=6,
                         eval_tasks=["addition"], save_every=0, log_samples_every=0, output=str(tmp_path / "run"))
    session = OnlineSession.create(config)
    assert list(session.eval_workloads) == ["addition"]
    run_training(session, config, train_step, evaluate)
    rows = [row for row in read_metrics(tmp_path / "run") if "eval/accuracy" in row]
    assert len(rows) == 3
    for row in rows:
        assert row["eval/addition/accuracy"] == row["eval/accuracy"]
        assert row["eval/addition/completion_length"] == row["eval/completion_length"]
        assert (row["eval/addition/accuracy_low"], row["eval/addition/accuracy_high"]) == (
            row["eval/accuracy_low"], row["eval/accuracy_high"])


def test_eval_tasks_errors_name_the_field(tiny_model_dir, reward_file):
    from posttrain.config import ConfigError
    from posttrain.training.workload import eval_label

    assert eval_label("reasoning-gym:chain_sum(max_terms=3)=2,products") == "chain_sum+products"
    with pytest.raises(ConfigError, match="eval_tasks: two entries are both labelled 'addition'"):
        OnlineSession.create(make_config(tiny_model_dir, reward_file, eval_tasks=["addition", "addition"]))
    with pytest.raises(ConfigError, match="unknown task"):
        OnlineSession.create(make_config(tiny_model_dir, reward_file, eval_tasks=["additon"]))


def test_a_run_stopped_by_max_minutes_after_a_subset_evaluation_ends_with_a_full_one(tiny_model_dir, reward_file,
                                                                                      tmp_path, monkeypatch):
    """max_minutes 1 with a clock that moves 40 s per reading: step 1 (a subset evaluation) runs, then the
    time is up, and the run's result scores every held-out prompt."""
    import itertools

    scored = []

    def counting_evaluate(session, limit=None):
        scored.append(len(session.work.test_rows[:limit]))
        return evaluate(session, limit)

    clock = itertools.count(step=40.0)
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    config = make_config(tiny_model_dir, reward_file, max_steps=5, eval_every=1, eval_size=8, eval_subset=3,
                         max_minutes=1, save_every=0, log_samples_every=0, output=str(tmp_path / "run"))
    run_training(OnlineSession.create(config), config, train_step, counting_evaluate)
    assert scored[0] == 8 and scored[-1] == 8 and 3 in scored[1:-1]
