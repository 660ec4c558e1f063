"""The trust regions after the clip (SAPO, DPPO, GMPO, Clip-Cov, KL-Cov): hand-computed values, the
properties that define each, and verl's own code on random cases."""

from __future__ import annotations

import math

import pytest
import torch

import posttrain.functional as F
from peers import verl_config, verl_core_algos
from posttrain.functional._surrogates import binary_divergence, sapo_gate, token_covariance

f64 = torch.float64
SAPO = dict(tau_pos=1.0, tau_neg=1.05)


def loss_and_grad(logp, old, adv, mask, **kwargs):
    logp = logp.clone().requires_grad_(True)
    loss, metrics = F.policy_loss(logp, old, adv, mask, **kwargs)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad, metrics


# --- SAPO -------------------------------------------------------------------------------


def test_sapo_by_hand():
    # one token, r = e^0.5, A = 2 (tau_pos = 1): loss = -(4/1) sigmoid(e^0.5 - 1) * 2
    logp, old = torch.tensor([[math.log(0.5)]], dtype=f64), torch.tensor([[math.log(0.5) - 0.5]], dtype=f64)
    loss, grad, _ = loss_and_grad(logp, old, torch.tensor([2.0], dtype=f64), torch.ones(1, 1), clip="sapo",
                                  eps_low=None, eps_high=None, clip_options=SAPO)
    r = math.exp(0.5)
    s = 1 / (1 + math.exp(-(r - 1)))
    assert loss.item() == pytest.approx(-4 * s * 2, rel=1e-12)
    assert grad.item() == pytest.approx(-2 * 4 * s * (1 - s) * r, rel=1e-12)  # d/dlogp of -A f(r), dr/dlogp = r


def test_sapo_on_policy_gradient_is_the_policy_gradient():
    # at r = 1 the gate's slope is 1: the gradient is -A, as the unclipped surrogate's, for either tau
    logp = torch.log(torch.tensor([[0.3, 0.6], [0.2, 0.9]], dtype=f64))
    adv = torch.tensor([1.5, -0.7], dtype=f64)
    _, grad, _ = loss_and_grad(logp, logp, adv, torch.ones(2, 2), clip="sapo", eps_low=None, eps_high=None,
                               aggregation="token_mean", clip_options=dict(tau_pos=3.0, tau_neg=7.0))
    assert torch.allclose(grad, -adv[:, None].expand(2, 2) / 4)


def test_sapo_gate_tends_to_the_unclipped_surrogate_as_tau_shrinks_and_shuts_off_as_it_grows():
    r = torch.tensor([0.5, 0.9, 1.1, 2.0], dtype=f64, requires_grad=True)

    def slope(tau):
        (g,) = torch.autograd.grad(sapo_gate(r, torch.full_like(r, tau)).sum(), r)
        return g

    assert torch.allclose(slope(1e-4), torch.ones(4, dtype=f64), atol=1e-6)  # tau -> 0: -r A, no trust region
    assert (slope(100.0) < 1e-3).all()  # tau large: no gradient away from r = 1, a trust region of width -> 0
    assert (slope(10.0) < slope(1.0)).all()


def test_sapo_damps_negative_advantages_faster():
    r = torch.tensor([1.5], dtype=f64, requires_grad=True)
    slopes = [torch.autograd.grad(sapo_gate(r, torch.tensor([tau], dtype=f64)).sum(), r)[0].item() for tau in (1.0, 1.05)]
    assert slopes[1] < slopes[0]


# --- DPPO -------------------------------------------------------------------------------


