"""Mixtures of experts: the load-balancing loss by hand and against transformers' own, the routers' trace in the
training passes (real tokens only), and the loss term a config that asks for it adds to a run's loss."""

from __future__ import annotations

import math

import pytest
import torch

import posttrain.functional as F
from posttrain.models.families import tiny_model

LN3 = math.log(3.0)


def test_the_load_balancing_loss_by_hand():
    """Two experts, top-1. Tokens choosing different experts with probabilities (0.25, 0.75) and (0.75, 0.25):
    f = P = (1/2, 1/2), loss E * sum f P = 2 * (1/4 + 1/4) = 1 (balanced: top_k). Both choosing expert 1 with
    (0.25, 0.75): f = (0, 1), P = (0.25, 0.75), loss 2 * 0.75 = 1.5. A masked token counts for nothing."""
    balanced = torch.tensor([[[0.0, LN3], [LN3, 0.0]]])  # [L=1, T=2, E=2]
    torch.testing.assert_close(F.load_balancing_loss(balanced, 1), torch.tensor(1.0))
    skewed = torch.tensor([[[0.0, LN3], [0.0, LN3]]])
    torch.testing.assert_close(F.load_balancing_loss(skewed, 1), torch.tensor(1.5))
    torch.testing.assert_close(F.load_balancing_loss(balanced, 1, torch.tensor([1, 0])), torch.tensor(1.5))
    # two layers pooled: one balanced, one skewed: f = (1/4, 3/4), P = (3/8, 5/8): 2 * (3/32 + 15/32) = 9/8
    torch.testing.assert_close(F.load_balancing_loss(torch.cat([balanced, skewed]), 1), torch.tensor(9 / 8))


def test_expert_load_by_hand():
    chosen = torch.tensor([[1], [0], [1]])
    torch.testing.assert_close(F.expert_load(chosen, 2), torch.tensor([1 / 3, 2 / 3]))
    torch.testing.assert_close(F.expert_load(chosen, 3, torch.tensor([1, 0, 1])), torch.tensor([0.0, 1.0, 0.0]))


def test_the_load_balancing_loss_is_transformers_own():
    """F.load_balancing_loss against transformers' load_balancing_loss_func (Qwen3-MoE's), with and without a
    padding mask."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    torch.manual_seed(0)
    logits = torch.randn(3, 10, 4)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    torch.testing.assert_close(F.load_balancing_loss(logits, 2), load_balancing_loss_func(tuple(logits), 4, 2))
    torch.testing.assert_close(F.load_balancing_loss(logits, 2, mask.view(-1)),
                               load_balancing_loss_func(tuple(logits), 4, 2, mask))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe", "gpt_oss", "qwen3_next", "granitemoehybrid"])
def test_the_training_pass_routes_its_real_tokens_as_the_model_does(family):
    """The training forward's routing (packed rows or padded rows, each prompt in its own row) gives the
    load-balancing loss the model's own forward gives over the same padded rows with their mask, and the
    gradient flows into the routers."""
    from posttrain.models.modeling import collate, forward, use_packed_attention

    model = tiny_model(family).train()
    use_packed_attention(model)
    prompts = [torch.tensor([5, 6, 7, 8, 9]), torch.tensor([10, 11]), torch.tensor([12, 13, 14])]
    completions = torch.tensor([[20, 21, 22, 23], [24, 25, 0, 0], [26, 0, 0, 0]])
    mask = (completions != 0).long()
    batch = collate(prompts, completions, mask, 0, torch.device("cpu"), share_prompts=False)
    out = forward(model, batch)
    # the model's own over the same rows, counting the tokens the training pass computes: a row's last token
    # predicts nothing, so the pass never computes it (masked here; nothing real comes after it)
    counted = batch.attention_mask.clone()
    counted[torch.arange(3), batch.prompt_width + mask.sum(-1) - 1] = 0
    theirs = model(input_ids=batch.input_ids, attention_mask=counted, output_router_logits=True).aux_loss
    torch.testing.assert_close(out.router.aux_loss, theirs, rtol=1e-5, atol=1e-6)
    out.router.aux_loss.backward()
    router = next(m for m in model.modules() if type(m).__name__.lower().endswith("topkrouter"))
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    assert 1.0 <= out.router.metrics["moe/expert_load_max"] <= 4.0


def test_a_config_asking_for_the_load_balancing_loss_adds_it_to_the_runs_loss(tmp_path):
    """Two one-step GRPO runs of the same tiny Qwen3-MoE from the same seed, one whose config sets
    output_router_logits: its loss is the other's plus router_aux_loss_coef times the logged load loss."""
    import posttrain
    from posttrain.models.tiny import char_tokenizer
    from posttrain.tracking.metrics import read_metrics

    tokenizer = char_tokenizer("0123456789+=,|")
    prompts = [{"prompt": f"{a}+{b}="} for a, b in [(1, 2), (3, 4)]]
    losses = {}
    for asked in (False, True):
        model = tiny_model("qwen3_moe", vocab_size=len(tokenizer), output_router_logits=asked, router_aux_loss_coef=0.5)
        result = posttrain.train(model=model, tokenizer=tokenizer, algorithm="grpo", train_dataset=prompts,
                                 reward_funcs=[lambda prompts, completions, **c: [len(x) / 10 for x in completions]],
                                 prompts_per_step=2, group_size=4, max_new_tokens=8, max_steps=1, report_to="none",
                                 progress=False, eval_every=0, save_every=0, output=str(tmp_path / str(asked)))
        losses[asked] = next(row for row in read_metrics(result["run_dir"]) if "loss" in row)
    plain, with_aux = losses[False], losses[True]
    assert plain["moe/aux_loss"] == pytest.approx(with_aux["moe/aux_loss"], rel=1e-5)
    assert with_aux["loss"] == pytest.approx(plain["loss"] + 0.5 * plain["moe/aux_loss"], rel=1e-4, abs=1e-6)
