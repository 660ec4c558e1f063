"""Advantage estimators, returns, GAE, whitening, KL-shaped rewards, REINFORCE++."""

import math

import pytest
import torch

import posttrain.functional as F


def test_group_advantage_hand_computed():
    # rewards [1, 0, 0, 1]: mean 0.5, unbiased var (4 * 0.25) / 3 = 1/3, std sqrt(1/3)
    adv = F.advantages("group", torch.tensor([[1.0, 0.0, 0.0, 1.0]]))
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)  # 0.866024...
    torch.testing.assert_close(adv, torch.tensor([[a, -a, -a, a]]))
    assert a == pytest.approx(0.866024, abs=1e-6)


def test_group_mean_and_rloo_hand_computed():
    rewards = torch.tensor([[3.0, 1.0, 2.0]])
    # mean 2 -> [1, -1, 0]
    torch.testing.assert_close(F.advantages("group_mean", rewards), torch.tensor([[1.0, -1.0, 0.0]]))
    # leave-one-out: 3 - (1+2)/2 = 1.5, 1 - (3+2)/2 = -1.5, 2 - (3+1)/2 = 0
    torch.testing.assert_close(F.advantages("rloo", rewards), torch.tensor([[1.5, -1.5, 0.0]]))


def test_greedy_baseline_hand_computed():
    rewards = torch.tensor([[1.0, 0.0], [0.5, 1.0]])
    adv = F.advantages("greedy_baseline", rewards, baseline=torch.tensor([0.5, 1.0]))
    torch.testing.assert_close(adv, torch.tensor([[0.5, -0.5], [-0.5, 0.0]]))
    # ReMax needs no group: G = 1 is fine
    torch.testing.assert_close(
        F.advantages("greedy_baseline", torch.tensor([[2.0]]), baseline=torch.tensor([0.5])), torch.tensor([[1.5]])
    )


@pytest.mark.parametrize("estimator", ["group", "group_mean", "rloo"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_equal_rewards_give_exactly_zero_advantage(estimator, dtype):
    # 0.1 and 1e8 + 0.3 are not exactly representable: a naive mean leaves rounding noise
    rewards = torch.tensor([[0.1] * 3, [1e8 + 0.3] * 3, [-1.0] * 3, [0.0, 1.0, 1.0]], dtype=dtype)
    adv = F.advantages(estimator, rewards, eps=0.0)
    assert torch.isfinite(adv).all()
    assert (adv[:3] == 0).all()
    assert (adv[3] != 0).all()


@pytest.mark.parametrize("estimator", ["group", "group_mean", "rloo"])
def test_group_of_one_is_a_clear_error(estimator):
    with pytest.raises(ValueError, match=r"G >= 2.*greedy_baseline"):
        F.advantages(estimator, torch.tensor([[1.0], [0.0]]))


def test_advantages_rejects_bad_arguments():
    with pytest.raises(ValueError, match="'group', 'group_mean', 'group_batch_std', 'rloo', 'maxrl', 'greedy_baseline'"):
        F.advantages("grpo", torch.zeros(2, 2))
    with pytest.raises(ValueError, match="baseline="):
        F.advantages("greedy_baseline", torch.zeros(2, 2))
    with pytest.raises(ValueError, match="baseline is used only by 'greedy_baseline'"):
        F.advantages("group", torch.zeros(2, 2), baseline=torch.zeros(2))
    with pytest.raises(ValueError, match=r"baseline has shape \[3\] but rewards has shape \[2, 2\]"):
        F.advantages("greedy_baseline", torch.zeros(2, 2), baseline=torch.zeros(3))
    with pytest.raises(ValueError, match="eps=-1e-06 is negative"):
        F.advantages("group", torch.zeros(2, 2), eps=-1e-6)
    with pytest.raises(ValueError, match=r"\[B, G\]"):
        F.advantages("group", torch.zeros(4))


def test_discounted_returns_hand_computed():
    rewards = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 100.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # row 0: [1 + .5*2 + .25*3, 2 + .5*3, 3] = [2.75, 3.5, 3]; row 1 ignores the padded 100
    expected = torch.tensor([[2.75, 3.5, 3.0], [2.0, 2.0, 0.0]])
    torch.testing.assert_close(F.discounted_returns(rewards, mask, gamma=0.5), expected)
    # gamma = 1: plain reward-to-go
    torch.testing.assert_close(F.discounted_returns(rewards, mask), torch.tensor([[6.0, 5.0, 3.0], [3.0, 2.0, 0.0]]))


def test_gae_hand_computed():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 9.0]])
    values = torch.tensor([[0.5, 0.6, 0.7], [0.5, 0.6, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, returns = F.gae(rewards, values, mask, gamma=1.0, lam=0.5)
    # row 0: delta = [0 + .6 - .5, 0 + .7 - .6, 1 + 0 - .7] = [.1, .1, .3]
    #        A_2 = .3, A_1 = .1 + .5 * .3 = .25, A_0 = .1 + .5 * .25 = .225
    # row 1: V after the last token is 0: delta = [.1, 1 - .6 = .4], A = [.1 + .5 * .4, .4] = [.3, .4]
    torch.testing.assert_close(adv, torch.tensor([[0.225, 0.25, 0.3], [0.3, 0.4, 0.0]]))
    torch.testing.assert_close(returns, torch.tensor([[0.725, 0.85, 1.0], [0.8, 1.0, 0.0]]))


def test_gae_with_discount_hand_computed():
    rewards, values, mask = torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.6]]), torch.ones(1, 2)
    adv, _ = F.gae(rewards, values, mask, gamma=0.9, lam=0.95)
    # delta_1 = 1 - .6 = .4; delta_0 = 0 + .9 * .6 - .5 = .04; A_0 = .04 + .9 * .95 * .4 = .382
    torch.testing.assert_close(adv, torch.tensor([[0.382, 0.4]]))


