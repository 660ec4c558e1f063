"""Multi-turn completions: tokens a tool or environment inserted are context, never trained on.

A completion is the policy's tokens with the inserted ones between its turns; ``Completions.mask``
marks the policy's, ``Completions.inserted`` the others. The training forward attends to both and
scores only the policy's, so the loss, the KL and every token count see the policy's tokens alone.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

import posttrain
from posttrain.models.modeling import collate, forward
from posttrain.rollout.completions import Completions

PAD = 0


class Unfused(LlamaForCausalLM):
    """A subclass: the training forward takes the model's own forward and its [n, T, V] logits."""


def transcript():
    """Two rows after a prompt each: policy tokens (p), inserted tokens (i), padding (-).
    row 0: p p i i i p p      row 1: p i i p -  -  -"""
    prompts = [torch.tensor([3, 4, 5]), torch.tensor([6, 7])]
    ids = torch.tensor([[1, 2, 8, 9, 10, 11, 12], [5, 6, 7, 8, PAD, PAD, PAD]])
    mask = torch.tensor([[1, 1, 0, 0, 0, 1, 1], [1, 0, 0, 1, 0, 0, 0]], dtype=torch.float)
    inserted = torch.tensor([[0, 0, 1, 1, 1, 0, 0], [0, 1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    return prompts, Completions(ids, mask, torch.tensor([False, False]), inserted=inserted)


def unpadded_logprobs(model, prompt, completion_ids, length):
    """log p(token_t | everything before it) from one forward of the row alone, no padding."""
    ids = torch.cat([prompt, completion_ids[:length]])[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1:-1], -1).gather(-1, completion_ids[:length, None])[:, 0]


@pytest.mark.parametrize("fused_head", [True, False])
def test_inserted_tokens_are_attended_and_never_scored(tiny_model_dir, fused_head):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    if not fused_head:
        model.__class__ = Unfused
    prompts, comp = transcript()
    batch = collate(prompts, comp.completion_ids, comp.mask, PAD, torch.device("cpu"), comp.present)
    with torch.no_grad():
        out = forward(model, batch)
    for row, length in enumerate(comp.present.sum(-1).long().tolist()):
        expected = unpadded_logprobs(model, prompts[row], comp.completion_ids[row], length)
        scored = comp.mask[row, :length].bool()
        assert torch.allclose(out.logprobs[row, :length][scored], expected[scored], atol=1e-5)
        assert torch.all(out.logprobs[row][~comp.mask[row].bool()] == 0)  # inserted and padding: 0


def test_the_gradient_of_every_inserted_tokens_logits_is_exactly_zero(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.__class__ = Unfused  # its [n, T, V] logits exist, so their gradient can be read
    captured = {}
    model.lm_head.register_forward_hook(lambda module, args, logits: captured.update(logits=logits) or
                                        logits.retain_grad())
    prompts, comp = transcript()
    batch = collate(prompts, comp.completion_ids, comp.mask, PAD, torch.device("cpu"), comp.present)
    out = forward(model, batch)
    preset = posttrain.algorithm("grpo")
    advantages = torch.tensor([[1.5], [-0.5]]).expand_as(comp.mask)
    ref = out.logprobs.detach() - 0.1  # a KL term too
    loss, _ = preset.policy_loss(out.logprobs, out.logprobs.detach(), advantages, batch.mask, ref_logprobs=ref)
    loss.backward()
    grad = captured["logits"].grad  # [n, T, V]: position P + t - 1 predicts completion token t
    predicts = comp.inserted[:, : grad.shape[1]]
    assert grad[predicts].abs().max() == 0  # exactly: the inserted tokens' predictions get no gradient
    assert grad[comp.mask[:, : grad.shape[1]].bool()].abs().sum(-1).min() > 0  # every policy token's does


def test_the_loss_of_a_multi_turn_batch_is_the_functional_loss_on_the_masked_tensors(tiny_model_dir):
    import posttrain.functional as F

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    prompts, comp = transcript()
    batch = collate(prompts, comp.completion_ids, comp.mask, PAD, torch.device("cpu"), comp.present)
    with torch.no_grad():
        logprobs = forward(model, batch).logprobs
    t = logprobs.shape[1]
    manual = torch.zeros_like(logprobs)
    for row, length in enumerate(comp.present.sum(-1).long().tolist()):
        manual[row, :length] = unpadded_logprobs(model, prompts[row], comp.completion_ids[row], length)
    mask = comp.mask[:, :t]
    old = manual - 0.05 * mask  # a policy one update later: the ratio acts
    advantages = torch.tensor([1.0, -2.0])
    loss, _ = posttrain.algorithm("dapo").policy_loss(logprobs, old, advantages, mask)
    expected, _ = F.policy_loss(manual * mask, old, advantages, mask, eps_low=0.2, eps_high=0.28,
                                aggregation="token_mean")
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    assert int(mask.sum()) == 2 + 2 + 1 + 1  # the token mean counts the policy's tokens alone


def test_rows_and_cat_carry_the_inserted_tokens():
    _, comp = transcript()
    single = Completions(torch.tensor([[4, 5, PAD]]), torch.tensor([[1.0, 1.0, 0.0]]), torch.tensor([True]))
    both = Completions.cat([comp, single])
    assert both.inserted.shape == (3, 7) and not both.inserted[2].any()
    assert torch.equal(both.rows(torch.tensor([1])).inserted, comp.inserted[1:])
    assert both.lengths.tolist() == [4, 2, 2]  # the policy's tokens
    assert both.present.sum(-1).tolist() == [7, 4, 2]
    assert Completions.cat([single, single]).inserted is None
