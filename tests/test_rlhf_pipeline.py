"""The RLHF pipeline end to end on the built-in addition task, on a small budget: SFT a base model, train a
reward model on pairs of the SFT model's own samples, then PPO and GRPO from the SFT model against the
reward model alone, each stage reading the one before's final_model/ (the README's command sequence)."""

from __future__ import annotations

import json

import pytest

from posttrain.config import Config
from posttrain.training.api import run


def stage(**flat):
    base = dict(task="addition", progress=False, report_to="none", seed=0, eval_every=0, save_every=0)
    return run(Config.from_flat({**base, **flat}))


@pytest.mark.slow
def test_sft_then_a_reward_model_then_ppo_and_grpo_against_it(tmp_path):
    sft = stage(algorithm="sft", model="tiny-addition-base", learning_rate=1e-3, lr_schedule="linear", max_steps=200,
                eval_size=100, output=str(tmp_path / "sft"))
    assert sft["after"]["eval/accuracy"] > sft["before"]["eval/accuracy"] + 0.1  # the base model learns the task
    sft_model = str(tmp_path / "sft" / "final_model")
    reward = stage(algorithm="reward_model", model=sft_model, max_steps=40, pairs_per_step=32, eval_size=200,
                   output=str(tmp_path / "reward_model"))  # the SFT model's own samples, right against wrong
    assert reward["after"]["eval/pairwise_accuracy_low"] > 0.5  # it ranks held-out pairs better than chance
    for algorithm in ("ppo", "grpo"):
        out = tmp_path / algorithm
        result = stage(algorithm=algorithm, model=sft_model, reward_model=str(tmp_path / "reward_model" / "final_model"),
                       prompts_per_step=8, group_size=4, max_steps=3, eval_size=20, output=str(out))
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        trained = [r for r in rows if "reward/reward_model" in r]
        assert len(trained) == 3 and "reward/accuracy" not in trained[0]  # the learned score alone is the reward
        assert {"eval/accuracy", "eval/reward"} <= set(result["after"])  # the truth beside the learned score
