"""The guards that make silent failures loud: no reward variance, weights that do not move, rewards
that say nothing."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.training import guards
from posttrain.training.guards import (
    NoLearningSignal, RewardWatch, SignalWatch, UpdateCheck, WeightsNotUpdated, step_has_signal,
)
from posttrain.tracking.metrics import read_metrics
from posttrain.training.online import train_step
from posttrain.training.optim import build_optimizer
from posttrain.training.runner import run_training
from posttrain.training.session import OnlineSession, evaluate

from test_online import make_config


@pytest.mark.parametrize("rewards, expected", [
    ([[1.0, 1.0], [0.0, 0.0]], False),  # two groups, each all equal: no advantage anywhere
    ([[1.0, 0.0], [0.0, 0.0]], True),
    ([[1.0], [0.0]], True),  # G = 1: the batch is the comparison
    ([[1.0], [1.0]], False),
    ([[]], False),
])
def test_step_has_signal_by_hand(rewards, expected):
    assert step_has_signal(torch.tensor(rewards)) is expected


def test_signal_watch_counts_the_streak_warns_once_and_stops_at_the_limit(capsys, monkeypatch):
    monkeypatch.setattr(guards, "WARN_AFTER", 2)
    watch = SignalWatch(limit=4)
    assert [watch.update(s) for s in (False, True, False, False, False)] == [1, 0, 1, 2, 3]
    assert capsys.readouterr().err.count("warning: every group's rewards were all equal, or the trained batch had no nonzero advantage, "
                                        "for 2 steps") == 1
    with pytest.raises(NoLearningSignal, match="for 4 steps in a row \\(training accuracy 0.000\\).*group_size"):
        watch.update(False, accuracy=0.0)
    assert SignalWatch(limit=0).update(False) == 1  # 0: never stops


def test_a_run_whose_rewards_never_vary_stops_with_advice(tiny_model_dir, reward_file, tmp_path):
    """A constant reward ('ones'): every group has zero variance, so no step can learn anything."""
    config = make_config(tiny_model_dir, reward_file, reward="ones", max_steps=10, max_no_signal_steps=3,
                         eval_every=0, output=str(tmp_path / "run"))
    with pytest.raises(NoLearningSignal, match="all equal, or .* for 3 steps in a row"):
        run_training(OnlineSession.create(config), config, train_step, evaluate)
    assert [row["no_signal_steps"] for row in read_metrics(tmp_path / "run") if "no_signal_steps" in row] == [1, 2]


def test_a_run_whose_selection_leaves_nothing_to_train_on_stops(tiny_model_dir, reward_file, tmp_path):
    """Best-of-N with a min_reward no sample reaches: the rewards vary, but every group is dropped, so
    the step trains on nothing (as a selection bug once did for 250 silent steps)."""
    config = make_config(tiny_model_dir, reward_file, algorithm="best_of_n", min_reward=10.0, max_steps=10,
                         max_no_signal_steps=3, eval_every=0, output=str(tmp_path / "run"))
    with pytest.raises(NoLearningSignal, match="for 3 steps in a row"):
        run_training(OnlineSession.create(config), config, train_step, evaluate)
    rows = [row for row in read_metrics(tmp_path / "run") if "no_signal_steps" in row]
    assert [row["no_signal_steps"] for row in rows] == [1, 2]
    assert all(row["advantage/nonzero"] == 0.0 and row["zero_variance_groups"] < 1 for row in rows)


def test_a_run_with_signal_logs_no_streak(tiny_model_dir, reward_file, tmp_path):
    config = make_config(tiny_model_dir, reward_file, max_steps=2, eval_every=0, output=str(tmp_path / "run"))
    run_training(OnlineSession.create(config), config, train_step, evaluate)
    assert [row["no_signal_steps"] for row in read_metrics(tmp_path / "run") if "no_signal_steps" in row] == [0, 0]


def test_lora_adapters_the_optimizer_does_not_hold_are_an_error(tiny_model_dir, reward_file):
    """The optimizer was built over other tensors (as when it is made before the adapters are added):
    the adapters get gradients that nothing applies."""
    pytest.importorskip("peft")
    s = OnlineSession.create(make_config(tiny_model_dir, reward_file, lora_r=4, lora_alpha=8))
    stray = torch.nn.Parameter(torch.zeros(1))
    s.optimizer, s.scheduler = build_optimizer([stray], s.config.optim, 2)
    with pytest.raises(WeightsNotUpdated, match="changed none of the policy's 14 trainable tensors \\(LoRA adapters\\)"):
        train_step(s)


def test_an_update_below_the_weights_precision_is_an_error(tiny_model_dir, reward_file):
    """What bfloat16 weights do at an ordinary learning rate, float32 weights do at 1e-30: w + dw == w."""
    s = OnlineSession.create(make_config(tiny_model_dir, reward_file, learning_rate=1e-30))
    with pytest.raises(WeightsNotUpdated, match="below the weights' precision"):
        train_step(s)


def test_the_update_check_passes_once_then_costs_nothing(tiny_model_dir, reward_file):
    s = OnlineSession.create(make_config(tiny_model_dir, reward_file))
    train_step(s)
    assert s.update_check.done and s.update_check.before_step() is None


def test_update_check_by_hand():
    layer = torch.nn.Linear(2, 1)
    check = UpdateCheck(layer, lora=False)
    before = check.before_step()
    assert not before.has_gradient  # no backward yet: no update is expected
    check.after_step(before, grad_norm=0.0, lr=1e-3)
    assert not check.done
    layer(torch.ones(1, 2)).sum().backward()
    before = check.before_step()
    check.after_step(before, grad_norm=math.nan, lr=1e-3)  # a skipped step: nothing expected
    check.after_step(before, grad_norm=1.0, lr=0.0)  # lr 0: nothing expected
    assert not check.done
    with pytest.raises(WeightsNotUpdated, match="none of the policy's 2 trainable tensors"):
        check.after_step(before, grad_norm=1.0, lr=1e-3)


def test_reward_watch_warns_once_about_a_constant_reward_and_about_failures(capsys):
    watch = RewardWatch()
    constant = torch.full((guards.REWARD_WARN_SAMPLES // 2,), 1.0)
    varying = torch.arange(len(constant), dtype=torch.float32)
    watch.update({"always_one": constant, "varies": varying}, {})
    assert "warning" not in capsys.readouterr().err  # too few samples to tell
    for _ in range(3):
        watch.update({"always_one": constant, "varies": varying}, {})
    err = capsys.readouterr().err
    assert err.count("reward function 'always_one' returned 1 for all 256 completions") == 1
    assert "'varies'" not in err
    failing = torch.where(torch.arange(len(constant)) % 4 == 0, math.nan, varying)  # a quarter failed
    watch.update({"flaky": failing}, {"flaky": len(constant) // 4})
    watch.update({"flaky": failing}, {"flaky": len(constant) // 4})
    assert "reward function 'flaky' failed (NaN, inf or an exception) on 64 of 256 samples" in capsys.readouterr().err
