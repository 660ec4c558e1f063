"""On-policy distillation: the student samples, a frozen teacher scores each token, and each token's advantage
is the teacher's minus the student's log-prob (``on_policy_distill``, ``--teacher``)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import posttrain.functional as F
from posttrain.config import ConfigError
from posttrain.models.modeling import collate, forward
from posttrain.training.online import train_step
from posttrain.training.session import OnlineSession
from test_online import make_config


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """The tiny model with other weights and the same tokenizer."""
    from posttrain.models.tiny import build_tiny_model, char_tokenizer

    path = tmp_path_factory.mktemp("teacher")
    tokenizer = char_tokenizer("0123456789+=,|")
    build_tiny_model(tokenizer, seed=1, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_distillation_advantages_by_hand():
    student = torch.log(torch.tensor([[0.5, 0.25, 0.9]]))
    teacher = torch.log(torch.tensor([[0.25, 0.5, 0.1]]))
    mask = torch.tensor([[1, 1, 0]])
    expected = torch.tensor([[-math.log(2), math.log(2), 0.0]])
    torch.testing.assert_close(F.distillation_advantages(student, teacher, mask), expected)


def test_the_step_trains_on_the_teacher_minus_student_advantage_exactly(tiny_model_dir, reward_file, teacher_dir):
    s = OnlineSession.create(make_config(tiny_model_dir, reward_file, "on_policy_distill", teacher=str(teacher_dir),
                                         micro_batch_size=5))
    policy = copy.deepcopy(s.policy)
    metrics = train_step(s)
    g = s.last_groups
    batch = collate(g.prompt_ids, g.completions.completion_ids, g.completions.mask, s.pad_id, s.device)
    with torch.no_grad():
        student = forward(policy, batch).logprobs
        teacher = forward(s.teacher, batch).logprobs
    advantages = F.distillation_advantages(student, teacher, batch.mask)
    expected, _ = F.policy_loss(student, student, advantages, batch.mask, clip="none", eps_low=None, eps_high=None,
                                aggregation="token_mean")
    assert metrics["loss"] == pytest.approx(float(expected), abs=1e-5)
    kl = float(((student - teacher) * batch.mask).sum() / batch.mask.sum())
    assert metrics["distill/reverse_kl"] == pytest.approx(kl, abs=1e-5) and kl > 0


def test_distillation_lowers_the_reverse_kl_to_the_teacher(tiny_model_dir, reward_file, teacher_dir):
    s = OnlineSession.create(make_config(tiny_model_dir, reward_file, "on_policy_distill", teacher=str(teacher_dir),
                                         max_steps=25, learning_rate=3e-3, prompts_per_step=8))
    kls = [train_step(s)["distill/reverse_kl"] for _ in range(25)]
    assert sum(kls[-5:]) / 5 < 0.5 * sum(kls[:5]) / 5, kls


def test_a_task_reward_weight_adds_the_group_advantage(tiny_model_dir, reward_file, teacher_dir):
    from posttrain import algorithm

    preset = algorithm("on_policy_distill", task_reward_weight=0.5)
    rewards = torch.tensor([[1.0, 0.0]])
    mask = torch.ones(2, 3)
    student, teacher = torch.zeros(2, 3), torch.full((2, 3), -0.1)
    got = preset.advantages(rewards, mask=mask, logprobs=student, teacher_logprobs=teacher)
    group = F.advantages("group", rewards).reshape(-1, 1)
    torch.testing.assert_close(got, (teacher - student) + 0.5 * group * mask)
    with pytest.raises(ValueError, match="task_reward_weight belongs to a distillation estimator"):
        algorithm("grpo", task_reward_weight=0.5)


def test_a_teacher_is_required_refused_elsewhere_and_must_share_the_tokenizer(tiny_model_dir, reward_file,
                                                                               teacher_dir, tmp_path):
    with pytest.raises(ConfigError, match="give --teacher MODEL"):
        OnlineSession.create(make_config(tiny_model_dir, reward_file, "on_policy_distill"))
    with pytest.raises(ConfigError, match="grpo's advantages use no teacher"):
        OnlineSession.create(make_config(tiny_model_dir, reward_file, "grpo", teacher=str(teacher_dir)))
    from posttrain.models.tiny import build_tiny_model, char_tokenizer

    other = tmp_path / "other"
    tokenizer = char_tokenizer("0123456789+-=,|")  # one more character: other ids
    build_tiny_model(tokenizer, seed=0, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64).save_pretrained(other)
    tokenizer.save_pretrained(other)
    with pytest.raises(ConfigError, match="has another tokenizer than the student"):
        OnlineSession.create(make_config(tiny_model_dir, reward_file, "on_policy_distill", teacher=str(other)))


def test_an_offloaded_teacher_gives_the_same_step(tiny_model_dir, reward_file, teacher_dir):
    losses = []
    for offloaded in (False, True):
        s = OnlineSession.create(make_config(tiny_model_dir, reward_file, "on_policy_distill",
                                             teacher=str(teacher_dir), offload_reference=offloaded))
        losses.append(train_step(s)["loss"])
    assert losses[0] == losses[1]