def test_gae_with_lambda_one_gamma_one_is_returns_minus_values():
    gen = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(2, 4, 7, generator=gen, dtype=torch.float64)
    mask = (torch.arange(7) < torch.tensor([7, 3, 1, 0])[:, None]).long()
    adv, returns = F.gae(rewards, values, mask, gamma=1.0, lam=1.0)
    reward_to_go = F.discounted_returns(rewards, mask, gamma=1.0)
    torch.testing.assert_close(adv, torch.where(mask.bool(), reward_to_go - values, 0.0))
    torch.testing.assert_close(returns, reward_to_go)


def test_gae_rejects_out_of_range_lambda():
    with pytest.raises(ValueError, match=r"lam=1.5 must lie in \[0, 1\]"):
        F.gae(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), lam=1.5)


def test_whiten_hand_computed_and_zero_at_padding():
    x = torch.tensor([[1.0, 2.0], [3.0, 50.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    # valid [1, 2, 3]: mean 2, unbiased std 1
    torch.testing.assert_close(F.whiten(x, mask), torch.tensor([[-1.0, 0.0], [1.0, 0.0]]) / (1 + 1e-6))


def test_whiten_gives_mean_zero_std_one_over_valid_tokens():
    gen = torch.Generator().manual_seed(0)
    x = 3 + 5 * torch.randn(6, 9, generator=gen, dtype=torch.float64)
    mask = (torch.arange(9) < torch.tensor([9, 4, 1, 0, 7, 2])[:, None]).long()
    y = F.whiten(x, mask, eps=0.0)
    valid = y[mask.bool()]
    assert valid.mean().item() == pytest.approx(0.0, abs=1e-12)
    assert valid.std().item() == pytest.approx(1.0, abs=1e-12)
    assert (y[~mask.bool()] == 0).all()


def test_whiten_of_constant_values_is_zero_with_finite_gradient():
    x = torch.full((2, 3), 0.1, requires_grad=True)
    y = F.whiten(x, torch.ones(2, 3), eps=0.0)
    y.sum().backward()
    assert torch.isfinite(y).all() and y.abs().max() < 1e-3
    assert torch.isfinite(x.grad).all()


def test_kl_shaped_rewards_hand_computed():
    logp = torch.tensor([[-1.0, -2.0, -1.0], [-0.5, -0.5, 7.0], [3.0, 3.0, 3.0]])
    ref = torch.tensor([[-1.5, -1.0, -1.0], [-0.5, -1.5, 7.0], [3.0, 3.0, 3.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    rewards = torch.tensor([1.0, -1.0, 5.0])
    out = F.kl_shaped_rewards(rewards, logp, ref, mask, kl_coef=0.1)
    # k1 = logp - ref: row 0 [.5, -1, 0], row 1 [0, 1]; token reward -0.1 * k1, reward at the last token
    expected = torch.tensor([[-0.05, 0.1, 0.0 + 1.0], [0.0, -0.1 - 1.0, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(out, expected)


def test_kl_shaped_rewards_with_k3_estimator():
    logp, ref, mask = torch.tensor([[-1.0]]), torch.tensor([[-1.5]]), torch.ones(1, 1)
    out = F.kl_shaped_rewards(torch.tensor([0.0]), logp, ref, mask, kl_coef=1.0, estimator="k3")
    torch.testing.assert_close(out, torch.tensor([[-(math.exp(-0.5) + 0.5 - 1)]]))


def test_reinforce_pp_hand_computed():
    rewards = torch.tensor([1.0, 0.0])
    logp = torch.zeros(2, 2)
    mask = torch.ones(2, 2)
    # no KL: token rewards [[0, 1], [0, 0]], returns [[1, 1], [0, 0]]: mean .5, std sqrt(1/3)
    adv = F.reinforce_pp_advantages(rewards, logp, logp, mask, kl_coef=0.1)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    torch.testing.assert_close(adv, torch.tensor([[a, a], [-a, -a]]))


def test_reinforce_pp_baseline_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 3.0, 3.0])
    logp = torch.zeros(4, 1)
    mask = torch.ones(4, 1)
    # group means .5 and 3: centred [.5, -.5, 0, 0]; var (.25 + .25) / 3 = 1/6
    adv = F.reinforce_pp_advantages(rewards, logp, logp, mask, kl_coef=0.0, baseline=True, group_size=2)
    a = 0.5 / (math.sqrt(1 / 6) + 1e-6)  # 1.224742...
    torch.testing.assert_close(adv, torch.tensor([[a], [-a], [0.0], [0.0]]))


def test_reinforce_pp_rejects_bad_group_arguments():
    z = torch.zeros(4, 1)
    with pytest.raises(ValueError, match="needs group_size"):
        F.reinforce_pp_advantages(torch.zeros(4), z, z, z, kl_coef=0.0, baseline=True)
    with pytest.raises(ValueError, match="group_size >= 2"):
        F.reinforce_pp_advantages(torch.zeros(4), z, z, z, kl_coef=0.0, baseline=True, group_size=1)
    with pytest.raises(ValueError, match="not a multiple of group_size=3"):
        F.reinforce_pp_advantages(torch.zeros(4), z, z, z, kl_coef=0.0, baseline=True, group_size=3)
    with pytest.raises(ValueError, match="only with baseline=True"):
        F.reinforce_pp_advantages(torch.zeros(4), z, z, z, kl_coef=0.0, group_size=2)
    with pytest.raises(ValueError, match="kl_coef=-0.1 is negative"):
        F.reinforce_pp_advantages(torch.zeros(4), z, z, z, kl_coef=-0.1)


def test_group_batch_std_by_hand():
    # Lite PPO: group means 1 and 2.5; the batch's unbiased std of [0, 2, 1, 4] is sqrt(35/12)
    rewards = torch.tensor([[0.0, 2.0], [1.0, 4.0]], dtype=torch.float64)
    std = math.sqrt(35 / 12)
    expected = torch.tensor([[-1.0, 1.0], [-1.5, 1.5]], dtype=torch.float64) / (std + 1e-6)
    torch.testing.assert_close(F.advantages("group_batch_std", rewards, eps=1e-6), expected)


def test_group_batch_std_is_trls_scale_rewards_batch():
    """TRL's GRPOTrainer with scale_rewards='batch': (r - group mean) / (nanstd of every reward + eps), with TRL's
    own nanstd."""
    nanstd = pytest.importorskip("trl.trainer.utils").nanstd
    torch.manual_seed(0)
    rewards = torch.randn(5, 4, dtype=torch.float64)
    flat = rewards.flatten()
    trl_style = (flat - rewards.mean(1).repeat_interleave(4)) / (nanstd(flat) + 1e-4)
    ours = F.advantages("group_batch_std", rewards, eps=1e-4)
    torch.testing.assert_close(ours.flatten(), trl_style)


def test_group_batch_std_keeps_a_constant_group_at_zero_and_only_scales_grpo_s_centring():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 5.0]])
    out = F.advantages("group_batch_std", rewards)
    assert (out[0] == 0).all()
    centred = F.advantages("group_mean", rewards)
    torch.testing.assert_close(out, centred / (rewards.std() + 1e-6))


# --- GDPO ------------------------------------------------------------------------------------


def test_gdpo_by_hand():
    # two prompts x two samples x two rewards; every group normalises each reward to -+1/sqrt(2)
    terms = torch.tensor([[[1.0, 0.0], [0.0, 2.0]], [[3.0, 5.0], [1.0, 5.0]]], dtype=torch.float64)
    weights = torch.tensor([1.0, 0.5], dtype=torch.float64)
    r = 1 / math.sqrt(2)  # (x - mean) / unbiased std for two distinct values
    summed = torch.tensor([[r - 0.5 * r, -r + 0.5 * r], [r + 0.0, -r + 0.0]], dtype=torch.float64)
    expected = (summed - summed.mean()) / (summed.std() + 1e-6)
    torch.testing.assert_close(F.gdpo_advantages(terms, weights, eps=1e-6), expected, rtol=1e-5, atol=1e-5)


def test_gdpo_with_one_reward_is_grpo_normalised_over_the_batch():
    torch.manual_seed(0)
    rewards = torch.randn(6, 4, dtype=torch.float64)
    grpo = F.advantages("group", rewards)
    expected = (grpo - grpo.mean()) / (grpo.std() + 1e-6)
    torch.testing.assert_close(F.gdpo_advantages(rewards[..., None], torch.ones(1, dtype=torch.float64)), expected)


def test_gdpo_leaves_a_reward_that_does_not_apply_out_of_its_group():
    terms = torch.tensor([[[1.0, float("nan")], [0.0, 4.0], [0.0, 2.0]]])
    out = F.gdpo_advantages(terms, torch.ones(2))
    assert torch.isfinite(out).all()
    alone = F.gdpo_advantages(torch.tensor([[[1.0, 0.0], [0.0, 1.0], [0.0, -1.0]]]), torch.ones(2))
    # the second reward's group statistics come from the two samples it applies to: +-1/sqrt(2)
    assert out[0, 0] > out[0, 2] and alone.shape == out.shape


@pytest.mark.parametrize("seed", range(3))
def test_gdpo_matches_a_naive_float64_reference(seed):
    """Plain Python over groups, samples and reward functions, NaN where a reward does not apply."""
    g = torch.Generator().manual_seed(seed)
    terms = torch.randn(4, 5, 3, generator=g, dtype=torch.float64)
    terms[torch.rand(4, 5, 3, generator=g) < 0.2] = float("nan")
    terms[1, :, 2] = 0.5  # a reward equal across a group: no signal from it there
    weights = [1.0, 0.5, 2.0]

    def std(values):  # unbiased
        mean = sum(values) / len(values)
        return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))

    summed = []
    for b in range(4):
        for i in range(5):
            total = 0.0
            for k in range(3):
                present = [float(terms[b, j, k]) for j in range(5) if not math.isnan(terms[b, j, k])]
                value = float(terms[b, i, k])
                if math.isnan(value) or len(present) < 2:
                    continue
                total += weights[k] * (value - sum(present) / len(present)) / (std(present) + 1e-6)
            summed.append(total)
    mean = sum(summed) / len(summed)
    expected = torch.tensor([(a - mean) / (std(summed) + 1e-6) for a in summed], dtype=torch.float64).reshape(4, 5)
    torch.testing.assert_close(F.gdpo_advantages(terms, torch.tensor(weights, dtype=torch.float64), eps=1e-6),
                               expected, rtol=1e-10, atol=1e-12)


def test_gdpo_rejects_mismatched_weights():
    with pytest.raises(ValueError, match="one weight per function"):
        F.gdpo_advantages(torch.zeros(2, 2, 3), torch.ones(2))


def test_gdpo_is_verls():
    from peers import verl_config, verl_core_algos

    core = verl_core_algos()
    if core is None:
        pytest.skip("verl not installed (scripts/setup.sh installs it with --no-deps)")
    import numpy as np

    torch.manual_seed(3)
    b, g = 5, 4
    terms = torch.randint(0, 3, (b, g, 2)).double()
    weights = [1.0, 0.3]
    response_mask = torch.ones(b * g, 1)  # one response token each: verl whitens over tokens, ours over samples
    batch = {"prompts": torch.zeros(b * g, 2), "attention_mask": torch.ones(b * g, 3, dtype=torch.long)}
    non_tensor = {"format": terms[..., 0].flatten().numpy(), "answer": terms[..., 1].flatten().numpy()}
    config = verl_config(gdpo_reward_keys=["format", "answer"], gdpo_reward_weights=weights)
    theirs, _ = core.compute_gdpo_outcome_advantage(
        token_level_rewards=torch.zeros(b * g, 1), response_mask=response_mask,
        index=np.repeat(np.arange(b), g), epsilon=1e-6, config=config, non_tensor_batch=non_tensor, batch=batch)
    ours = F.gdpo_advantages(terms, torch.tensor(weights, dtype=torch.float64))
    torch.testing.assert_close(ours.flatten().float(), theirs[:, 0].float(), rtol=1e-4, atol=1e-5)


def test_maxrl_divides_by_the_pass_rate():
    """Binary rewards, K of G correct: A = G r / K - 1. Group 0: 1 of 4 -> [3, -1, -1, -1]; group 1: 3 of 4 ->
    [1/3, 1/3, 1/3, -1]; all-wrong and all-right groups -> 0."""
    rewards = torch.tensor([[1.0, 0, 0, 0], [1, 1, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1]])
    torch.testing.assert_close(F.advantages("maxrl", rewards, eps=0.0),
                               torch.tensor([[3.0, -1, -1, -1], [1 / 3, 1 / 3, -1, 1 / 3], [0, 0, 0, 0], [0, 0, 0, 0]]))
    # the sum over a group's correct samples is G - K... and its advantages sum to 0, as GRPO's do
    torch.testing.assert_close(F.advantages("maxrl", rewards).sum(1), torch.zeros(4), atol=1e-5, rtol=0)
    # graded rewards: mean 0.5 -> (r - 0.5) / 0.5
    torch.testing.assert_close(F.advantages("maxrl", torch.tensor([[0.25, 0.75]]), eps=0.0), torch.tensor([[-0.5, 0.5]]))
    with pytest.raises(ValueError, match=r"rewards >= 0 .* reward -1 at \[0, 1\]"):
        F.advantages("maxrl", torch.tensor([[1.0, -1.0]]))


def test_maxrl_weighs_a_hard_prompt_by_its_inverse_pass_rate_where_grpo_weighs_by_its_std():
    """The summed weight on the correct samples: MaxRL G - K (per correct sample G/K - 1); GRPO's is K (1 - p) / std."""
    hard, easy = torch.tensor([[1.0] + [0.0] * 7]), torch.tensor([[1.0] * 7 + [0.0]])
    maxrl = [F.advantages("maxrl", r, eps=0.0)[0, 0].item() for r in (hard, easy)]
    grpo = [F.advantages("group", r, eps=0.0)[0, 0].item() for r in (hard, easy)]
    assert maxrl[0] / maxrl[1] == pytest.approx(7 / (1 / 7))  # (8/1 - 1) / (8/7 - 1) = 49
    assert grpo[0] / grpo[1] == pytest.approx(7.0)  # (7/8) / (1/8): GRPO favours the hard prompt 7x, MaxRL 49x
