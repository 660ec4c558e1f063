"""Preference losses (DPO, ODPO, SimPO, ORPO, KTO) and DAPO's overlong penalty."""

import math

import pytest
import torch

import posttrain.functional as F


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))  # -logsig(-x)


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_dpo_hand_computed():
    pi_w, pi_l, ref_w, ref_l = t(-1.0), t(-2.0), t(-1.5), t(-1.5)
    loss, metrics = F.dpo_loss(pi_w, pi_l, ref_w, ref_l, beta=0.1)
    # rewards: .1 * (-1 + 1.5) = .05, .1 * (-2 + 1.5) = -.05; h = .1; loss = -logsig(.1) = log(1 + e^-.1)
    assert loss.item() == pytest.approx(softplus(-0.1))
    assert loss.item() == pytest.approx(0.644397, abs=1e-6)
    assert metrics["rewards/chosen"].item() == pytest.approx(0.05)
    assert metrics["rewards/rejected"].item() == pytest.approx(-0.05)
    assert metrics["rewards/margin"].item() == pytest.approx(0.1)
    assert metrics["rewards/accuracy"].item() == 1
    assert metrics["logps/chosen"].item() == -1 and metrics["logps/rejected"].item() == -2


def test_dpo_label_smoothing_hand_computed():
    loss, _ = F.dpo_loss(t(-1.0), t(-2.0), t(-1.5), t(-1.5), beta=0.1, label_smoothing=0.1)
    # .9 * -logsig(.1) + .1 * -logsig(-.1)
    assert loss.item() == pytest.approx(0.9 * softplus(-0.1) + 0.1 * softplus(0.1))


def test_dpo_small_beta_limit():
    pi_w = t(-3.0, -1.0, -7.0).requires_grad_()
    pi_l = t(-2.0, -4.0, -1.0).requires_grad_()
    beta = 1e-8
    loss, _ = F.dpo_loss(pi_w, pi_l, t(-1.0, -2.0, -3.0), t(-3.0, -2.0, -1.0), beta=beta)
    loss.backward()
    # h -> 0: loss -> -logsig(0) = log 2; d loss / d pi_w = -beta * sigmoid(-h) / B -> -beta / (2B)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-7)
    torch.testing.assert_close(pi_w.grad / beta, torch.full((3,), -1 / 6, dtype=torch.float64))
    torch.testing.assert_close(pi_l.grad / beta, torch.full((3,), 1 / 6, dtype=torch.float64))


def test_dpo_reference_gets_no_gradient_and_rejects_bad_arguments():
    ref = t(-1.0).requires_grad_()
    F.dpo_loss(t(-1.0).requires_grad_(), t(-2.0), ref, t(-2.0))[0].backward()
    assert ref.grad is None
    with pytest.raises(ValueError, match="beta=0 must be > 0"):
        F.dpo_loss(t(-1.0), t(-2.0), t(-1.0), t(-2.0), beta=0)
    with pytest.raises(ValueError, match="label_smoothing"):
        F.dpo_loss(t(-1.0), t(-2.0), t(-1.0), t(-2.0), label_smoothing=0.7)
    with pytest.raises(ValueError, match=r"rejected_logps has shape \[2\] but chosen_logps has shape \[1\]"):
        F.dpo_loss(t(-1.0), t(-2.0, -1.0), t(-1.0), t(-2.0))


def test_odpo_offset_and_loss_hand_computed():
    offset = F.odpo_offset(t(3.0, 2.0), t(1.0, 1.5), alpha=1.0)
    torch.testing.assert_close(offset, t(math.log(2.0), math.log(0.5)))
    loss, _ = F.dpo_loss(t(-1.0, -1.0), t(-2.0, -2.0), t(-1.5, -1.5), t(-1.5, -1.5), beta=0.1, offset=offset)
    # h = .1 for both pairs; loss = mean(-logsig(.1 - offset))
    expected = (softplus(-(0.1 - math.log(2.0))) + softplus(-(0.1 - math.log(0.5)))) / 2
    assert loss.item() == pytest.approx(expected)
    torch.testing.assert_close(F.odpo_offset(t(3.0), t(1.0), alpha=0.5), t(0.5 * math.log(2.0)))


def test_odpo_offset_names_the_unordered_pairs():
    with pytest.raises(ValueError, match=r"not at indices \[1, 2\]"):
        F.odpo_offset(t(1.0, 2.0, 3.0), t(0.0, 2.0, 4.0))