def test_dppo_tv_masks_by_probability_moved_in_the_advantage_direction():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]], dtype=f64))
    new = torch.log(torch.tensor([[0.7, 0.6, 0.3, 0.4]], dtype=f64))  # moved +0.2, +0.1, -0.2, -0.1
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=f64)
    loss, grad, metrics = loss_and_grad(new, old, adv, torch.ones(1, 4), clip="dppo_tv", eps_low=None,
                                        eps_high=None, aggregation="token_mean",
                                        clip_options=dict(divergence_bound=0.15))
    ratio = (new - old).exp()
    assert torch.allclose(grad, torch.tensor([[0.0, -ratio[0, 1] / 4, 0.0, ratio[0, 3] / 4]], dtype=f64))
    assert metrics["clip_fraction"].item() == 0.5
    # a rise with A < 0 (or a fall with A > 0) is a move back towards the sampler: never masked
    _, grad, _ = loss_and_grad(new, old, -adv, torch.ones(1, 4), clip="dppo_tv", eps_low=None, eps_high=None,
                               clip_options=dict(divergence_bound=0.15))
    assert (grad != 0).all()


def test_dppo_with_a_zero_bound_masks_every_moved_token_and_no_unmoved_one():
    torch.manual_seed(0)
    old = torch.log(torch.rand(4, 6, dtype=f64) * 0.9 + 0.05)
    new = old.clone()
    new[:, :3] += 0.3 * torch.randn(4, 3, dtype=f64).sign()  # moved; the last three are not
    adv = torch.randn(4, 6, dtype=f64)
    for clip in ("dppo_tv", "dppo_kl"):
        _, grad, _ = loss_and_grad(new, old, adv, torch.ones(4, 6), clip=clip, eps_low=None, eps_high=None,
                                   clip_options=dict(divergence_bound=0.0))
        moved_with_a = ((new - old).sign() == adv.sign())[:, :3]
        assert (grad[:, :3][moved_with_a] == 0).all()
        assert (grad[:, 3:] != 0).all()


def test_binary_kl_by_hand():
    p, q = 0.6, 0.5  # KL(Bernoulli(old = 0.5) || Bernoulli(new = 0.6))
    expected = q * math.log(q / p) + (1 - q) * math.log((1 - q) / (1 - p))
    got = binary_divergence(torch.tensor([math.log(p)], dtype=f64), torch.tensor([math.log(q)], dtype=f64), "kl")
    assert got.item() == pytest.approx(expected, abs=1e-7)


# --- GMPO -------------------------------------------------------------------------------


def test_gmpo_is_the_geometric_mean_of_the_token_ratios():
    old = torch.zeros(1, 3, dtype=f64)
    logr = torch.tensor([[0.1, -0.2, 0.05]], dtype=f64)
    loss, grad, _ = loss_and_grad(old + logr, old, torch.tensor([2.0], dtype=f64), torch.ones(1, 3),
                                  clip="geometric", eps_low=1 - math.exp(-0.4), eps_high=math.exp(0.4) - 1)
    geometric = math.exp(logr.mean().item())
    assert loss.item() == pytest.approx(-2 * geometric, rel=1e-12)
    assert torch.allclose(grad, torch.full((1, 3), -2 * geometric / 3, dtype=f64))


def test_gmpo_clips_in_log_space_on_the_side_the_advantage_pushes():
    old = torch.zeros(1, 2, dtype=f64)
    logr = torch.tensor([[0.6, -0.6]], dtype=f64)  # both outside (-0.4, 0.4)
    bounds = dict(eps_low=1 - math.exp(-0.4), eps_high=math.exp(0.4) - 1)
    loss, grad, metrics = loss_and_grad(old + logr, old, torch.tensor([1.0], dtype=f64), torch.ones(1, 2),
                                        clip="geometric", **bounds)
    # A > 0: the rise is clipped to 0.4 (no gradient), the fall stays -0.6
    assert loss.item() == pytest.approx(-math.exp((0.4 - 0.6) / 2), rel=1e-12)
    assert grad[0, 0] == 0 and grad[0, 1] != 0
    loss, grad, _ = loss_and_grad(old + logr, old, torch.tensor([-1.0], dtype=f64), torch.ones(1, 2),
                                  clip="geometric", **bounds)
    assert loss.item() == pytest.approx(math.exp((0.6 - 0.4) / 2), rel=1e-12)
    assert grad[0, 0] != 0 and grad[0, 1] == 0


