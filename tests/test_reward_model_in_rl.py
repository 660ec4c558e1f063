"""A learned reward in online training: --reward-model DIR scores completions with a sequence-classification
model, alone (instead of the task's rewards, the task's check still giving accuracy) or beside reward
functions, with a weight and optional batch normalisation."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

from posttrain.config import Config, ConfigError
from posttrain.data.rewards import RewardModel
from posttrain.models.tiny import char_tokenizer
from posttrain.training.online import train_step
from posttrain.training.session import OnlineSession


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    """A random 1-layer sequence-classification model over the addition task's characters."""
    path = tmp_path_factory.mktemp("reward-model")
    tokenizer = char_tokenizer("0123456789+=,|")
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, num_labels=1, pad_token_id=tokenizer.pad_token_id))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def config(reward_model_dir, **flat) -> Config:
    base = dict(algorithm="grpo", model="tiny-addition", task="addition", reward_model=str(reward_model_dir),
                prompts_per_step=2, group_size=4, max_new_tokens=12, eval_size=4, max_steps=1, progress=False,
                report_to="none", seed=0)
    return Config.from_flat({**base, **flat})


def test_the_reward_model_alone_replaces_the_tasks_rewards(reward_model_dir):
    s = OnlineSession.create(config(reward_model_dir))
    assert [getattr(fn, "__name__", "") for fn in s.work.reward_fns] == ["reward_model"]
    train_step(s)
    g = s.last_groups
    prompts = [s.train_rows[i]["prompt"] for i in g.indices for _ in range(g.group_size)]
    expected = RewardModel(reward_model_dir)(prompts, g.texts)
    torch.testing.assert_close(g.rewards.flatten(), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    assert g.correct is not None  # the task's answer check still scores accuracy


def test_the_reward_model_beside_functions_is_weighted_and_can_be_normalised(reward_model_dir, tmp_path):
    rewards = tmp_path / "rewards.py"
    rewards.write_text("def ones(prompts, completions, **columns):\n    return [1.0] * len(completions)\n")
    s = OnlineSession.create(config(reward_model_dir, reward=[f"{rewards}:ones"], reward_model_weight=0.5,
                                    reward_model_normalize="batch"))
    train_step(s)
    g = s.last_groups
    learned = g.terms["reward_model"]
    assert abs(float(learned.mean())) < 1e-5 and abs(float(learned.std()) - 1) < 1e-3  # standardised
    torch.testing.assert_close(g.rewards.flatten(), 1.0 + 0.5 * learned)


def test_a_reward_model_that_is_not_a_model_directory_is_named(tmp_path):
    with pytest.raises(ConfigError, match="reward_model: .* is not a model directory"):
        config(tmp_path)
    with pytest.raises(ConfigError, match="reward_model_normalize: got 'whiten'"):
        config(tmp_path, reward_model=None, reward_model_normalize="whiten")
