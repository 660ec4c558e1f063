"""Policy losses (PPO/DAPO/CISPO/GSPO/dual clip, KL in loss), value loss, NLL, best-of-N."""

import math

import pytest
import torch

import posttrain.functional as F

RATIOS = ["token", "sequence", "sequence_token"]
CLIPS = ["ppo", "is_weight", "none"]
AGGREGATIONS = ["token_mean", "sequence_mean", "constant"]


def _one_sequence(ratios, advantages):
    """logp with the given ratios against old = 0, as one sequence [1, T]."""
    logp = torch.log(torch.tensor([ratios], dtype=torch.float64)).requires_grad_()
    return logp, torch.zeros_like(logp), torch.tensor([advantages], dtype=torch.float64)


def test_ppo_clipped_surrogate_hand_computed():
    logp, old, adv = _one_sequence([1.5, 0.5, 1.1, 0.7, 1.5], [1.0, -1.0, 1.0, -1.0, -1.0])
    loss, metrics = F.policy_loss(logp, old, adv, torch.ones(1, 5), aggregation="token_mean")
    # per token -min(rho*A, clip(rho, .8, 1.2)*A):
    #   rho 1.5 A+1: min(1.5, 1.2) -> -1.2 (clipped)     rho 0.5 A-1: min(-.5, -.8) -> .8 (clipped)
    #   rho 1.1 A+1: -1.1                                 rho 0.7 A-1: min(-.7, -.8) -> .8 (clipped)
    #   rho 1.5 A-1: min(-1.5, -1.2) -> 1.5 (unclipped branch)
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 1.1 + 0.8 + 1.5) / 5)
    assert metrics["clip_fraction"].item() == pytest.approx(3 / 5)
    assert metrics["zero_gradient_fraction"].item() == pytest.approx(3 / 5)  # PPO: a clipped token gets none
    assert metrics["ratio_mean"].item() == pytest.approx((1.5 + 0.5 + 1.1 + 0.7 + 1.5) / 5)
    assert metrics["empty_batch"].item() == 0
    loss.backward()
    # d/dlogp of -rho*A is -rho*A; clipped tokens have none
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0, -1.1 / 5, 0.0, 1.5 / 5]], dtype=torch.float64))


def test_clip_higher_and_unbounded_sides():
    logp, old, adv = _one_sequence([1.5, 0.1], [1.0, -1.0])
    mask = torch.ones(1, 2)
    dapo, _ = F.policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28, aggregation="token_mean")
    assert dapo.item() == pytest.approx((-1.28 + 0.8) / 2)  # DAPO: upper bound 1.28, lower .8
    unbounded, metrics = F.policy_loss(logp, old, adv, mask, eps_low=None, eps_high=None, aggregation="token_mean")
    assert unbounded.item() == pytest.approx((-1.5 + 0.1) / 2)
    assert metrics["clip_fraction"].item() == 0


def test_dual_clip_bounds_negative_advantages_only():
    logp, old, adv = _one_sequence([4.0, 2.0, 4.0], [-1.0, -1.0, 1.0])
    loss, metrics = F.policy_loss(logp, old, adv, torch.ones(1, 3), dual_clip=3.0, aggregation="token_mean")
    # rho 4 A-1: ppo term 4, dual clip max(-4, 3 * -1) -> 3;  rho 2 A-1: 2;  rho 4 A+1: -1.2
    assert loss.item() == pytest.approx((3.0 + 2.0 - 1.2) / 3)
    assert metrics["dual_clip_fraction"].item() == pytest.approx(1 / 3)
    assert metrics["zero_gradient_fraction"].item() == pytest.approx(2 / 3)  # the dual-clipped and the clipped
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 2.0 / 3, 0.0]], dtype=torch.float64))


