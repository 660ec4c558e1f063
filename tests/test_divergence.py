"""The reward-hacking guard: the proxy (held-out reward) rising while the check (held-out accuracy) falls
beyond its noise, evaluation after evaluation, is reported, and can stop the run with the best model kept."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from test_online import make_config

from posttrain.config import Config, ConfigError
from posttrain.tracking.metrics import read_metrics
from posttrain.training.guards import DivergenceWatch
from posttrain.training.online import train_step
from posttrain.training.runner import run_training
from posttrain.training.session import OnlineSession


def _eval(accuracy: float, reward: float, half_width: float = 0.05) -> dict[str, float]:
    return {"eval/accuracy": accuracy, "eval/accuracy_low": accuracy - half_width,
            "eval/accuracy_high": accuracy + half_width, "eval/reward": reward}


def test_the_streak_counts_evaluations_with_the_check_down_beyond_noise_and_the_proxy_climbing():
    watch = DivergenceWatch("eval/accuracy", limit=2)
    seen = [watch.update(step, _eval(acc, reward)) for step, acc, reward in [
        (0, 0.80, 1.0),   # the first best: the model the run started from
        (10, 0.85, 1.1),  # a new best: kept
        (20, 0.50, 1.3),  # down (upper end 0.55 < 0.85) while the proxy is above its low since the best: 1
        (30, 0.82, 1.5),  # 0.87 reaches 0.85: within noise, the streak ends
        (40, 0.30, 1.6),  # 1
        (50, 0.20, 1.7),  # 2: fires
        (60, 0.10, 1.8),  # 3: fired already in this episode
        (70, 0.10, 1.0),  # the proxy at a new low: falling with the check, a collapse rather than hacking
    ]]
    assert [(d.streak, d.fired, d.new_best) for d in seen] == [
        (0, False, False), (0, False, True), (1, False, False), (0, False, False),
        (1, False, False), (2, True, False), (3, False, False), (0, False, False)]
    assert watch.best == {"step": 10, "check": 0.85, "proxy": 1.1, "check_low": 0.10, "proxy_low": 1.0}
    assert watch.update(80, {"eval/reward": 1.0}) is None  # no check logged: nothing to compare


def test_a_check_that_climbs_back_with_the_proxy_is_learning_not_hacking():
    """The RLHF pipeline's GRPO with partial credit: both fall at the first evaluation, then climb together."""
    watch = DivergenceWatch("eval/accuracy", limit=1)
    watch.update(0, _eval(0.88, 1.35))
    assert watch.update(5, _eval(0.60, 1.00)).streak == 0  # both fell: a collapse, not hacking
    assert watch.update(10, _eval(0.68, 1.06)).streak == 0  # 0.63 > 0.60: the check climbs with the proxy
    assert watch.update(15, _eval(0.64, 1.10)).streak == 1  # 0.59: back within the noise of its low


def test_a_check_without_an_interval_counts_any_fall():
    watch = DivergenceWatch("eval/reward/truth", limit=1)
    watch.update(0, {"eval/reward/truth": 0.5, "eval/reward": 0.0})
    assert watch.update(5, {"eval/reward/truth": 0.49, "eval/reward": 0.1}).fired


SCRIPT = {0: (0.80, 1.0), 2: (0.90, 1.1), 4: (0.30, 1.5), 6: (0.20, 1.8), 8: (0.1, 2.0), 10: (0.1, 2.1)}


def scripted(session, limit=None) -> dict[str, float]:
    """A held-out evaluation whose numbers follow SCRIPT: accuracy peaks at step 2, then the proxy climbs."""
    return _eval(*SCRIPT[session.step])


def _config(tiny_model_dir, reward_file, run, **flat) -> Config:
    return make_config(tiny_model_dir, reward_file, **{"max_steps": 10, "eval_every": 2, "save_every": 2,
                                                      "log_samples_every": 0, "output": str(run), **flat})


