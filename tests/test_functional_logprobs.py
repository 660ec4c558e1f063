"""Chunked selective log-softmax and entropy against the direct full-vocabulary computation."""

import math

import pytest
import torch

import posttrain.functional as F


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("chunk_size", [1, 3, 7, 1000])
def test_selective_log_softmax_equals_log_softmax_gather(dtype, chunk_size):
    gen = torch.Generator().manual_seed(0)
    full = (4 * torch.randn(3, 6, 11, generator=gen)).to(dtype)
    logits = full[:, :-1]  # a non-contiguous view, as model(...).logits[:, :-1]
    tokens = torch.randint(0, 11, (3, 5), generator=gen)
    upstream = torch.randn(3, 5, generator=gen)

    x = logits.detach().clone().requires_grad_()
    ours = F.selective_log_softmax(x, tokens, chunk_size=chunk_size)
    (ours * upstream).sum().backward()

    y = logits.detach().clone().requires_grad_()
    direct = torch.log_softmax(y.to(ours.dtype), dim=-1).gather(-1, tokens[..., None])[..., 0]
    (direct * upstream).sum().backward()

    assert ours.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(ours, direct, rtol=tol, atol=tol)
    assert x.grad.dtype == dtype
    torch.testing.assert_close(x.grad, y.grad, rtol=tol, atol=tol)


def test_selective_log_softmax_handles_minus_inf_logits():
    logits = torch.tensor([[[0.0, -float("inf"), 0.0]]], requires_grad=True)
    out = F.selective_log_softmax(logits, torch.tensor([[0]]))
    out.sum().backward()
    assert out.item() == pytest.approx(-math.log(2))
    torch.testing.assert_close(logits.grad, torch.tensor([[[0.5, 0.0, -0.5]]]))


def test_selective_log_softmax_rejects_bad_inputs():
    with pytest.raises(ValueError, match=r"tokens has shape \[2, 2\] but logits has shape \[2, 3, 4\]"):
        F.selective_log_softmax(torch.zeros(2, 3, 4), torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="long"):
        F.selective_log_softmax(torch.zeros(2, 3, 4), torch.zeros(2, 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_size", [1, 4, 1000])
def test_entropy_from_logits_matches_the_direct_formula(dtype, chunk_size):
    gen = torch.Generator().manual_seed(1)
    logits = (3 * torch.randn(2, 5, 9, generator=gen)).to(dtype)
    logp = torch.log_softmax(logits.float(), dim=-1)
    direct = -(logp.exp() * logp).sum(-1)
    ours = F.entropy_from_logits(logits, chunk_size=chunk_size)
    torch.testing.assert_close(ours, direct, rtol=1e-5, atol=1e-5)


def test_entropy_hand_computed():
    # uniform over 4 -> log 4; one -inf among 3 equal -> log 2; one-hot-ish -> 0
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [1.0, 1.0, -float("inf"), -float("inf")], [0.0, -1e4, -1e4, -1e4]]])
    torch.testing.assert_close(F.entropy_from_logits(logits), torch.tensor([[math.log(4), math.log(2), 0.0]]))


