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