# --- Clip-Cov, KL-Cov --------------------------------------------------------------------


def test_token_covariance_by_hand():
    adv = torch.tensor([[1.0, 1.0], [-1.0, 0.0]], dtype=f64)
    logp = torch.tensor([[-1.0, -2.0], [-3.0, 9.0]], dtype=f64)
    valid = torch.tensor([[True, True], [True, False]])
    cov = token_covariance(adv, logp, valid)  # means over the 3 valid tokens: A 1/3, logp -2
    assert torch.allclose(cov, torch.tensor([[(2 / 3) * 1.0, 0.0], [(-4 / 3) * -1.0, 0.0]], dtype=f64))


def test_kl_cov_penalises_the_highest_covariance_tokens_only():
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]], dtype=f64)
    old = torch.tensor([[-1.0, -2.0], [-3.0, -0.5]], dtype=f64)
    new = old + 0.1
    loss, grad, metrics = loss_and_grad(new, old, adv, torch.ones(2, 2), clip="kl_cov", eps_low=None,
                                        eps_high=None, aggregation="token_mean",
                                        clip_options=dict(cov_fraction=0.25, kl_cov_coef=1.0))
    # covariances: A - 0 = +-1; logp - mean(-1.65): +0.75, -0.25, -1.25, +1.25 -> [0.75, -0.25, 1.25, -1.25]
    ratio = math.exp(0.1)
    expected = (-ratio * 1 - ratio * 1 + ratio + ratio) / 4 + 1.0 * 0.1 / 4  # token (1, 0) penalised
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert metrics["clip_fraction"].item() == 0.25


def test_clip_cov_detaches_the_chosen_tokens_and_only_those():
    torch.manual_seed(1)
    logp = torch.log(torch.rand(8, 16, dtype=f64) * 0.9 + 0.05)
    adv = torch.randn(8, dtype=f64) * 3
    opts = dict(clip="clip_cov", eps_low=0.2, eps_high=0.2, aggregation="token_mean")
    torch.manual_seed(2)
    _, grad, metrics = loss_and_grad(logp, logp, adv, torch.ones(8, 16),
                                     clip_options=dict(cov_fraction=0.05, cov_bounds=(1.0, 5.0)), **opts)
    cov = token_covariance(adv[:, None].expand(8, 16), logp, torch.ones(8, 16, dtype=torch.bool))
    eligible = (cov > 1) & (cov < 5)
    zero = grad == 0
    assert zero.sum().item() == min(max(int(0.05 * 128), 1), int(eligible.sum()))
    assert eligible[zero].all()
    assert metrics["zero_gradient_fraction"].item() == zero.float().mean().item()


@pytest.mark.parametrize("clip, options, bounds", [
    ("sapo", dict(tau_pos=1.0), (None, None)),
    ("dppo_tv", dict(), (None, None)),
    ("clip_cov", dict(cov_fraction=0.1, cov_bounds=(5.0, 1.0)), (0.2, 0.2)),
    ("ppo", dict(tau_pos=1.0), (0.2, 0.2)),
])
def test_bad_clip_options_name_the_problem(clip, options, bounds):
    with pytest.raises(ValueError, match="clip"):
        F.policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2), clip=clip,
                      eps_low=bounds[0], eps_high=bounds[1], clip_options=options)


# --- against verl's own code -------------------------------------------------------------

VERL_AGGREGATIONS = {"token-mean": "token_mean", "seq-mean-token-mean": "sequence_mean"}


