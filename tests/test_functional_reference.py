"""posttrain.functional against an independent float64 reference written from ALGORITHMS.md.

The reference is deliberately naive: Python loops over i and t, scalar tensor
arithmetic, no masking tricks, no shared code with the library. Values and
gradients (by autograd through the loops) must agree to 1e-6 on random cases.
"""

import itertools
import math

import pytest
import torch

import posttrain.functional as F

TOL = dict(rtol=1e-6, atol=1e-6)
f64 = torch.float64


def scalar(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=f64)


# ---------------------------------------------------------------- reference code


def ref_kl(logp, ref, estimator):
    d = ref - logp
    return {"k1": -d, "k2": d * d / 2, "k3": torch.exp(d) - d - 1}[estimator]


def ref_clip(w, low, high):
    if high is not None and w > high:
        return scalar(high)
    if low is not None and w < low:
        return scalar(low)
    return w


def ref_token_loss(w, logp_t, a, clip, eps_low, eps_high, dual_clip):
    low = None if eps_low is None else 1 - eps_low
    high = None if eps_high is None else 1 + eps_high
    if clip == "ppo":
        unclipped, clipped = w * a, ref_clip(w, low, high) * a
        inner = unclipped if unclipped <= clipped else clipped  # min
        if dual_clip is not None and a < 0:
            return -(inner if inner >= dual_clip * a else dual_clip * a)  # -max(inner, c*A)
        return -inner
    if clip == "is_weight":
        return -ref_clip(w, low, high).detach() * a * logp_t
    return -w * a


def ref_policy_loss(logp, old, adv, mask, ratio, clip, eps_low, eps_high, dual_clip, aggregation,
                    max_tokens, ref, kl_coef, kl_estimator):
    n, t_len = logp.shape
    per_sequence_sums, per_sequence_lengths = [], []
    for i in range(n):
        tokens = [t for t in range(t_len) if mask[i, t]]
        if tokens:
            log_s = sum(logp[i, t] - old[i, t] for t in tokens) / len(tokens)
        total = scalar(0.0)
        for t in tokens:
            a = adv[i] if adv.dim() == 1 else adv[i, t]
            if ratio == "token":
                w = torch.exp(logp[i, t] - old[i, t])
            elif ratio == "sequence":
                w = torch.exp(log_s)
            else:
                w = torch.exp(log_s.detach()) * torch.exp(logp[i, t] - logp[i, t].detach())
            loss = ref_token_loss(w, logp[i, t], a, clip, eps_low, eps_high, dual_clip)
            if kl_coef:
                loss = loss + kl_coef * ref_kl(logp[i, t], ref[i, t], kl_estimator)
            total = total + loss
        per_sequence_sums.append(total)
        per_sequence_lengths.append(len(tokens))
    non_empty = [i for i in range(n) if per_sequence_lengths[i] > 0]
    if not non_empty:
        return scalar(0.0)
    if aggregation == "token_mean":
        return sum(per_sequence_sums) / sum(per_sequence_lengths)
    if aggregation == "sequence_mean":
        return sum(per_sequence_sums[i] / per_sequence_lengths[i] for i in non_empty) / len(non_empty)
    return sum(per_sequence_sums[i] / max_tokens for i in non_empty) / len(non_empty)


def ref_group_advantages(estimator, rewards, eps):
    b_count, g_count = rewards.shape
    out = [[None] * g_count for _ in range(b_count)]
    for b in range(b_count):
        r = [rewards[b, g] for g in range(g_count)]
        mean = sum(r) / g_count
        std = torch.sqrt(sum((x - mean) ** 2 for x in r) / (g_count - 1))
        for g in range(g_count):
            if estimator == "group":
                out[b][g] = (r[g] - mean) / (std + eps)
            elif estimator == "group_mean":
                out[b][g] = r[g] - mean
            else:
                out[b][g] = r[g] - sum(r[j] for j in range(g_count) if j != g) / (g_count - 1)
    return torch.stack([torch.stack(row) for row in out])


def ref_gae(rewards, values, mask, gamma, lam):
    n, t_len = rewards.shape
    adv = torch.zeros(n, t_len, dtype=f64)
    ret = torch.zeros(n, t_len, dtype=f64)
    for i in range(n):
        length = int(mask[i].sum())

        v = [values[i, t] for t in range(length)] + [scalar(0.0)]  # V after the last token is 0
        deltas = [rewards[i, t] + gamma * v[t + 1] - v[t] for t in range(length)]
        for t in range(length):
            a = sum((gamma * lam) ** k * deltas[t + k] for k in range(length - t))
            adv[i, t] = a
            ret[i, t] = a + values[i, t]
    return adv, ret