def test_simpo_hand_computed():
    loss, metrics = F.simpo_loss(t(-4.0), t(-9.0), torch.tensor([2]), torch.tensor([3]), beta=2.0, gamma=1.0)
    # 2 * -4/2 - 2 * -9/3 - 1 = -4 + 6 - 1 = 1;  loss = -logsig(1)
    assert loss.item() == pytest.approx(softplus(-1.0))
    assert metrics["rewards/chosen"].item() == pytest.approx(-4.0)
    assert metrics["rewards/rejected"].item() == pytest.approx(-6.0)
    assert metrics["rewards/margin"].item() == pytest.approx(2.0)


def test_length_normalised_losses_name_empty_completions():
    with pytest.raises(ValueError, match=r"rejected_lengths must be > 0.*\[1\]"):
        F.simpo_loss(t(-1.0, -1.0), t(-1.0, -1.0), torch.tensor([1, 1]), torch.tensor([1, 0]))
    with pytest.raises(ValueError, match=r"chosen_lengths must be > 0.*\[0\]"):
        F.orpo_loss(t(-1.0), t(-1.0), torch.tensor([0]), torch.tensor([1]))


def test_orpo_hand_computed():
    loss, metrics = F.orpo_loss(t(-2.0), t(-6.0), torch.tensor([2]), torch.tensor([3]), lam=0.1)
    # a_w = -1, a_l = -2;  logodds = a - log(1 - e^a)
    logodds_w = -1 - math.log(1 - math.exp(-1))  # -0.541325
    logodds_l = -2 - math.log(1 - math.exp(-2))  # -1.854587
    expected = 1.0 + 0.1 * softplus(-(logodds_w - logodds_l))  # NLL_w = -a_w = 1
    assert loss.item() == pytest.approx(expected)
    assert metrics["rewards/chosen"].item() == pytest.approx(logodds_w)
    assert metrics["rewards/margin"].item() == pytest.approx(logodds_w - logodds_l)
    assert metrics["nll"].item() == pytest.approx(1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_orpo_log_odds_are_stable_near_zero_and_far_below(dtype):
    chosen = torch.tensor([-1e-12, -0.1, -0.69, -0.7, -50.0, 0.0], dtype=dtype, requires_grad=True)
    rejected = torch.tensor([-3.0, -1e-30, -100.0, -0.6, -60.0, -1.0], dtype=dtype, requires_grad=True)
    ones = torch.ones(6)
    loss, metrics = F.orpo_loss(chosen, rejected, ones, ones)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(chosen.grad).all() and torch.isfinite(rejected.grad).all()
    # away from the cap the log odds match the direct float64 formula a - log(1 - e^a)
    a = torch.tensor([-0.1, -0.69, -0.7, -50.0], dtype=torch.float64)
    direct = (a - torch.log(1 - torch.exp(a))).mean()
    _, m = F.orpo_loss(a.to(dtype), a.to(dtype), torch.ones(4), torch.ones(4))
    assert m["rewards/chosen"].item() == pytest.approx(direct.item(), rel=1e-6)


def test_kto_hand_computed():
    logps = t(-1.0, -2.0).requires_grad_()
    kl_logps = t(-3.0, -3.0).requires_grad_()
    loss, metrics = F.kto_loss(
        logps, t(-1.5, -1.5), torch.tensor([True, False]), kl_logps, t(-3.2, -2.9), beta=0.1
    )
    # z = max(0, mean(.2, -.1)) = .05;  r = [.5, -.5]
    # desirable: 1 - sig(.1 * (.5 - .05));  undesirable: 1 - sig(.1 * (.05 + .5))
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    assert loss.item() == pytest.approx(((1 - sig(0.045)) + (1 - sig(0.055))) / 2)
    assert metrics["kl"].item() == pytest.approx(0.05)
    assert metrics["rewards/desirable"].item() == pytest.approx(0.05)
    assert metrics["rewards/undesirable"].item() == pytest.approx(-0.05)
    loss.backward()
    assert kl_logps.grad is None or (kl_logps.grad == 0).all()  # z is detached


def test_kto_reference_point_is_clamped_at_zero_and_weights_apply():
    desirable = torch.tensor([True, False])
    loss, metrics = F.kto_loss(
        t(-1.0, -2.0), t(-1.5, -1.5), desirable, t(-3.0, -3.0), t(-2.0, -2.0),
        beta=0.1, desirable_weight=2.0, undesirable_weight=0.5,
    )
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    assert metrics["kl"].item() == 0  # mean kl = -1 -> clamped to 0
    assert loss.item() == pytest.approx((2.0 * (1 - sig(0.05)) + 0.5 * (1 - sig(0.05))) / 2)


def test_overlong_penalty_hand_computed():
    lengths = torch.tensor([10, 16, 17, 20, 21, 100])
    # L_max 20, L_cache 4: 0 up to 16, (16 - |o|) / 4 up to 20, -1 beyond
    expected = torch.tensor([0.0, 0.0, -0.25, -1.0, -1.0, -1.0])
    torch.testing.assert_close(F.overlong_penalty(lengths, max_tokens=20, buffer=4), expected)
    paper = F.overlong_penalty(torch.tensor([16384, 18432, 20480, 20481]), max_tokens=20480, buffer=4096)
    torch.testing.assert_close(paper, torch.tensor([0.0, -0.5, -1.0, -1.0]))


def test_overlong_penalty_rejects_bad_budgets():
    with pytest.raises(ValueError, match="buffer=30 exceeds max_tokens=20"):
        F.overlong_penalty(torch.tensor([1]), max_tokens=20, buffer=30)
    with pytest.raises(ValueError, match="buffer=0 must be > 0"):
        F.overlong_penalty(torch.tensor([1]), max_tokens=20, buffer=0)


def test_group_length_penalty_hand_computed():
    # Kimi k1.5 sec. 2.3.3. Group 1: lengths 2, 4, 6, 10: min 2, max 10, spread 8, so
    # lambda = 0.5 - (len - 2) / 8 = 0.5, 0.25, 0.0, -0.5. Correct samples get lambda, incorrect
    # ones min(0, lambda): the wrong 4-token answer gets 0, not 0.25; the wrong 10-token one -0.5.
    # Group 2: every length 5: lambda = 0 for all, right or wrong.
    lengths = torch.tensor([[2, 4, 6, 10], [5, 5, 5, 5]])
    correct = torch.tensor([[True, False, True, False], [True, False, True, True]])
    expected = torch.tensor([[0.5, 0.0, 0.0, -0.5], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(F.group_length_penalty(lengths, correct), expected)
    # all correct: the plain lambda, whose group mean is 0.5 - mean((len - 2) / 8) = 0.5 - 0.4375 = 0.0625
    every = F.group_length_penalty(lengths[:1], torch.ones(1, 4, dtype=torch.bool))
    torch.testing.assert_close(every, torch.tensor([[0.5, 0.25, 0.0, -0.5]]))
    assert every.mean().item() == pytest.approx(0.0625)


def test_group_length_penalty_depends_only_on_each_groups_relative_lengths():
    lengths = torch.tensor([[3.0, 7.0, 11.0], [1.0, 2.0, 2.0]])
    correct = torch.tensor([[True, True, False], [False, True, True]])
    penalty = F.group_length_penalty(lengths, correct)
    shifted = F.group_length_penalty(lengths * 3 + 100, correct)  # min and max move with every length
    torch.testing.assert_close(penalty, shifted)
    swapped = F.group_length_penalty(lengths.flip(0), correct.flip(0))  # groups do not see each other
    torch.testing.assert_close(swapped, penalty.flip(0))
    with pytest.raises(ValueError, match=r"correct has shape \[2, 2\] but lengths has shape \[2, 3\]"):
        F.group_length_penalty(lengths, correct[:, :2])
    with pytest.raises(ValueError, match=r"lengths must have shape \[B, G\]"):
        F.group_length_penalty(lengths.view(-1), correct.view(-1))


def test_chosen_nll_by_hand():
    """RPO's term: -pi_w / |y_w| per example, averaged. (-(-6)/3 + -(-2)/4) / 2 = (2 + 0.5) / 2 = 1.25."""
    logps, lengths = torch.tensor([-6.0, -2.0]), torch.tensor([3, 4])
    assert F.chosen_nll(logps, lengths).item() == pytest.approx(1.25)
    # KTO: the desirable examples' term, still a mean over all examples: (0 + 0.5) / 2
    assert F.chosen_nll(logps, lengths, keep=torch.tensor([False, True])).item() == pytest.approx(0.25)
    assert F.chosen_nll(logps, lengths, keep=torch.tensor([False, False])).item() == 0.0
    with pytest.raises(ValueError, match="chosen_lengths must be > 0"):
        F.chosen_nll(logps, torch.tensor([3, 0]))


# --- the reward model's Bradley-Terry loss ---------------------------------------------------------


def test_bradley_terry_loss_against_hand_computed_values():
    chosen, rejected = torch.tensor([2.0, 0.0, 1.0]), torch.tensor([1.0, 0.0, 3.0])
    loss, metrics = F.bradley_terry_loss(chosen, rejected)
    # -log sigmoid(d) = log(1 + exp(-d)) for d = 1, 0, -2
    expected = (math.log(1 + math.exp(-1)) + math.log(2) + math.log(1 + math.exp(2))) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["accuracy"].item() == pytest.approx(1.5 / 3)  # a win, a tie (half), a loss
    assert metrics["margin"].item() == pytest.approx(-1 / 3)
    assert (metrics["rewards/chosen"].item(), metrics["rewards/rejected"].item()) == pytest.approx((1.0, 4 / 3))


def test_bradley_terry_margin_and_centring_against_hand_computed_values():
    chosen, rejected = torch.tensor([2.0, 1.0], requires_grad=True), torch.tensor([1.0, -1.0])
    loss, _ = F.bradley_terry_loss(chosen, rejected, margin=torch.tensor([1.0, 0.5]), center_coefficient=0.1)
    # differences minus margins: 0 and 1.5; centring: 0.1 * mean((2 + 1)^2, (1 - 1)^2) = 0.45
    expected = (math.log(2) + math.log(1 + math.exp(-1.5))) / 2 + 0.45
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    loss.backward()
    # d/dr_w: -(1 - sigmoid(d - m)) / B + 0.1 * 2 (r_w + r_l) / B
    sigmoid = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    expected_grad = [-(1 - sigmoid(0.0)) / 2 + 0.1 * 2 * 3 / 2, -(1 - sigmoid(1.5)) / 2 + 0.0]
    assert chosen.grad.tolist() == pytest.approx(expected_grad, rel=1e-6)


def test_bradley_terry_loss_checks_its_inputs():
    with pytest.raises(ValueError, match="chosen_scores"):
        F.bradley_terry_loss(torch.zeros(2, 1), torch.zeros(2, 1))
    with pytest.raises(ValueError, match="margin"):
        F.bradley_terry_loss(torch.zeros(2), torch.zeros(2), margin=torch.zeros(3))
    with pytest.raises(ValueError, match="center_coefficient"):
        F.bradley_terry_loss(torch.zeros(2), torch.zeros(2), center_coefficient=-1.0)


def test_ipo_hand_computed():
    """h = (pi_w - ref_w) - (pi_l - ref_l); loss = mean (h - 1/(2 beta))^2. Pair 0: h = (-2+3) - (-5+4) = 2;
    pair 1: h = (-1+1) - (-1+1) = 0. beta 0.25: target 2 -> losses 0 and 4, mean 2."""
    loss, metrics = F.ipo_loss(torch.tensor([-2.0, -1.0]), torch.tensor([-5.0, -1.0]), torch.tensor([-3.0, -1.0]),
                               torch.tensor([-4.0, -1.0]), beta=0.25)
    torch.testing.assert_close(loss, torch.tensor(2.0))
    torch.testing.assert_close(metrics["rewards/chosen"], torch.tensor(0.125))  # beta * (pi_w - ref_w), averaged
    # per token (the authors' runs, TRL's): pair 0's ratios 1/2 and -1/4 -> h 0.75, (0.75 - 2)^2 = 1.5625;
    # pair 1: h 0 -> 4; mean 2.78125
    loss, _ = F.ipo_loss(torch.tensor([-2.0, -1.0]), torch.tensor([-5.0, -1.0]), torch.tensor([-3.0, -1.0]),
                         torch.tensor([-4.0, -1.0]), beta=0.25, chosen_lengths=torch.tensor([2, 3]),
                         rejected_lengths=torch.tensor([4, 1]))
    torch.testing.assert_close(loss, torch.tensor(2.78125))
    with pytest.raises(ValueError, match="give chosen_lengths and rejected_lengths together"):
        F.ipo_loss(*[torch.zeros(2)] * 4, chosen_lengths=torch.ones(2))


def test_ipo_gradient_pushes_the_margin_to_its_target():
    """d loss / d pi_w = 2 (h - 1/(2 beta)) / B: negative below the target (raise the chosen), positive above."""
    chosen = torch.tensor([0.0, 10.0], requires_grad=True)
    loss, _ = F.ipo_loss(chosen, torch.zeros(2), torch.zeros(2), torch.zeros(2), beta=0.1)  # target 5
    loss.backward()
    torch.testing.assert_close(chosen.grad, torch.tensor([2 * (0 - 5) / 2, 2 * (10 - 5) / 2]))
