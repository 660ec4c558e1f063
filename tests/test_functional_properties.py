"""Hypothesis properties: finite inputs give finite losses and gradients; padding changes nothing."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import posttrain.functional as F

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True)

CLIP_CHOICES = [("ppo", None), ("ppo", 3.0), ("is_weight", None), ("none", None)]
EPS_CHOICES = [(0.2, 0.2), (0.2, 0.28), (None, 4.0), (3e-4, 4e-4), (None, None), (0.0, 0.0)]


@st.composite
def policy_batches(draw):
    n, t = draw(st.integers(1, 4)), draw(st.integers(1, 5))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))

    def tensor(low, high, shape):
        values = draw(st.lists(st.floats(low, high, width=32), min_size=n * t, max_size=n * t))
        return torch.tensor(values, dtype=dtype)[: shape[0] * (shape[1] if len(shape) > 1 else 1)].reshape(shape)

    logp, old, ref = (tensor(-30.0, 0.0, (n, t)) for _ in range(3))  # valid log-probabilities
    per_token = draw(st.booleans())
    adv = tensor(-10.0, 10.0, (n, t) if per_token else (n,))
    lengths = torch.tensor(draw(st.lists(st.integers(0, t), min_size=n, max_size=n)))
    mask = (torch.arange(t) < lengths[:, None]).long()
    clip, dual_clip = draw(st.sampled_from(CLIP_CHOICES))
    eps_low, eps_high = draw(st.sampled_from(EPS_CHOICES))
    options = dict(
        ratio=draw(st.sampled_from(["token", "sequence", "sequence_token"])),
        clip=clip, dual_clip=dual_clip, eps_low=eps_low, eps_high=eps_high,
        aggregation=draw(st.sampled_from(["token_mean", "sequence_mean", "constant"])),
        max_tokens=t,
        kl_coef=draw(st.sampled_from([0.0, 0.04])),
        kl_estimator=draw(st.sampled_from(["k1", "k2", "k3"])),
    )
    return logp, old, ref, adv, mask, options


@SETTINGS
@given(policy_batches())
def test_policy_loss_is_finite_for_finite_inputs(batch):
    logp, old, ref, adv, mask, options = batch
    x = logp.clone().requires_grad_()
    loss, metrics = F.policy_loss(x, old, adv, mask, ref_logprobs=ref, **options)
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(x.grad).all()
    assert all(torch.isfinite(v) for v in metrics.values())


@SETTINGS
@given(policy_batches(), st.sampled_from([1e9, -1e9, float("inf"), -float("inf"), float("nan")]))
def test_policy_loss_padding_changes_nothing(batch, garbage):
    logp, old, ref, adv, mask, options = batch
    pad = ~mask.bool()
    if adv.dim() == 2:
        adv = adv.masked_fill(pad, 0.0)
    results = []
    for fill in (0.0, garbage):
        x = logp.masked_fill(pad, fill).requires_grad_()
        dirty_adv = adv.masked_fill(pad, fill) if adv.dim() == 2 else adv
        loss, metrics = F.policy_loss(
            x, old.masked_fill(pad, fill), dirty_adv, mask, ref_logprobs=ref.masked_fill(pad, fill), **options
        )
        loss.backward()
        results.append((loss, x.grad, metrics))
    (clean_loss, clean_grad, clean_metrics), (loss, grad, metrics) = results
    assert torch.equal(loss, clean_loss)
    assert torch.equal(grad, clean_grad)
    assert all(torch.equal(metrics[k], clean_metrics[k]) for k in metrics)


@SETTINGS
@given(
    st.lists(st.floats(-1e6, 1e6), min_size=2, max_size=8),
    st.sampled_from(["group", "group_mean", "rloo"]),
    st.floats(0.0, 1e-3),
)
def test_group_advantages_are_finite_and_zero_for_constant_groups(rewards, estimator, eps):
    rewards_BG = torch.tensor([rewards, [rewards[0]] * len(rewards)], dtype=torch.float64)
    adv = F.advantages(estimator, rewards_BG, eps=eps)
    assert torch.isfinite(adv).all()
    assert (adv[1] == 0).all()




@st.composite
def preference_batches(draw):
    b = draw(st.integers(1, 4))
    logps = [torch.tensor(draw(st.lists(st.floats(-1000.0, 0.0), min_size=b, max_size=b)), dtype=torch.float64)
             for _ in range(4)]
    lengths = [torch.tensor(draw(st.lists(st.integers(1, 200), min_size=b, max_size=b))) for _ in range(2)]
    return logps, lengths, torch.tensor(draw(st.lists(st.booleans(), min_size=b, max_size=b)))


def _assert_finite_loss_and_grads(loss, inputs):
    loss.backward()
    assert torch.isfinite(loss)
    for x in inputs:  # every input reaches the loss: a missing gradient is a detached input, not a pass
        assert x.grad is not None and torch.isfinite(x.grad).all()


@SETTINGS
@given(preference_batches(), st.floats(1e-3, 10.0), st.floats(0.0, 0.5), st.floats(-5.0, 5.0))
def test_preference_losses_are_finite_for_finite_inputs(batch, beta, smoothing, gamma):
    (pi_w, pi_l, ref_w, ref_l), (len_w, len_l), desirable = batch
    inputs = [x.clone().requires_grad_() for x in (pi_w, pi_l)]
    losses = [
        F.dpo_loss(*inputs, ref_w, ref_l, beta=beta, label_smoothing=smoothing)[0],
        F.dpo_loss(*inputs, ref_w, ref_l, beta=beta, offset=ref_w)[0],
        F.simpo_loss(*inputs, len_w, len_l, beta=beta, gamma=gamma)[0],
        F.orpo_loss(*inputs, len_w, len_l, lam=beta)[0],
        F.kto_loss(inputs[0], ref_w, desirable, inputs[1], ref_l, beta=beta)[0],
    ]
    _assert_finite_loss_and_grads(sum(losses), inputs)


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "constant"])
@SETTINGS
@given(st.lists(st.floats(-1e3, 1e3), min_size=12, max_size=12), st.lists(st.integers(0, 4), min_size=3, max_size=3))
def test_value_and_nll_losses_are_finite(aggregation, values, lengths):
    v, old, returns = torch.tensor(values, dtype=torch.float64).reshape(3, 4), torch.zeros(3, 4), torch.ones(3, 4)
    mask = (torch.arange(4) < torch.tensor(lengths)[:, None]).long()
    x = v.clone().requires_grad_()
    loss = F.value_loss(x, old, returns, mask, aggregation=aggregation, max_tokens=4)[0]
    loss = loss + F.nll_loss(x.clamp(max=0), mask, aggregation=aggregation, max_tokens=4)[0]
    _assert_finite_loss_and_grads(loss, [x])
