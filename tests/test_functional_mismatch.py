"""F.rollout_correction: importance weights for a sampler that is not the trained policy, by hand."""

from __future__ import annotations

import math

import pytest
import torch

import posttrain.functional as F

NAN = float("nan")
# Row 0: ratios pi_old / pi_s of 2, 0.5 and 1. Row 1: a ratio of 0.25, then padding (NaN, never read).
OLD = torch.tensor([[0.5, 0.2, 0.9], [0.1, NAN, NAN]]).log()
SAMPLER = torch.tensor([[0.25, 0.4, 0.9], [0.4, NAN, NAN]]).log()
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])


def weights(**settings):
    w, metrics = F.rollout_correction(OLD, SAMPLER, MASK, **settings)
    return w.tolist(), {k: v.item() for k, v in metrics.items()}


def test_token_truncation_caps_each_ratio():
    w, m = weights(level="token", mode="truncate", high=1.5)
    assert sum(w, []) == pytest.approx([1.5, 0.5, 1.0, 0.25, 0.0, 0.0])
    assert m["mismatch/truncated_fraction"] == pytest.approx(1 / 4) and m["mismatch/masked_fraction"] == 0
    assert m["mismatch/ess"] == pytest.approx(3.25 ** 2 / (4 * (1.5 ** 2 + 0.5 ** 2 + 1 + 0.25 ** 2)))


def test_token_masking_drops_tokens_outside_the_band():
    w, m = weights(level="token", mode="mask", high=1.5)  # band [1/1.5, 1.5]
    assert w == [[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]
    assert m["mismatch/masked_fraction"] == pytest.approx(3 / 4) and m["mismatch/truncated_fraction"] == 0
    assert m["mismatch/ess"] == pytest.approx(1 / 4)  # (1)^2 / (4 * 1)
    w, _ = weights(level="token", mode="mask", high=2.0, low=0.25)  # inclusive bounds
    assert w == [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]


def test_sequence_levels_weigh_every_token_of_a_sequence_alike():
    # row 0's sequence ratio is 2 * 0.5 * 1 = 1; row 1's is 0.25
    w, m = weights(level="sequence", mode="truncate", high=0.8)
    assert sum(w, []) == pytest.approx([0.8, 0.8, 0.8, 0.25, 0.0, 0.0])
    assert m["mismatch/truncated_fraction"] == pytest.approx(3 / 4)
    assert m["mismatch/ess"] == pytest.approx(1.05 ** 2 / (2 * (0.8 ** 2 + 0.25 ** 2)))  # over 2 sequences
    w, m = weights(level="sequence", mode="mask", high=2.0)  # band [0.5, 2]: row 1 leaves
    assert w == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]] and m["mismatch/masked_fraction"] == pytest.approx(1 / 4)


def test_the_geometric_mask_bounds_the_per_token_mean_ratio():
    # geometric means: row 0 exp(mean(log 2, log 0.5, 0)) = 1; row 1 0.25
    w, _ = weights(level="geometric", mode="mask", high=1.01)
    assert w == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    w, _ = weights(level="geometric", mode="mask", high=1.01, low=0.2)
    assert w == [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="use mode 'mask'"):
        F.rollout_correction(OLD, SAMPLER, MASK, level="geometric", mode="truncate")


def test_mismatch_kl_of_the_sampler_against_the_trainer():
    _, m = weights()
    d = [math.log(2), math.log(0.5), 0.0, math.log(0.25)]  # log(pi_old / pi_s) per token
    assert m["mismatch/kl_k1"] == pytest.approx(sum(-x for x in d) / 4)  # = log(4) / 4
    assert m["mismatch/kl_k3"] == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 4)
    same, metrics = F.rollout_correction(OLD, OLD, MASK)  # an identical sampler: no correction, no mismatch
    assert torch.equal(same, MASK) and all(v.item() == 0 for k, v in metrics.items() if "kl" in k or "fraction" in k)
    assert metrics["mismatch/ess"].item() == 1.0


def loop(old, sampler, mask, level, mode, high, low):
    """The weights one sequence and one token at a time, in float64."""
    out = torch.zeros_like(old, dtype=torch.float64)
    for i in range(old.shape[0]):
        tokens = [t for t in range(old.shape[1]) if mask[i, t]]
        logs = [float(old[i, t]) - float(sampler[i, t]) for t in tokens]
        if level != "token":
            total = sum(logs) if level == "sequence" else sum(logs) / max(len(logs), 1)
            logs = [total] * len(tokens)
        for t, x in zip(tokens, logs):
            out[i, t] = min(math.exp(x), high) if mode == "truncate" else float(math.log(low) <= x <= math.log(high))
    return out


@pytest.mark.parametrize("level, mode", [("token", "truncate"), ("token", "mask"), ("sequence", "truncate"),
                                         ("sequence", "mask"), ("geometric", "mask")])
def test_weights_equal_a_float64_loop(level, mode):
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(6, 9, generator=g, dtype=torch.float64) * 3
    sampler = old + torch.randn(6, 9, generator=g, dtype=torch.float64) * 0.3
    mask = (torch.rand(6, 9, generator=g) < 0.8).double()
    mask[2] = 0  # a row without tokens
    w, _ = F.rollout_correction(old.float(), sampler.float(), mask, level=level, mode=mode, high=1.3, low=0.8)
    assert torch.allclose(w.double(), loop(old, sampler, mask, level, mode, 1.3, 0.8), atol=1e-5)
    assert not w.requires_grad and w[2].sum() == 0


def test_bad_settings_name_the_problem():
    with pytest.raises(ValueError, match="level='batch' is not known"):
        F.rollout_correction(OLD, SAMPLER, MASK, level="batch")
    with pytest.raises(ValueError, match="0 < low <= high, got low=3.0, high=2.0"):
        F.rollout_correction(OLD, SAMPLER, MASK, mode="mask", low=3.0)
