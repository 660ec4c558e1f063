"""KL estimators and loss aggregation: hand-computed numbers, padding, empty batches, errors."""

import math

import pytest
import torch

import posttrain.functional as F


def test_kl_estimators_hand_computed():
    logp = torch.tensor([-1.0, -2.0, -0.7])
    ref = torch.tensor([-1.5, -1.0, -0.7])
    # d = ref - logp = [-0.5, 1.0, 0.0]
    k1 = [0.5, -1.0, 0.0]  # -d
    k2 = [0.125, 0.5, 0.0]  # d^2 / 2
    k3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1, 0.0]  # exp(d) - d - 1
    torch.testing.assert_close(F.kl_estimate(logp, ref, "k1"), torch.tensor(k1))
    torch.testing.assert_close(F.kl_estimate(logp, ref, "k2"), torch.tensor(k2))
    torch.testing.assert_close(F.kl_estimate(logp, ref, "k3"), torch.tensor(k3))


def test_k3_is_nonnegative_and_exactly_zero_at_equality():
    logp = torch.linspace(-10, 0, 101, dtype=torch.float64)
    ref = logp.flip(0)
    assert (F.kl_estimate(logp, ref, "k3") >= 0).all()
    assert (F.kl_estimate(logp, logp, "k3") == 0).all()


def test_kl_estimate_rejects_unknown_estimator_and_shape_mismatch():
    with pytest.raises(ValueError, match="'k1', 'k2', 'k3'"):
        F.kl_estimate(torch.zeros(2), torch.zeros(2), "k4")
    with pytest.raises(ValueError, match=r"\[3\].*\[2\]"):
        F.kl_estimate(torch.zeros(2), torch.zeros(3), "k1")


# values [[1, 2, 3], [4, 5, pad], [pad, pad, pad]]
VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 0.0], [7.0, 7.0, 7.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])


@pytest.mark.parametrize(
    "aggregation, kwargs, expected",
    [
        ("token_mean", {}, (1 + 2 + 3 + 4 + 5) / 5),  # 3.0
        ("sequence_mean", {}, (6 / 3 + 9 / 2) / 2),  # empty row not counted: 3.25
        ("constant", {"max_tokens": 4}, (6 / 4 + 9 / 4) / 2),  # 1.875
        ("token_mean", {"normalizer": 10}, 15 / 10),
        ("sequence_mean", {"normalizer": 4}, (2 + 4.5) / 4),
        ("constant", {"max_tokens": 4, "normalizer": torch.tensor(5)}, (1.5 + 2.25) / 5),
    ],
)
def test_aggregate_hand_computed(aggregation, kwargs, expected):
    assert F.aggregate(VALUES, MASK, aggregation, **kwargs).item() == pytest.approx(expected)


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "constant"])
@pytest.mark.parametrize("garbage", [1e9, float("inf"), float("nan"), -float("inf")])
def test_aggregate_ignores_padding_in_value_and_gradient(aggregation, garbage):
    clean = VALUES.clone().requires_grad_()
    dirty = torch.where(MASK.bool(), VALUES, garbage).requires_grad_()
    clean_loss = F.aggregate(clean, MASK, aggregation, max_tokens=4)
    dirty_loss = F.aggregate(dirty, MASK, aggregation, max_tokens=4)
    clean_loss.backward()
    dirty_loss.backward()
    assert torch.equal(clean_loss, dirty_loss)
    assert torch.equal(clean.grad, dirty.grad)
    assert (dirty.grad[~MASK.bool()] == 0).all()


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "constant"])
def test_aggregate_of_nothing_is_zero_with_zero_gradient(aggregation):
    values = torch.full((2, 3), float("nan"), requires_grad=True)
    loss = F.aggregate(values, torch.zeros(2, 3), aggregation, max_tokens=3)
    assert loss.requires_grad and loss.item() == 0.0
    loss.backward()
    assert torch.equal(values.grad, torch.zeros(2, 3))
    # an empty step passes normalizer=0: still 0, not NaN
    assert F.aggregate(values.detach(), torch.zeros(2, 3), aggregation, max_tokens=3, normalizer=0).item() == 0.0


def test_aggregate_rejects_bad_arguments():
    with pytest.raises(ValueError, match="max_tokens"):
        F.aggregate(VALUES, MASK, "constant")
    with pytest.raises(ValueError, match="'sequence_mean', 'token_mean', 'constant'"):
        F.aggregate(VALUES, MASK, "seq_mean_token_sum")
    with pytest.raises(ValueError, match=r"mask has shape \[3, 2\] but values has shape \[3, 3\]"):
        F.aggregate(VALUES, MASK[:, :2], "token_mean")
    with pytest.raises(ValueError, match="normalizer"):
        F.aggregate(VALUES, MASK, "token_mean", normalizer=-1)
    with pytest.raises(ValueError, match="max_tokens"):
        F.aggregate(VALUES, MASK, "constant", max_tokens=0)