def random_case(seed: int, n: int = 6, t: int = 9, spread: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    old = torch.log(torch.rand(n, t, generator=g, dtype=f64) * 0.95 + 0.02)
    logp = (old + spread * torch.randn(n, t, generator=g, dtype=f64)).clamp(max=-1e-3)
    adv = torch.randn(n, generator=g, dtype=f64)
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(f64)
    return logp, old, adv, mask


def verl_loss_and_grad(name, logp, old, adv, mask, config, aggregation):
    core = verl_core_algos()
    logp = logp.clone().requires_grad_(True)
    loss, _ = core.get_policy_loss_fn(name)(old_log_prob=old, log_prob=logp, advantages=adv[:, None].expand_as(logp),
                                            response_mask=mask, loss_agg_mode=aggregation, config=config)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad


def ours(logp, old, adv, mask, **kwargs):
    loss, grad, _ = loss_and_grad(logp, old, adv, mask, **kwargs)
    return loss, grad


CASES = {
    "sapo": (dict(tau_pos=1.0, tau_neg=1.05), dict(clip="sapo", eps_low=None, eps_high=None,
                                                   clip_options=dict(tau_pos=1.0, tau_neg=1.05)),
             "seq-mean-token-mean"),
    "dppo_tv": (dict(eps_low=0.15, eps_high=0.15, clip_ratio_c=1e4),
                dict(clip="dppo_tv", eps_low=None, eps_high=1e4 - 1, clip_options=dict(divergence_bound=0.15)),
                "token-mean"),
    "dppo_kl": (dict(eps_low=0.05, eps_high=0.05, clip_ratio_c=1.5),
                dict(clip="dppo_kl", eps_low=None, eps_high=0.5, clip_options=dict(divergence_bound=0.05)),
                "token-mean"),
    "geo_mean": (dict(eps_low=0.4, eps_high=0.4),
                 dict(clip="geometric", eps_low=1 - math.exp(-0.4), eps_high=math.exp(0.4) - 1),
                 "seq-mean-token-mean"),
    "kl_cov": (dict(kl_cov_ratio=0.05, ppo_kl_coef=1.0),
               dict(clip="kl_cov", eps_low=None, eps_high=None, clip_options=dict(cov_fraction=0.05, kl_cov_coef=1.0)),
               "token-mean"),
}


@pytest.mark.skipif(verl_core_algos() is None, reason="verl not installed (scripts/setup.sh installs it with --no-deps)")
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name", [*CASES, "clip_cov"])
def test_matches_verl(name, seed):
    logp, old, adv, mask = random_case(seed)
    if name == "clip_cov":  # a wide covariance band and fraction so that the random draw has candidates
        verl_kwargs = dict(clip_cov_ratio=0.1, clip_cov_lb=0.01, clip_cov_ub=5.0)
        kwargs = dict(clip="clip_cov", eps_low=0.2, eps_high=0.28,
                      clip_options=dict(cov_fraction=0.1, cov_bounds=(0.01, 5.0)))
        aggregation, config = "token-mean", verl_config(eps_low=0.2, eps_high=0.28, **verl_kwargs)
    else:
        verl_kwargs, kwargs, aggregation = CASES[name]
        config = verl_config(**verl_kwargs)
    if name == "geo_mean":
        mask = torch.ones_like(mask)  # verl averages over every row, ours over non-empty ones: all non-empty
    torch.manual_seed(seed)
    theirs_loss, theirs_grad = verl_loss_and_grad(name, logp, old, adv, mask, config, aggregation)
    torch.manual_seed(seed)
    our_loss, our_grad = ours(logp, old, adv, mask, aggregation=VERL_AGGREGATIONS[aggregation], **kwargs)
    assert torch.allclose(our_loss, theirs_loss, rtol=1e-7, atol=1e-7)  # verl divides by lengths + 1e-8
    assert torch.allclose(our_grad * mask, theirs_grad * mask, rtol=1e-7, atol=1e-7)  # verl divides by lengths + 1e-8


# --- DeepSeek-V3.2's off-policy sequence mask and importance-weighted KL -------------------


def test_off_policy_mask_drops_only_negative_sequences_that_drifted():
    old = torch.zeros(4, 2, dtype=f64)
    logp = torch.tensor([[-0.5, -0.5], [-0.5, -0.5], [-0.05, 0.0], [0.0, 0.0]], dtype=f64)  # drift 0.5, 0.5, 0.025, 0
    adv = torch.tensor([-1.0, 1.0, -1.0, -1.0], dtype=f64)
    _, grad, metrics = loss_and_grad(logp, old, adv, torch.ones(4, 2), clip="none", eps_low=None, eps_high=None,
                                     off_policy_mask=0.1)
    assert (grad[0] == 0).all() and (grad[1:] != 0).all()  # the drifted mistake leaves; a drifted success stays
    assert metrics["off_policy_masked_fraction"].item() == 0.25


def test_off_policy_mask_is_trls():
    grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    for seed in range(4):
        logp, old, adv, mask = random_case(seed, spread=0.2)
        theirs = grpo.GRPOTrainer.get_off_policy_mask(adv[:, None], logp, old, mask, 0.05)
        # the mask as the loss applies it: a dropped row has no gradient at all
        _, grad, _ = loss_and_grad(logp, old, adv, mask, clip="none", eps_low=None, eps_high=None, off_policy_mask=0.05)
        kept = (grad * mask).abs().sum(-1) > 0
        assert 0 < kept.sum() < len(kept) or seed  # some case drops some rows and keeps others
        assert torch.equal(kept, theirs[:, 0].bool())


def test_importance_weighted_kl_is_the_ratio_times_k3():
    logp, old, adv, mask = random_case(0)
    ref = old - 0.1
    plain, _ = F.policy_loss(logp, old, torch.zeros_like(adv), mask, clip="none", eps_low=None, eps_high=None,
                             ref_logprobs=ref, kl_coef=1.0, aggregation="token_mean")
    weighted, _ = F.policy_loss(logp, old, torch.zeros_like(adv), mask, clip="none", eps_low=None, eps_high=None,
                                ref_logprobs=ref, kl_coef=1.0, aggregation="token_mean", kl_importance_weighted=True)
    k3 = (ref - logp).exp() - (ref - logp) - 1
    assert plain.item() == pytest.approx(((k3 * mask).sum() / mask.sum()).item(), rel=1e-12)
    assert weighted.item() == pytest.approx((((logp - old).exp() * k3 * mask).sum() / mask.sum()).item(), rel=1e-12)


# --- a naive float64 reference: loops over i and t, scalar arithmetic, written from docs/algorithms.md ----


def naive_loss(name, logp, old, adv, mask, **options):
    """The sequence_mean loss of SAPO, DPPO-TV or GMPO, one token at a time."""
    per_sequence = []
    for i in range(logp.shape[0]):
        tokens = [t for t in range(logp.shape[1]) if mask[i, t]]
        a = adv[i]
        if name == "geometric":  # GMPO: -A exp(mean_t of the sign-aware clipped log-ratio), on every token
            lo, hi = math.log(1 - options["eps_low"]), math.log(1 + options["eps_high"])
            terms = []
            for t in tokens:
                d = logp[i, t] - old[i, t]
                clipped = torch.clamp(d, lo, hi)
                terms.append(torch.sign(a) * torch.minimum(torch.sign(a) * d, torch.sign(a) * clipped))
            per_sequence.append(-a * torch.exp(sum(terms) / len(terms)))
            continue
        losses = []
        for t in tokens:
            r = torch.exp(logp[i, t] - old[i, t])
            if name == "sapo":
                tau = options["tau_pos"] if a > 0 else options["tau_neg"]
                losses.append(-(4 / tau) * torch.sigmoid(tau * (r - 1)) * a)
            else:  # dppo_tv: -sg(r) A log pi, kept while p - p_old stays within delta in A's direction
                moved = torch.exp(logp[i, t]) - torch.exp(old[i, t])
                outside = moved > options["delta"] if a > 0 else moved < -options["delta"]
                losses.append(torch.zeros((), dtype=f64) if outside else -r.detach() * a * logp[i, t])
        per_sequence.append(sum(losses) / len(losses))
    return sum(per_sequence) / len(per_sequence)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name, kwargs, options", [
    ("sapo", dict(clip="sapo", eps_low=None, eps_high=None, clip_options=SAPO), SAPO),
    ("dppo_tv", dict(clip="dppo_tv", eps_low=None, eps_high=None, clip_options=dict(divergence_bound=0.1)),
     dict(delta=0.1)),
    ("geometric", dict(clip="geometric", eps_low=1 - math.exp(-0.2), eps_high=math.exp(0.2) - 1),
     dict(eps_low=1 - math.exp(-0.2), eps_high=math.exp(0.2) - 1)),
])
def test_matches_a_naive_float64_reference(name, kwargs, options, seed):
    logp, old, adv, mask = random_case(seed + 10)
    ours, ours_grad, _ = loss_and_grad(logp, old, adv, mask, aggregation="sequence_mean", **kwargs)
    leaf = logp.clone().requires_grad_(True)
    theirs = naive_loss(name, leaf, old, adv, mask, **options)
    (theirs_grad,) = torch.autograd.grad(theirs, leaf)
    assert torch.allclose(ours, theirs.detach(), rtol=1e-10, atol=1e-12)
    assert torch.allclose(ours_grad, theirs_grad, rtol=1e-10, atol=1e-12)