def test_linear_log_softmax_hand_computed():
    # logits h W^T = [1, 0, -1]: log p(token 0) = 1 - log(e + 1 + 1/e) = -log(1 + 1/e + 1/e^2)
    hidden = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]], dtype=torch.float64)
    z = 1.0 + math.exp(-1.0) + math.exp(-2.0)  # sum e^(x - 1)
    for chunk_size in (1, 2, 3):
        logprobs, entropy = F.linear_log_softmax(hidden, weight, torch.tensor([0]), with_entropy=True,
                                                 chunk_size=chunk_size)
        assert logprobs.item() == pytest.approx(-math.log(z), abs=1e-12)
        p = [1 / z, math.exp(-1.0) / z, math.exp(-2.0) / z]
        assert entropy.item() == pytest.approx(-sum(q * math.log(q) for q in p), abs=1e-12)


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 8, 37, 100])
def test_linear_log_softmax_equals_the_unfused_head(chunk_size, with_bias, temperature, recompute):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 5, generator=gen, dtype=torch.float64)
    weight = 3 * torch.randn(37, 5, generator=gen, dtype=torch.float64)  # logits spread over ~30 nats
    bias = torch.randn(37, generator=gen, dtype=torch.float64) if with_bias else None
    tokens = torch.tensor([0, 36, 8, 9, 17, 36, 1])  # first, last and block-edge ids
    upstream = torch.randn(7, generator=gen, dtype=torch.float64)

    leaves = [t.clone().requires_grad_() for t in (hidden, weight)] + ([bias.clone().requires_grad_()] if with_bias else [])
    ours, entropy = F.linear_log_softmax(leaves[0], leaves[1], tokens, bias=leaves[2] if with_bias else None,
                                         temperature=temperature, with_entropy=True, chunk_size=chunk_size,
                                         recompute=recompute)
    (ours * upstream).sum().backward()

    others = [t.clone().requires_grad_() for t in (hidden, weight)] + ([bias.clone().requires_grad_()] if with_bias else [])
    logits = torch.nn.functional.linear(others[0], others[1], others[2] if with_bias else None) / temperature
    direct = torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]
    (direct * upstream).sum().backward()

    torch.testing.assert_close(ours, direct, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(entropy, F.entropy_from_logits(logits.detach()[None])[0], rtol=1e-12, atol=1e-12)
    assert entropy.requires_grad  # an entropy bonus trains through it (tested below)
    for mine, theirs in zip(leaves, others):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-10, atol=1e-12)


def test_linear_log_softmax_float32_survives_a_maximum_that_moves_far():
    # the running maximum jumps by 1000 nats between blocks: the rescaled sums must not overflow
    hidden = torch.tensor([[1.0], [-1.0]])
    weight = torch.tensor([[0.0], [1000.0], [-1000.0], [999.0]])
    logprobs, entropy = F.linear_log_softmax(hidden, weight, torch.tensor([3, 0]), with_entropy=True, chunk_size=1)
    direct = torch.log_softmax(hidden.double() @ weight.double().T, -1)
    # float32 resolves 6e-5 at 1000: the tolerance of the subtraction x_k - lse itself
    torch.testing.assert_close(logprobs.double(), direct[[0, 1], [3, 0]], rtol=0, atol=2e-4)
    assert torch.isfinite(entropy).all() and entropy[1] == pytest.approx(0.0, abs=1e-6)


def test_linear_log_softmax_rejects_bad_inputs():
    hidden, weight = torch.randn(3, 4), torch.randn(10, 4)
    with pytest.raises(ValueError, match=r"tokens must be a long tensor of shape \[3\]"):
        F.linear_log_softmax(hidden, weight, torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="hidden has 4 features but weight"):
        F.linear_log_softmax(hidden, torch.randn(10, 5), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        F.linear_log_softmax(hidden, weight, torch.zeros(3, dtype=torch.long), temperature=0.0)


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_linear_log_softmax_entropy_gradient_is_autograd_s(recompute, temperature):
    """dH/dz_j = -p_j (log p_j + H), built blockwise: an entropy bonus trains through the fused head."""
    torch.manual_seed(0)
    f64 = torch.float64
    hidden, weight, bias = (torch.randn(*shape, dtype=f64, requires_grad=True) for shape in ((5, 8), (13, 8), (13,)))
    tokens = torch.randint(0, 13, (5,))
    logp_weights, entropy_weights = torch.randn(5, dtype=f64), torch.randn(5, dtype=f64)
    for use_logp in (True, False):
        logp, entropy = F.linear_log_softmax(hidden, weight, tokens, bias=bias, temperature=temperature,
                                             with_entropy=True, chunk_size=4, recompute=recompute)
        objective = (entropy * entropy_weights).sum() + (logp * logp_weights).sum() * use_logp
        grads = torch.autograd.grad(objective, (hidden, weight, bias))
        log_probs = ((hidden @ weight.T + bias) / temperature).log_softmax(-1)
        expected_entropy = -(log_probs.exp() * log_probs).sum(-1)
        expected = ((expected_entropy * entropy_weights).sum()
                    + (log_probs.gather(-1, tokens[:, None])[:, 0] * logp_weights).sum() * use_logp)
        for got, want in zip(grads, torch.autograd.grad(expected, (hidden, weight, bias))):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