def test_cispo_gradient_is_clipped_weight_times_advantage_and_survives_clipping():
    logp, old, adv = _one_sequence([1.5, 0.1, 1.1, 6.0], [1.0, -1.0, 1.0, -2.0])
    mask = torch.ones(1, 4)
    loss, metrics = F.policy_loss(
        logp, old, adv, mask, clip="is_weight", eps_low=None, eps_high=0.2, aggregation="token_mean"
    )
    loss.backward()
    # gradient -clip(rho) * A * grad(logp) / 4 with clip(rho) = min(rho, 1.2), no lower bound
    weights = torch.tensor([[1.2, 0.1, 1.1, 1.2]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, -weights * adv / 4)
    # PPO drops token 0 (rho 1.5 > 1.2, A > 0); CISPO keeps its gradient
    ppo_logp = logp.detach().clone().requires_grad_()
    ppo_loss, ppo_metrics = F.policy_loss(ppo_logp, old, adv, mask, aggregation="token_mean")
    ppo_loss.backward()
    assert ppo_logp.grad[0, 0] == 0 and logp.grad[0, 0] != 0
    assert metrics["clip_fraction"].item() == pytest.approx(2 / 4)  # weights clipped: 1.5 and 6.0
    # the share of tokens left without a gradient: PPO's rho 1.5 (A > 0) and rho 0.1 (A < 0); none of CISPO's
    assert ppo_metrics["zero_gradient_fraction"].item() == pytest.approx(2 / 4)
    assert metrics["zero_gradient_fraction"].item() == 0


def test_gspo_hand_computed():
    logp = torch.tensor([[0.1, 0.3, 0.0], [-0.001, 0.001, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv = torch.tensor([1.0, -0.5], dtype=torch.float64)
    loss, metrics = F.policy_loss(
        logp, torch.zeros_like(logp), adv, mask, ratio="sequence", eps_low=3e-4, eps_high=4e-4
    )
    # s_0 = exp(mean(.1, .3)) = exp(.2) > 1.0004 with A > 0: L_0 = -1.0004
    # s_1 = exp(0 / 3) = 1: L_1 = -(1 * -0.5) = 0.5;  loss = mean_i L_i
    assert loss.item() == pytest.approx((-1.0004 + 0.5) / 2)
    assert metrics["clip_fraction"].item() == pytest.approx(2 / 5)  # both tokens of sequence 0
    assert metrics["ratio_mean"].item() == pytest.approx((2 * math.exp(0.2) + 3 * 1.0) / 5)


def _random_batch(seed, n=5, t=6, old_noise=0.3, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(n, t, generator=gen, dtype=dtype) * 3
    old = logp + old_noise * torch.randn(n, t, generator=gen, dtype=dtype)
    ref = logp + 0.3 * torch.randn(n, t, generator=gen, dtype=dtype)
    adv = torch.randn(n, generator=gen, dtype=dtype)
    lengths = torch.randint(1, t + 1, (n,), generator=gen)
    mask = (torch.arange(t) < lengths[:, None]).long()
    return logp, old, ref, adv, mask


@pytest.mark.parametrize("advantage_shape", ["sequence", "token"])
def test_gspo_token_equals_gspo_in_value_and_gradient(advantage_shape):
    logp, old, _, adv, mask = _random_batch(0, old_noise=0.001)
    if advantage_shape == "token":
        adv = adv[:, None].expand_as(logp)
    results = []
    for ratio in ("sequence", "sequence_token"):
        x = logp.clone().requires_grad_()
        loss, metrics = F.policy_loss(x, old, adv, mask, ratio=ratio, eps_low=3e-4, eps_high=4e-4)
        loss.backward()
        results.append((loss, x.grad, metrics["clip_fraction"]))
    (gspo, gspo_grad, gspo_clip), (token, token_grad, token_clip) = results
    assert 0 < gspo_clip < 1  # some sequences clipped, some not: both branches exercised
    torch.testing.assert_close(token, gspo, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(token_grad, gspo_grad, rtol=1e-12, atol=1e-12)
    assert token_clip == gspo_clip


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("clip, dual_clip", [("ppo", None), ("ppo", 3.0), ("is_weight", None), ("none", None)])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_on_policy_gradient_is_the_reinforce_gradient(ratio, clip, dual_clip, aggregation):
    logp, _, _, _, mask = _random_batch(1)
    adv = torch.randn(logp.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    if ratio != "token":
        adv = adv[:, 0]  # sequence-level ratios take sequence advantages
    x = logp.clone().requires_grad_()
    loss, metrics = F.policy_loss(
        x, logp, adv, mask, ratio=ratio, clip=clip, dual_clip=dual_clip, aggregation=aggregation, max_tokens=6
    )
    loss.backward()
    y = logp.clone().requires_grad_()
    adv_NT = adv if adv.dim() == 2 else adv[:, None].expand_as(y)
    F.aggregate(-adv_NT * y, mask, aggregation, max_tokens=6).backward()  # REINFORCE: -A * logp
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-12, atol=1e-12)
    assert metrics["clip_fraction"] == 0 and metrics["ratio_mean"] == 1


def test_kl_in_loss_hand_computed():
    logp = torch.tensor([[-1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-0.5, -1.5]], dtype=torch.float64)
    loss, metrics = F.policy_loss(
        logp, logp.detach(), torch.zeros(1), torch.ones(1, 2), ref_logprobs=ref, kl_coef=0.04
    )
    # A = 0: only the KL term.  d = ref - logp = [.5, -.5]; k3 = exp(d) - d - 1
    k3 = [math.exp(0.5) - 1.5, math.exp(-0.5) - 0.5]
    assert metrics["kl"].item() == pytest.approx(sum(k3) / 2)
    assert loss.item() == pytest.approx(0.04 * sum(k3) / 2)
    assert metrics["policy_loss"].item() == 0
    loss.backward()
    # d k3 / d logp = 1 - exp(d)
    expected = torch.tensor([[1 - math.exp(0.5), 1 - math.exp(-0.5)]], dtype=torch.float64) * 0.04 / 2
    torch.testing.assert_close(logp.grad, expected)


def test_constant_aggregation_hand_computed():
    logp = torch.zeros(2, 3, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    loss, _ = F.policy_loss(logp, logp, torch.tensor([1.0, 2.0]), mask, aggregation="constant", max_tokens=4)
    # rho = 1: L = -A per token; (1/2) * (-3*1 / 4 + -1*2 / 4) = -0.625
    assert loss.item() == pytest.approx(-0.625)


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("clip", CLIPS)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_padding_changes_nothing(ratio, clip, aggregation):
    logp, old, ref, adv, mask = _random_batch(3)
    adv_NT = adv[:, None].expand_as(logp).clone()
    pad = ~mask.bool()
    outputs = []
    for garbage in (0.0, 1e9, -float("inf"), float("nan")):
        x = logp.masked_fill(pad, garbage).requires_grad_()
        dirty = [t.masked_fill(pad, garbage) for t in (old, ref, adv_NT)]
        loss, metrics = F.policy_loss(
            x, dirty[0], dirty[2], mask, ratio=ratio, clip=clip, aggregation=aggregation,
            max_tokens=6, ref_logprobs=dirty[1], kl_coef=0.1,
        )
        loss.backward()
        outputs.append((loss, x.grad, metrics))
    for loss, grad, metrics in outputs[1:]:
        assert torch.equal(loss, outputs[0][0])
        assert torch.equal(grad, outputs[0][1])
        assert {k: v.item() for k, v in metrics.items()} == {k: v.item() for k, v in outputs[0][2].items()}
    assert (outputs[-1][1][pad] == 0).all()


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_empty_batch_gives_zero_loss_with_zero_gradient(ratio, aggregation):
    logp = torch.full((2, 3), -1.0, requires_grad=True)
    loss, metrics = F.policy_loss(
        logp, torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3), ratio=ratio, aggregation=aggregation, max_tokens=3
    )
    assert loss.requires_grad and loss.item() == 0
    assert metrics["empty_batch"].item() == 1 and metrics["clip_fraction"].item() == 0
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros(2, 3))


def test_metrics_are_detached_zero_dim_tensors():
    logp, old, ref, adv, mask = _random_batch(4)
    _, metrics = F.policy_loss(logp.requires_grad_(), old, adv, mask, ref_logprobs=ref, dual_clip=3.0)
    assert set(metrics) == {"policy_loss", "clip_fraction", "ratio_mean", "empty_batch", "kl", "dual_clip_fraction",
                            "zero_gradient_fraction"}
    for value in metrics.values():
        assert isinstance(value, torch.Tensor) and value.dim() == 0 and not value.requires_grad


def test_bfloat16_inputs_are_computed_in_float32():
    logp, old, _, adv, mask = _random_batch(5, dtype=torch.float32)
    x = logp.to(torch.bfloat16).requires_grad_()
    loss, _ = F.policy_loss(x, old.to(torch.bfloat16), adv, mask, ratio="sequence", eps_low=3e-4, eps_high=4e-4)
    loss.backward()
    assert loss.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    reference, _ = F.policy_loss(
        logp.to(torch.bfloat16).float(), old.to(torch.bfloat16).float(), adv, mask,
        ratio="sequence", eps_low=3e-4, eps_high=4e-4,
    )
    assert loss.item() == reference.item()


def test_policy_loss_rejects_bad_arguments():
    z, m = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="'token', 'sequence', 'sequence_token'"):
        F.policy_loss(z, z, torch.zeros(2), m, ratio="seq")
    with pytest.raises(ValueError, match="'ppo', 'is_weight', 'none'"):
        F.policy_loss(z, z, torch.zeros(2), m, clip="cispo")
    with pytest.raises(ValueError, match="'k1', 'k2', 'k3'"):
        F.policy_loss(z, z, torch.zeros(2), m, kl_estimator="k4")
    with pytest.raises(ValueError, match="eps_high=-0.1 is negative"):
        F.policy_loss(z, z, torch.zeros(2), m, eps_high=-0.1)
    with pytest.raises(ValueError, match=r"advantages has shape \[3\] but logprobs has shape \[2, 3\]"):
        F.policy_loss(z, z, torch.zeros(3), m)
    with pytest.raises(ValueError, match=r"old_logprobs has shape \[2, 2\] but logprobs has shape \[2, 3\]"):
        F.policy_loss(z, z[:, :2], torch.zeros(2), m)
    with pytest.raises(ValueError, match="dual_clip"):
        F.policy_loss(z, z, torch.zeros(2), m, dual_clip=0.5)
    with pytest.raises(ValueError, match="dual_clip"):
        F.policy_loss(z, z, torch.zeros(2), m, clip="is_weight", dual_clip=3.0)
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        F.policy_loss(z, z, torch.zeros(2), m, kl_coef=0.1)
    with pytest.raises(ValueError, match="max_tokens"):
        F.policy_loss(z, z, torch.zeros(2), m, aggregation="constant")


def test_value_loss_hand_computed():
    values = torch.tensor([[1.0, 2.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[0.5, 2.0]], dtype=torch.float64)
    returns = torch.tensor([[2.0, 1.0]], dtype=torch.float64)
    loss, metrics = F.value_loss(values, old, returns, torch.ones(1, 2), clip=0.2)
    # token 0: (1 - 2)^2 = 1 vs clipped V = .5 + .2 = .7: (.7 - 2)^2 = 1.69 -> .5 * 1.69 = .845
    # token 1: (2 - 1)^2 = 1, V within the clip range -> .5;  sequence mean (.845 + .5) / 2
    assert loss.item() == pytest.approx((0.845 + 0.5) / 2)
    assert metrics["value_clip_fraction"].item() == pytest.approx(0.5)
    # R = [2, 1]: Var[R] = .25, R - V = [1, -1]: Var = 1 -> 1 - 1 / .25 = -3
    assert metrics["explained_variance"].item() == pytest.approx(-3.0)
    loss.backward()
    # token 0 is on the clipped (constant) branch; token 1: (V - R) / 2 tokens = .5
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 0.5]], dtype=torch.float64))


def test_value_loss_without_clip_and_perfect_values():
    returns = torch.tensor([[1.0, 2.0, 3.0]])
    loss, metrics = F.value_loss(returns, returns - 5, returns, torch.ones(1, 3), clip=None)
    assert loss.item() == 0 and metrics["explained_variance"].item() == 1


def test_nll_loss_hand_computed():
    logp = torch.tensor([[-1.0, -2.0], [-3.0, 1e9]])
    mask = torch.tensor([[1, 1], [1, 0]])
    assert F.nll_loss(logp, mask)[0].item() == pytest.approx(6 / 3)  # token mean
    loss, metrics = F.nll_loss(logp, mask, aggregation="sequence_mean")
    assert loss.item() == pytest.approx((1.5 + 3.0) / 2)
    assert metrics["nll"].item() == pytest.approx(2.25) and metrics["empty_batch"].item() == 0


def test_best_of_n_takes_the_first_best_and_filters_by_min_reward():
    rewards = torch.tensor([[0.0, 1.0, 1.0], [0.2, 0.1, 0.0], [0.5, 0.5, 0.5]])
    index, keep = F.best_of_n(rewards)
    assert index.tolist() == [1, 0, 0] and index.dtype == torch.long
    assert keep.tolist() == [True, True, True]
    _, keep = F.best_of_n(rewards, min_reward=0.5)
    assert keep.tolist() == [True, False, True]
    _, keep = F.best_of_n(rewards, skip_ties=True)  # the third group's samples all tie: no best among them
    assert keep.tolist() == [True, True, False]
    _, keep = F.best_of_n(rewards, min_reward=0.5, skip_ties=True)
    assert keep.tolist() == [True, False, False]
    _, keep = F.best_of_n(rewards[:, :1], skip_ties=True)  # groups of one (already selected): no tie to skip
    assert keep.tolist() == [True, True, True]