def test_the_guard_warns_stops_and_keeps_the_best_model(tiny_model_dir, reward_file, tmp_path, capsys):
    run = tmp_path / "run"
    weights_at = {}

    def step(session):
        metrics = train_step(session)
        weights_at[session.step + 1] = {k: v.clone() for k, v in session.policy.state_dict().items()}
        return metrics

    config = _config(tiny_model_dir, reward_file, run, stop_on_divergence=True)
    result = run_training(OnlineSession.create(config), config, step, scripted)
    err = capsys.readouterr().err
    assert ("possible reward hacking: eval/reward rose to 1.8 from its low of 1.1 while eval/accuracy fell from 0.9 "
            "(step 2) to 0.2 (step 6), 2 evaluations in a row") in err
    assert f"stopping at step 6: stop_on_divergence; the best model by eval/accuracy is in {run / 'best_model'}" in err
    rows = {row["step"]: row for row in read_metrics(run)}
    assert [rows[s]["eval/divergence_streak"] for s in (0, 2, 4, 6)] == [0, 0, 1, 2]
    assert rows[6]["eval/diverged"] == 1.0 and "eval/diverged" not in rows[4]
    assert max(rows) == 6 and result["after"]["eval/accuracy"] == 0.2
    best = load_file(run / "best_model" / "model.safetensors")
    assert all(torch.equal(best[k], weights_at[2][k]) for k in best)
    saved = json.loads((run / "checkpoints" / "step_000006" / "trainer_state.json").read_text())["divergence"]
    assert saved == {"check": "eval/accuracy", "streak": 2,
                     "best": {"step": 2, "check": 0.9, "proxy": 1.1, "check_low": 0.2, "proxy_low": 1.1}}
    from posttrain.report.html import build_report

    assert "reward hacking suspected at step 6" in build_report([run], tmp_path / "report").read_text()


def test_a_resumed_run_keeps_the_guards_streak(tiny_model_dir, reward_file, tmp_path, capsys):
    run = tmp_path / "run"
    first = _config(tiny_model_dir, reward_file, run, max_steps=4)
    run_training(OnlineSession.create(first), first, train_step, scripted)
    assert "possible reward hacking" not in capsys.readouterr().err  # one evaluation down so far
    resumed = Config.from_flat({**first.to_flat(), "max_steps": 10, "resume": str(run)})
    run_training(OnlineSession.create(resumed), resumed, train_step, scripted)
    err = capsys.readouterr().err
    assert "fell from 0.9 (step 2) to 0.2 (step 6), 2 evaluations in a row" in err
    assert "(stop_on_divergence stops the run here)" in err  # warned, went on to max_steps
    assert max(row["step"] for row in read_metrics(run)) == 10


def test_a_reward_that_is_the_tasks_check_has_no_guard(tiny_model_dir, reward_file, tmp_path):
    """The addition task's own reward is its answer check: held-out reward equals held-out accuracy."""
    run = tmp_path / "run"
    config = make_config(tiny_model_dir, reward_file, max_steps=1, eval_every=1, output=str(run))
    config = Config.from_flat({**config.to_flat(), "reward": []})
    run_training(OnlineSession.create(config), config, train_step, lambda s, limit=None: _eval(0.5, 0.5))
    assert not any("eval/divergence_streak" in row for row in read_metrics(run))
    state = json.loads((run / "checkpoints" / "step_000001" / "trainer_state.json").read_text())
    assert "divergence" not in state


def test_a_named_check_must_be_logged(tiny_model_dir, reward_file, tmp_path):
    config = _config(tiny_model_dir, reward_file, tmp_path / "run", divergence_check="truth")
    with pytest.raises(ConfigError, match=r"divergence_check: eval/reward/truth is not logged at the evaluations "
                                          r"\(they log eval/accuracy, eval/reward\)"):
        run_training(OnlineSession.create(config), config, train_step, scripted)


def test_a_reward_function_named_as_the_check_is_evaluated_on_its_own(tiny_model_dir, reward_file, tmp_path):
    from posttrain.training.session import evaluate

    flat = make_config(tiny_model_dir, reward_file, divergence_check="starts_even").to_flat()
    config = Config.from_flat({**flat, "reward": [f"{reward_file}:sevens", f"{reward_file}:starts_even"],
                               "reward_weights": [1.0, 0.0]})
    metrics = evaluate(OnlineSession.create(config))
    assert "eval/reward/starts_even" in metrics and 0.0 <= metrics["eval/reward/starts_even"] <= 1.0