def naive_covariance(logp, adv, mask):
    """Each valid token's (A - mean A)(log pi - mean log pi) over the valid tokens, as a dict {(i, t): float}."""
    tokens = [(i, t) for i in range(logp.shape[0]) for t in range(logp.shape[1]) if mask[i, t]]
    adv_mean = sum(float(adv[i]) for i, _ in tokens) / len(tokens)
    logp_mean = sum(float(logp[i, t]) for i, t in tokens) / len(tokens)
    return {(i, t): (float(adv[i]) - adv_mean) * (float(logp[i, t]) - logp_mean) for i, t in tokens}


def naive_token_mean_loss(name, logp, old, adv, mask, *, eps_low, eps_high, fraction, bounds=None, coef=None,
                          seed=None):
    """Clip-Cov's or KL-Cov's token_mean loss, one token at a time (Cui et al. 2025, Algorithms 1 and 2)."""
    cov = naive_covariance(logp.detach(), adv, mask)
    k = max(int(fraction * len(cov)), 1)
    losses = {}
    clipped = set()
    for (i, t) in cov:
        r = torch.exp(logp[i, t] - old[i, t])
        unclipped = -adv[i] * r
        bounded = r if eps_low is None else torch.clamp(r, min=1 - eps_low)
        bounded = bounded if eps_high is None else torch.clamp(bounded, max=1 + eps_high)
        clipped_term = -adv[i] * bounded
        if clipped_term > unclipped:
            clipped.add((i, t))
        losses[i, t] = torch.maximum(unclipped, clipped_term) if name == "clip_cov" else unclipped
    if name == "clip_cov":  # the chosen: k drawn at random among unclipped tokens inside the covariance band
        candidates = [key for key in cov if key not in clipped and bounds[0] < cov[key] < bounds[1]]
        torch.manual_seed(seed)
        for index in torch.randperm(len(candidates))[:k].tolist():
            losses[candidates[index]] = torch.zeros((), dtype=f64)
    else:  # the k tokens of highest covariance get coef |log r|
        for key in sorted(cov, key=cov.get, reverse=True)[:k]:
            i, t = key
            losses[key] = losses[key] + coef * torch.abs(logp[i, t] - old[i, t])
    return sum(losses.values()) / len(losses)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name", ["clip_cov", "kl_cov"])