def ref_whiten(x, mask, eps):
    entries = [x[i, t] for i in range(x.shape[0]) for t in range(x.shape[1]) if mask[i, t]]
    mean = sum(entries) / len(entries)
    std = torch.sqrt(sum((e - mean) ** 2 for e in entries) / (len(entries) - 1))
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        for t in range(x.shape[1]):
            if mask[i, t]:
                out[i, t] = (x[i, t] - mean) / (std + eps)
    return out


def ref_reinforce_pp(rewards, logp, ref, mask, kl_coef, baseline, group_size, eps):
    n, t_len = logp.shape
    if baseline:
        means = []
        for i in range(n):
            first = (i // group_size) * group_size
            means.append(sum(rewards[j] for j in range(first, first + group_size)) / group_size)
        rewards = torch.stack([rewards[i] - means[i] for i in range(n)])
    returns = torch.zeros(n, t_len, dtype=f64)
    for i in range(n):
        length = int(mask[i].sum())
        token_rewards = [-kl_coef * (logp[i, t] - ref[i, t]) for t in range(length)]
        if length:
            token_rewards[-1] = token_rewards[-1] + rewards[i]
        for t in range(length):
            returns[i, t] = sum(token_rewards[t:])  # gamma = 1
    return ref_whiten(returns, mask, eps)


def logsig(x):
    return -torch.log(1 + torch.exp(-x))


def ref_dpo(pi_w, pi_l, ref_w, ref_l, beta, ls, offset):
    losses = []
    for b in range(pi_w.shape[0]):
        h = beta * ((pi_w[b] - ref_w[b]) - (pi_l[b] - ref_l[b]))
        if offset is not None:
            h = h - offset[b]
        losses.append(-(1 - ls) * logsig(h) - ls * logsig(-h))
    return sum(losses) / len(losses)


def ref_simpo(pi_w, pi_l, len_w, len_l, beta, gamma):
    losses = [-logsig(beta / len_w[b] * pi_w[b] - beta / len_l[b] * pi_l[b] - gamma) for b in range(pi_w.shape[0])]
    return sum(losses) / len(losses)


def ref_orpo(pi_w, pi_l, len_w, len_l, lam):
    losses = []
    for b in range(pi_w.shape[0]):
        a_w, a_l = pi_w[b] / len_w[b], pi_l[b] / len_l[b]
        logodds_w = a_w - torch.log(1 - torch.exp(a_w))
        logodds_l = a_l - torch.log(1 - torch.exp(a_l))
        losses.append(-a_w + lam * -logsig(logodds_w - logodds_l))
    return sum(losses) / len(losses)


def ref_kto(logps, ref_logps, desirable, kl_logps, kl_ref_logps, beta, w_d, w_u):
    kl = sum(kl_logps[b] - kl_ref_logps[b] for b in range(kl_logps.shape[0])) / kl_logps.shape[0]
    z = max(kl.detach(), scalar(0.0))
    losses = []
    for b in range(logps.shape[0]):
        r = logps[b] - ref_logps[b]
        if desirable[b]:
            losses.append(w_d * (1 - torch.sigmoid(beta * (r - z))))
        else:
            losses.append(w_u * (1 - torch.sigmoid(beta * (z - r))))
    return sum(losses) / len(losses)


# ---------------------------------------------------------------- comparisons


def random_policy_case(seed, old_noise):
    gen = torch.Generator().manual_seed(seed)
    n, t_len = 4, 5
    logp = -3 * torch.rand(n, t_len, generator=gen, dtype=f64)
    old = logp + old_noise * torch.randn(n, t_len, generator=gen, dtype=f64)
    ref = logp + 0.5 * torch.randn(n, t_len, generator=gen, dtype=f64)
    lengths = torch.randint(0, t_len + 1, (n,), generator=gen)
    lengths[0] = t_len  # never all empty
    mask = (torch.arange(t_len) < lengths[:, None]).long()
    if seed % 2:
        adv = torch.randn(n, generator=gen, dtype=f64)
    else:
        adv = torch.randn(n, t_len, generator=gen, dtype=f64)
    return logp, old, ref, adv, mask


# (eps_low, eps_high, spread of old - logp): spreads chosen so that every clip branch is hit (the test
# checks it); seed 6's case holds a sequence whose ratio exceeds dual_clip with A < 0: no other case's
# sequence ratio reaches the dual clip
EPS_CASES = [(0.2, 0.2, 1.0), (0.2, 0.28, 0.5), (None, 4.0, 1.5), (3e-4, 4e-4, 0.003), (0.2, 0.2, 2.0)]
SEEDS = [0, 1, 2, 3, 6]
POLICY_COMBOS = [
    (ratio, clip, dual, aggregation)
    for ratio, (clip, dual), aggregation in itertools.product(
        ["token", "sequence", "sequence_token"],
        [("ppo", None), ("ppo", 3.0), ("is_weight", None), ("none", None)],
        ["token_mean", "sequence_mean", "constant"],
    )
]


@pytest.mark.parametrize("ratio, clip, dual_clip, aggregation", POLICY_COMBOS)
def test_policy_loss_matches_reference(ratio, clip, dual_clip, aggregation):
    kl_cases = [(0.0, "k3"), (0.1, "k1"), (0.05, "k2"), (0.2, "k3"), (0.1, "k3")]
    clipped = dual_clipped = 0.0
    for seed, (eps_low, eps_high, old_noise), (kl_coef, kl_estimator) in zip(
        SEEDS, EPS_CASES, kl_cases, strict=True
    ):
        logp, old, ref, adv, mask = random_policy_case(seed, old_noise)
        kwargs = dict(ratio=ratio, clip=clip, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip,
                      aggregation=aggregation, max_tokens=7, kl_coef=kl_coef, kl_estimator=kl_estimator)
        x = logp.clone().requires_grad_()
        ours, metrics = F.policy_loss(x, old, adv, mask, ref_logprobs=ref, **kwargs)
        ours.backward()
        y = logp.clone().requires_grad_()
        expected = ref_policy_loss(y, old, adv, mask, ref=ref, **kwargs)
        expected.backward()
        torch.testing.assert_close(ours, expected, **TOL)
        torch.testing.assert_close(x.grad, y.grad, **TOL)
        clipped = max(clipped, float(metrics["clip_fraction"]))
        dual_clipped = max(dual_clipped, float(metrics.get("dual_clip_fraction", 0.0)))
    # the cases reach the branches compared: a clip bound acted somewhere, and the dual clip where set
    assert clipped > 0 or clip == "none"
    assert dual_clipped > 0 or dual_clip is None


@pytest.mark.parametrize("estimator", ["group", "group_mean", "rloo"])
def test_advantages_match_reference(estimator):
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        rewards = torch.randn(3, 4, generator=gen, dtype=f64)
        weights = torch.randn(3, 4, generator=gen, dtype=f64)
        x, y = rewards.clone().requires_grad_(), rewards.clone().requires_grad_()
        ours = F.advantages(estimator, x)
        expected = ref_group_advantages(estimator, y, 1e-6)
        (ours * weights).sum().backward()
        (expected * weights).sum().backward()
        torch.testing.assert_close(ours, expected, **TOL)
        torch.testing.assert_close(x.grad, y.grad, **TOL)


def test_gae_matches_reference():
    for seed, (gamma, lam) in enumerate([(1.0, 0.95), (0.9, 0.8), (0.99, 1.0)]):
        gen = torch.Generator().manual_seed(seed)
        rewards, values, weights = torch.randn(3, 4, 6, generator=gen, dtype=f64)
        mask = (torch.arange(6) < torch.tensor([6, 2, 0, 4])[:, None]).long()
        ours_in = [rewards.clone().requires_grad_(), values.clone().requires_grad_()]
        ref_in = [rewards.clone().requires_grad_(), values.clone().requires_grad_()]
        adv, ret = F.gae(*ours_in, mask, gamma=gamma, lam=lam)
        ref_adv, ref_ret = ref_gae(*ref_in, mask, gamma, lam)
        torch.testing.assert_close(adv, ref_adv, **TOL)
        torch.testing.assert_close(ret, ref_ret, **TOL)
        ((adv + 2 * ret) * weights).sum().backward()
        ((ref_adv + 2 * ref_ret) * weights).sum().backward()
        for ours_t, ref_t in zip(ours_in, ref_in, strict=True):
            torch.testing.assert_close(ours_t.grad, ref_t.grad, **TOL)


@pytest.mark.parametrize("baseline", [False, True])
def test_reinforce_pp_matches_reference(baseline):
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        rewards = torch.randn(6, generator=gen, dtype=f64)
        logp = -3 * torch.rand(6, 5, generator=gen, dtype=f64)
        ref = logp + 0.3 * torch.randn(6, 5, generator=gen, dtype=f64)
        weights = torch.randn(6, 5, generator=gen, dtype=f64)
        mask = (torch.arange(5) < torch.tensor([5, 3, 1, 0, 4, 2])[:, None]).long()
        group_size = 3 if baseline else None
        ours_in = [rewards.clone().requires_grad_(), logp.clone().requires_grad_()]
        ref_in = [rewards.clone().requires_grad_(), logp.clone().requires_grad_()]
        ours = F.reinforce_pp_advantages(ours_in[0], ours_in[1], ref, mask, kl_coef=0.1,
                                         baseline=baseline, group_size=group_size)
        expected = ref_reinforce_pp(ref_in[0], ref_in[1], ref, mask, 0.1, baseline, group_size, 1e-6)
        torch.testing.assert_close(ours, expected, **TOL)
        (ours * weights).sum().backward()
        (expected * weights).sum().backward()
        for ours_t, ref_t in zip(ours_in, ref_in, strict=True):
            torch.testing.assert_close(ours_t.grad, ref_t.grad, **TOL)


def _compare(ours_fn, ref_fn, inputs):
    ours_in = [x.clone().requires_grad_() for x in inputs]
    ref_in = [x.clone().requires_grad_() for x in inputs]
    ours, _ = ours_fn(*ours_in)
    expected = ref_fn(*ref_in)
    ours.backward()
    expected.backward()
    torch.testing.assert_close(ours, expected, **TOL)
    for ours_t, ref_t in zip(ours_in, ref_in, strict=True):
        torch.testing.assert_close(ours_t.grad, ref_t.grad, **TOL)


def _logps(gen, scale=20.0, b=5):
    return -scale * torch.rand(b, generator=gen, dtype=f64) - 0.01


@pytest.mark.parametrize("seed", range(3))
def test_dpo_and_odpo_match_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    pi_w, pi_l, ref_w, ref_l = (_logps(gen) for _ in range(4))
    for beta, ls in [(0.1, 0.0), (0.5, 0.2)]:
        _compare(lambda a, b, beta=beta, ls=ls: F.dpo_loss(a, b, ref_w, ref_l, beta=beta, label_smoothing=ls),
                 lambda a, b, beta=beta, ls=ls: ref_dpo(a, b, ref_w, ref_l, beta, ls, None), [pi_w, pi_l])
    scores_l = torch.rand(5, generator=gen, dtype=f64)
    scores_w = scores_l + 2 * torch.rand(5, generator=gen, dtype=f64) + 1e-3
    offset = F.odpo_offset(scores_w, scores_l, alpha=0.7)
    torch.testing.assert_close(offset, torch.stack([0.7 * torch.log(scores_w[b] - scores_l[b]) for b in range(5)]))
    _compare(lambda a, b: F.dpo_loss(a, b, ref_w, ref_l, beta=0.1, offset=offset),
             lambda a, b: ref_dpo(a, b, ref_w, ref_l, 0.1, 0.0, offset), [pi_w, pi_l])


@pytest.mark.parametrize("seed", range(3))
def test_simpo_and_orpo_match_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    pi_w, pi_l = _logps(gen), _logps(gen)
    len_w, len_l = (torch.randint(1, 30, (5,), generator=gen) for _ in range(2))
    _compare(lambda a, b: F.simpo_loss(a, b, len_w, len_l, beta=2.0, gamma=0.5),
             lambda a, b: ref_simpo(a, b, len_w.to(f64), len_l.to(f64), 2.0, 0.5), [pi_w, pi_l])
    _compare(lambda a, b: F.orpo_loss(a, b, len_w, len_l, lam=0.3),
             lambda a, b: ref_orpo(a, b, len_w.to(f64), len_l.to(f64), 0.3), [pi_w, pi_l])


@pytest.mark.parametrize("seed", range(3))
def test_kto_matches_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    logps, ref_logps, kl_logps = _logps(gen, b=6), _logps(gen, b=6), _logps(gen, b=6)
    kl_ref = kl_logps + (0.5 - torch.rand(6, generator=gen, dtype=f64))  # mean KL of either sign
    desirable = torch.rand(6, generator=gen) < 0.5
    _compare(lambda a, k: F.kto_loss(a, ref_logps, desirable, k, kl_ref, beta=0.3, desirable_weight=1.5),
             lambda a, k: ref_kto(a, ref_logps, desirable, k, kl_ref, 0.3, 1.5, 1.0), [logps, kl_logps])


def test_reference_self_check_ppo_by_hand():
    """The reference itself reproduces one hand-computed PPO number (rho 1.5, A 1 -> -1.2)."""
    logp = torch.tensor([[math.log(1.5)]], dtype=f64)
    value = ref_policy_loss(logp, torch.zeros(1, 1, dtype=f64), torch.ones(1, dtype=f64), torch.ones(1, 1),
                            "token", "ppo", 0.2, 0.2, None, "token_mean", None, None, 0.0, "k3")
    assert value.item() == pytest.approx(-1.2)