def _step_normalizer(mask: torch.Tensor, aggregation: str) -> torch.Tensor:
    """What a trainer passes: valid tokens of the step, or its non-empty sequences."""
    if aggregation == "token_mean":
        return mask.sum()
    return (mask.sum(dim=1) > 0).sum()


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "constant"])
@pytest.mark.parametrize("ratio", ["token", "sequence", "sequence_token"])
@pytest.mark.parametrize("clip", ["ppo", "is_weight", "none"])
def test_micro_batches_with_step_normalizer_equal_the_whole_step(aggregation, ratio, clip):
    gen = torch.Generator().manual_seed(0)
    n, t = 7, 6
    logp = -torch.rand(n, t, generator=gen, dtype=torch.float64) * 3
    old = logp + 0.3 * torch.randn(n, t, generator=gen, dtype=torch.float64)
    ref = logp + 0.3 * torch.randn(n, t, generator=gen, dtype=torch.float64)
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    lengths = torch.tensor([6, 1, 3, 0, 5, 2, 4])  # unequal lengths and one empty row
    mask = (torch.arange(t) < lengths[:, None]).long()
    kwargs = dict(ratio=ratio, clip=clip, aggregation=aggregation, max_tokens=t, ref_logprobs=ref, kl_coef=0.05)

    whole = logp.clone().requires_grad_()
    whole_loss, _ = F.policy_loss(whole, old, adv, mask, **kwargs)
    whole_loss.backward()

    parts = logp.clone().requires_grad_()
    normalizer = _step_normalizer(mask, aggregation)
    summed = torch.zeros((), dtype=torch.float64)
    for rows in (slice(0, 2), slice(2, 3), slice(3, 7)):  # unequal micro-batches
        kw = dict(kwargs, ref_logprobs=ref[rows])
        loss, _ = F.policy_loss(parts[rows], old[rows], adv[rows], mask[rows], normalizer=normalizer, **kw)
        loss.backward()  # gradient accumulation
        summed = summed + loss.detach()
    torch.testing.assert_close(summed, whole_loss.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(parts.grad, whole.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "constant"])
def test_micro_batches_of_value_and_nll_losses_equal_the_whole_step(aggregation):
    gen = torch.Generator().manual_seed(1)
    values = torch.randn(5, 4, generator=gen, dtype=torch.float64)
    old, returns = values + 0.3 * torch.randn(2, 5, 4, generator=gen, dtype=torch.float64)
    mask = (torch.arange(4) < torch.tensor([4, 2, 0, 3, 1])[:, None]).long()
    normalizer = _step_normalizer(mask, aggregation)
    options = dict(aggregation=aggregation, max_tokens=4)
    for loss_fn in (
        lambda v, rows, **kw: F.value_loss(v, old[rows], returns[rows], mask[rows], **options, **kw),
        lambda v, rows, **kw: F.nll_loss(v, mask[rows], **options, **kw),
    ):
        whole = values.clone().requires_grad_()
        whole_loss, _ = loss_fn(whole, slice(None))
        whole_loss.backward()
        parts = values.clone().requires_grad_()
        summed = sum(loss_fn(parts[rows], rows, normalizer=normalizer)[0] for rows in (slice(0, 3), slice(3, 5)))
        summed.backward()
        torch.testing.assert_close(summed.detach(), whole_loss.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(parts.grad, whole.grad, rtol=1e-12, atol=1e-12)


def test_entropy_bonus_is_minus_c_times_the_aggregated_entropy():
    entropy = torch.tensor([[0.5, 1.5, 9.0], [2.0, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    bonus = F.entropy_bonus(entropy, mask, coef=0.1, aggregation="token_mean")
    assert bonus.item() == pytest.approx(-0.1 * (0.5 + 1.5 + 2.0) / 3)
    (grad,) = torch.autograd.grad(bonus, entropy)
    assert torch.equal(grad == 0, mask == 0)  # padding gets no gradient; minimising raises the entropy
    assert (grad[mask.bool()] < 0).all()


def test_adaptive_entropy_coef_follows_skywork_or1():
    # below the target: c rises and the bonus acts; above: c falls (never below 0) and the bonus is off
    assert F.adaptive_entropy_coef(0.0, 0.1, target=0.2, step=0.005) == (0.005, True)
    assert F.adaptive_entropy_coef(0.01, 0.3, target=0.2, step=0.005) == (pytest.approx(0.005), False)
    assert F.adaptive_entropy_coef(0.002, 0.3, target=0.2, step=0.005) == (0.0, False)
    assert F.adaptive_entropy_coef(0.01, 0.2, target=0.2, step=0.005) == (pytest.approx(0.005), True)
    with pytest.raises(ValueError, match="step"):
        F.adaptive_entropy_coef(0.0, 0.1, target=0.2, step=0.0)
