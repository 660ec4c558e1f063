"""The learning-rate schedule: hand-computed multipliers, and what a run logs and applies."""

from __future__ import annotations

import json
import math

import pytest
import torch

from posttrain.config import Config, ConfigError, OptimConfig
from posttrain.training.optim import build_optimizer, lr_multiplier
from posttrain.training.runner import run_training
from posttrain.training.session import OnlineSession, evaluate
from posttrain.training.online import train_step


@pytest.mark.parametrize("schedule, expected", [
    # warm-up 2 of 6 steps: 1/3, 2/3, then p = 0, 1/4, 2/4, 3/4
    ("constant", [1 / 3, 2 / 3, 1.0, 1.0, 1.0, 1.0]),
    ("linear", [1 / 3, 2 / 3, 1.0, 0.75, 0.5, 0.25]),
    ("cosine", [1 / 3, 2 / 3, 1.0, (1 + math.cos(math.pi / 4)) / 2, 0.5, (1 + math.cos(3 * math.pi / 4)) / 2]),
])
def test_lr_multiplier_by_hand(schedule, expected):
    got = [lr_multiplier(k, warmup_steps=2, total_steps=6, schedule=schedule) for k in range(6)]
    assert got == pytest.approx(expected)
    # past the end (step 6, and step 9 well beyond it): constant stays at 1, linear and cosine stay at 0
    # (an unclamped progress would give linear -0.75 and a cosine rising again to 0.85 at step 9)
    end = {"constant": 1.0, "linear": 0.0, "cosine": 0.0}[schedule]
    past = [lr_multiplier(k, warmup_steps=2, total_steps=6, schedule=schedule) for k in (6, 9)]
    assert past == pytest.approx([end, end], abs=1e-12)


def test_lr_multiplier_without_warmup_starts_at_one_and_never_reaches_zero():
    linear = [lr_multiplier(k, warmup_steps=0, total_steps=4, schedule="linear") for k in range(4)]
    assert linear == pytest.approx([1.0, 0.75, 0.5, 0.25])
    assert lr_multiplier(0, warmup_steps=0, total_steps=0, schedule="cosine") == 1.0  # no division by zero


def test_scheduler_applies_the_multiplier_to_each_optimizer_step():
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer, scheduler = build_optimizer([weight], OptimConfig(learning_rate=0.1, lr_schedule="linear"), 4)
    seen = []
    for _ in range(4):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([0.1, 0.075, 0.05, 0.025])


def test_unknown_schedule_is_a_config_error_naming_the_field():
    with pytest.raises(ConfigError, match="lr_schedule.*'step'.*constant, linear, cosine"):
        Config.from_flat({"lr_schedule": "step"})
    with pytest.raises(ConfigError, match="warmup_steps"):
        Config.from_flat({"warmup_steps": -1})


@pytest.mark.parametrize("algorithm, updates_per_step", [("grpo", 1), ("ppo", 8)])
def test_online_run_logs_the_lr_each_step_used(tiny_model_dir, reward_file, tmp_path, algorithm, updates_per_step):
    """The schedule spans max_steps x epochs x mini_batches optimizer steps; each step logs its first update's lr."""
    config = Config.from_flat(dict(
        algorithm=algorithm, model=str(tiny_model_dir), task="addition", reward=[f"{reward_file}:sevens"],
        prompts_per_step=2, group_size=2, max_new_tokens=6, eval_size=0, learning_rate=1e-3, max_steps=3,
        warmup_steps=1, lr_schedule="linear", progress=False, report_to="none", log_samples_every=0,
        output=str(tmp_path / "run")))
    session = OnlineSession.create(config)
    run_training(session, config, train_step, evaluate)
    logged = [json.loads(line)["lr"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if "lr" in json.loads(line)]
    total = 3 * updates_per_step
    expected = [1e-3 * lr_multiplier(k * updates_per_step, warmup_steps=1, total_steps=total, schedule="linear")
                for k in range(3)]
    assert logged == pytest.approx(expected)
    assert session.scheduler.last_epoch == total
