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
    with pytest.raises(ConfigError, match="grpo uses no teacher"):
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


# --- GKD's generalised JSD -----------------------------------------------------------------


def test_generalized_jsd_by_hand():
    s, t = torch.tensor([[0.0, math.log(3.0)]]), torch.tensor([[math.log(3.0), 0.0]])  # S = (1/4, 3/4), T = (3/4, 1/4)
    forward_kl = 0.75 * math.log(3) + 0.25 * math.log(1 / 3)
    assert F.generalized_jsd(s, t, beta=0.0).item() == pytest.approx(forward_kl)
    assert F.generalized_jsd(s, t, beta=1.0).item() == pytest.approx(forward_kl)  # symmetric case
    # beta = 0.5: M = (1/2, 1/2); JSD = 0.5 KL(T || M) + 0.5 KL(S || M)
    half = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)
    assert F.generalized_jsd(s, t, beta=0.5).item() == pytest.approx(half)
    assert F.generalized_jsd(t, t, beta=0.3).item() == pytest.approx(0.0, abs=1e-7)


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_generalized_jsd_matches_a_naive_float64_reference(beta):
    """Plain Python over positions and vocabulary: M = beta T + (1 - beta) S, beta KL(T || M) + (1 - beta) KL(S || M),
    with the two end points the KLs themselves."""
    g = torch.Generator().manual_seed(1)
    student = torch.randn(4, 7, generator=g, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(4, 7, generator=g, dtype=torch.float64)
    temperature = 0.8
    expected = []
    for m in range(4):
        s_exp = [torch.exp(x / temperature) for x in student[m]]
        t_exp = [math.exp(float(x) / temperature) for x in teacher[m]]
        s = [x / sum(s_exp) for x in s_exp]
        t = [x / sum(t_exp) for x in t_exp]
        if beta == 0:
            expected.append(sum(tv * (math.log(tv) - torch.log(sv)) for sv, tv in zip(s, t)))
        elif beta == 1:
            expected.append(sum(sv * (torch.log(sv) - math.log(tv)) for sv, tv in zip(s, t)))
        else:
            mix = [beta * tv + (1 - beta) * sv for sv, tv in zip(s, t)]
            to_teacher = sum(tv * (math.log(tv) - torch.log(mv)) for tv, mv in zip(t, mix))
            to_student = sum(sv * (torch.log(sv) - torch.log(mv)) for sv, mv in zip(s, mix))
            expected.append(beta * to_teacher + (1 - beta) * to_student)
    expected = torch.stack(expected)
    ours = F.generalized_jsd(student, teacher, beta=beta, temperature=temperature)
    torch.testing.assert_close(ours, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(*(torch.autograd.grad(x.sum(), student)[0] for x in (ours, expected)),
                               rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.9])
def test_generalized_jsd_is_trls(beta, temperature):
    gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer")
    torch.manual_seed(0)
    student = torch.randn(2, 5, 11, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(2, 5, 11, dtype=torch.float64)
    labels = torch.randint(0, 11, (2, 5))
    labels[0, :2] = -100  # prompt positions
    theirs = gkd.GKDTrainer.generalized_jsd_loss(student, teacher, labels=labels, beta=beta, temperature=temperature)
    keep = labels != -100
    ours = F.generalized_jsd(student[keep], teacher[keep], beta=beta, temperature=temperature).mean()
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(*(torch.autograd.grad(x, student, retain_graph=True)[0] for x in (ours, theirs)))


# --- GKD, the supervised preset -------------------------------------------------------------


def gkd_config(model_dir, teacher_dir, **flat):
    from posttrain.config import Config

    base = dict(algorithm="gkd", model=str(model_dir), teacher=str(teacher_dir), task="addition", pairs_per_step=6,
                micro_batch_size=4, learning_rate=1e-3, max_steps=2, eval_size=8, max_new_tokens=12, packing=False,
                progress=False, report_to="none", seed=0)
    return Config.from_flat({**base, **flat})


def test_gkd_trains_on_the_generalised_jsd_to_the_teacher_exactly(tiny_model_dir, teacher_dir):
    from posttrain.data.sft import layout
    from posttrain.training.sft import SFTSession, micro_batches, train_step as sft_step

    s = SFTSession.create(gkd_config(tiny_model_dir, teacher_dir, student_fraction=0.0, jsd_beta=0.3))
    student = copy.deepcopy(s.policy)
    state = s.sampler.state_dict()
    metrics = sft_step(s)
    s.sampler.load_state_dict(state)
    idx = s.sampler.next(6)
    rows = [row for part in micro_batches(s, s.train, idx) for row in part]
    batch = layout(s.train, rows, s.tokenizer.pad_token_id)
    with torch.no_grad():
        mine = student(input_ids=batch.input_ids, position_ids=batch.position_ids).logits[batch.loss_mask]
        theirs = s.teacher(input_ids=batch.input_ids, position_ids=batch.position_ids).logits[batch.loss_mask]
    expected = F.generalized_jsd(mine, theirs, beta=0.3).mean()
    assert metrics["jsd"] == pytest.approx(float(expected), rel=1e-5) and metrics["on_policy"] == 0.0
    assert "nll" not in metrics


def test_gkd_draws_its_on_policy_steps_from_the_seed_and_trains_on_the_student_s_samples(tiny_model_dir,
                                                                                         teacher_dir):
    from posttrain.training.sft import SFTSession, on_policy, train_step as sft_step

    s = SFTSession.create(gkd_config(tiny_model_dir, teacher_dir, student_fraction=0.5, max_steps=40))
    draws = []
    for step in range(40):
        s.step = step
        draws.append(on_policy(s))
    assert 10 < sum(draws) < 30  # about half
    again = SFTSession.create(gkd_config(tiny_model_dir, teacher_dir, student_fraction=0.5, max_steps=40))
    redrawn = []
    for step in range(40):
        again.step = step
        redrawn.append(on_policy(again))
    assert redrawn == draws
    s = SFTSession.create(gkd_config(tiny_model_dir, teacher_dir, student_fraction=1.0))
    metrics = sft_step(s)
    assert metrics["on_policy"] == 1.0 and metrics["jsd"] > 0
    demonstrations = {row["completion"] for row in s.train.rows}
    assert not {row["completion"] for row in s.sample_rows()} <= demonstrations  # the random student's own text


def test_gkd_needs_a_teacher_and_unpacked_rows(tiny_model_dir, teacher_dir):
    from posttrain.training.sft import SFTSession

    with pytest.raises(ConfigError, match="give --teacher MODEL"):
        SFTSession.create(gkd_config(tiny_model_dir, teacher_dir, teacher=None))
    with pytest.raises(ConfigError, match="set --no-packing"):
        SFTSession.create(gkd_config(tiny_model_dir, teacher_dir, packing=True))