def test_covariance_methods_match_a_naive_float64_reference(name, seed):
    logp, old, adv, mask = random_case(seed + 20)
    if name == "clip_cov":
        kwargs = dict(eps_low=0.2, eps_high=0.28, clip_options=dict(cov_fraction=0.2, cov_bounds=(0.0, 5.0)))
        options = dict(eps_low=0.2, eps_high=0.28, fraction=0.2, bounds=(0.0, 5.0), seed=seed)
    else:
        kwargs = dict(eps_low=None, eps_high=None, clip_options=dict(cov_fraction=0.1, kl_cov_coef=1.0))
        options = dict(eps_low=None, eps_high=None, fraction=0.1, coef=1.0)
    torch.manual_seed(seed)  # Clip-Cov draws its tokens from torch's global generator
    ours, ours_grad, _ = loss_and_grad(logp, old, adv, mask, clip=name, aggregation="token_mean", **kwargs)
    leaf = logp.clone().requires_grad_(True)
    theirs = naive_token_mean_loss(name, leaf, old, adv, mask, **options)
    (theirs_grad,) = torch.autograd.grad(theirs, leaf)
    assert torch.allclose(ours, theirs.detach(), rtol=1e-10, atol=1e-12)
    assert torch.allclose(ours_grad, theirs_grad, rtol=1e-10, atol=1e-12)
    plain, _, _ = loss_and_grad(logp, old, adv, mask, clip="ppo" if name == "clip_cov" else "none",
                                aggregation="token_mean", **{k: v for k, v in kwargs.items() if k != "clip_options"})
    assert ours.item() != pytest.approx(plain.item(), rel=1e-6)  # the chosen tokens changed the loss


@pytest.mark.parametrize("seed", range(3))
def test_deepseek_v32_loss_matches_a_naive_float64_reference(seed):
    """PPO's clip, the off-policy sequence mask and the importance-weighted k3 KL together, sequence_mean."""
    logp, old, adv, mask = random_case(seed + 30)
    ref = old + 0.2 * torch.randn(old.shape, generator=torch.Generator().manual_seed(seed), dtype=f64)
    delta, beta = 0.02, 0.04
    ours, ours_grad, metrics = loss_and_grad(logp, old, adv, mask, aggregation="sequence_mean", ref_logprobs=ref,
                                             kl_coef=beta, off_policy_mask=delta, kl_importance_weighted=True)
    leaf = logp.clone().requires_grad_(True)
    per_sequence, dropped = [], 0
    for i in range(leaf.shape[0]):
        tokens = [t for t in range(leaf.shape[1]) if mask[i, t]]
        drift = sum(float(old[i, t] - logp[i, t]) for t in tokens) / len(tokens)
        keep = not (adv[i] < 0 and drift > delta)
        dropped += not keep
        policy, kl = [], []
        for t in tokens:
            r = torch.exp(leaf[i, t] - old[i, t])
            policy.append(torch.maximum(-adv[i] * r, -adv[i] * torch.clamp(r, 0.8, 1.2)))
            log_ref_ratio = ref[i, t] - leaf[i, t]
            kl.append(r * (torch.exp(log_ref_ratio) - log_ref_ratio - 1))
        per_sequence.append(keep * sum(policy) / len(policy) + beta * sum(kl) / len(kl))
    theirs = sum(per_sequence) / len(per_sequence)
    (theirs_grad,) = torch.autograd.grad(theirs, leaf)
    assert 0 < dropped < leaf.shape[0]
    assert metrics["off_policy_masked_fraction"].item() == pytest.approx(dropped / leaf.shape[0])
    assert torch.allclose(ours, theirs.detach(), rtol=1e-10, atol=1e-12)
    assert torch.allclose(ours_grad, theirs_grad, rtol=1e-10, atol=1e-12)
