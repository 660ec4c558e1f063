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
    from posttrain.models.modeling import collate, forward
    from posttrain.models.compute import use_packed_attention

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


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next", "olmoe", "mixtral", "gpt_oss", "granitemoehybrid",
                                    "deepseek_v3", "glm4_moe"])
def test_a_router_given_its_own_choice_gives_its_own_weights(family):
    """Routing replay's weights (models.experts.REPLAYED_WEIGHTS): each family's router, given the experts it
    chose itself, returns exactly its own output: the replayed weights are its own function of its logits."""
    from posttrain.models.experts import RoutingReplay, routers

    model = tiny_model(family)
    seen = []
    handles = [r.register_forward_hook(lambda m, a, out: seen.append(out)) for r in routers(model)]
    ids = torch.randint(3, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    own = model(input_ids=ids).logits
    for h in handles:
        h.remove()
    own_outputs = list(seen)
    with RoutingReplay(model) as replay:
        replay.set_pass(torch.stack([out[2] for out in own_outputs]), torch.ones(12, dtype=torch.bool))
        seen.clear()
        handles = [r.register_forward_hook(lambda m, a, out: seen.append(out)) for r in routers(model)]
        replayed = model(input_ids=ids).logits
        for h in handles:
            h.remove()
    for (_, mine, chosen), (_, theirs, own_chosen) in zip(seen, own_outputs, strict=True):
        assert torch.equal(chosen, own_chosen)
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(replayed, own, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "qwen3_next"])  # decode loop + packed; generate; padded
def test_the_training_pass_replays_the_experts_the_sampler_chose(family, monkeypatch):
    """A bf16 copy samples and records its routing; the float32 policy's training pass with routing replay
    routes every real token exactly as the sampler did (traced after the replay), and its log-probs come
    closer to the sampler's: the mean and the largest gap both shrink."""
    import copy

    from posttrain.models.experts import RouterTrace
    from posttrain.models.modeling import collate, forward
    from posttrain.models.compute import use_packed_attention
    from posttrain.models.tiny import char_tokenizer
    from posttrain.rollout.completions import SamplingParams
    from posttrain.rollout.generators import make_generator

    model = tiny_model(family, num_experts=8, num_local_experts=8)
    use_packed_attention(model)
    sampler = copy.deepcopy(model).to(torch.bfloat16)
    tokenizer = char_tokenizer("".join(chr(c) for c in range(33, 93)))
    generator = make_generator("hf", sampler, tokenizer, SamplingParams(20, 1.0, 1.0, 0), [2], record_routing=True)
    prompts = [torch.randint(3, 64, (n,), generator=torch.Generator().manual_seed(n)) for n in (16, 11, 13)]
    torch.manual_seed(0)
    completions = generator.generate(prompts, num_samples=4)
    rows = [p for p in prompts for _ in range(4)]
    gaps = {}
    for replayed in (False, True):
        batch = collate(rows, completions.completion_ids, completions.mask, 0, torch.device("cpu"),
                        routing=completions.routing if replayed else None)
        with torch.no_grad():
            out = forward(model, batch)
        gap = (out.logprobs - completions.sampling_logprobs)[completions.mask.bool()].abs()
        gaps[replayed] = (float(gap.mean()), float(gap.max()))
    assert gaps[True][0] < gaps[False][0] and gaps[True][1] < gaps[False][1], gaps
    # one padded pass (each row whole) with gradient, whose own trace sees the routers' outputs after the replay:
    # every real token's experts, layer by layer, are the recorded ones
    from posttrain.models import modeling

    traces = []
    monkeypatch.setattr(modeling, "RouterTrace", lambda m: traces.append(RouterTrace(m)) or traces[-1])
    batch = collate(rows, completions.completion_ids, completions.mask, 0, torch.device("cpu"), share_prompts=False,
                    trim_padding=False, routing=completions.routing)
    forward(model, batch)
    chosen_LTK = torch.stack([chosen for _, _, chosen, _ in traces[0].calls])  # one pass: a call per layer
    width = batch.input_ids.shape[1] - 1  # the pass's inputs: the last column predicts nothing
    real = batch.attention_mask[:, :width].clone()
    last = batch.prompt_width + completions.mask.sum(-1).long() - 1  # a row's last token: never an input
    inside = last < width
    real[torch.arange(len(rows))[inside], last[inside]] = 0
    for n in range(len(rows)):
        for col in real[n].nonzero()[:, 0].tolist():
            position = int(batch.position_ids[n, col])
            assert torch.equal(chosen_LTK[:, n * width + col].to(torch.int16), completions.routing[n, :, position])


def _moe_run(tmp_path, name, **settings):
    import posttrain
    from posttrain.models.tiny import char_tokenizer
    from posttrain.tracking.metrics import read_metrics

    tokenizer = char_tokenizer("0123456789+=,|")
    model = settings.pop("model", None) or tiny_model("qwen3_moe", vocab_size=len(tokenizer), num_experts=8)
    prompts = [{"prompt": f"{a}+{b}="} for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]]
    result = posttrain.train(model=model, tokenizer=tokenizer, algorithm="grpo", train_dataset=prompts,
                             reward_funcs=[lambda prompts, completions, **c: [len(x) / 10 for x in completions]],
                             prompts_per_step=4, group_size=4, max_new_tokens=12, max_steps=1, report_to="none",
                             progress=False, eval_every=0, save_every=0, output=str(tmp_path / name), **settings)
    return next(row for row in read_metrics(result["run_dir"]) if "loss" in row)


def test_a_run_with_a_bf16_sampler_trains_on_less_mismatch_with_routing_replay(tmp_path):
    """One GRPO step of a tiny Qwen3-MoE sampled by a bf16 copy (sampler_dtype) and trained in float32, the same
    seed with and without routing replay: the sampler-trainer KL it logs falls with replay."""
    plain = _moe_run(tmp_path, "plain", sampler_dtype="bfloat16")
    replayed = _moe_run(tmp_path, "replayed", sampler_dtype="bfloat16", routing_replay=True)
    assert replayed["mismatch/kl_k3"] < plain["mismatch/kl_k3"]


@pytest.mark.parametrize("settings, message", [
    (dict(model="llama"), "routing_replay: LlamaForCausalLM has no mixture of experts"),
    (dict(gradient_checkpointing=True), "routing_replay: a recomputed layer would route by itself"),
    (dict(backend="vllm"), "routing_replay: the experts are recorded by posttrain's own sampler"),
])
def test_routing_replay_is_refused_where_it_cannot_run(settings, message, tmp_path):
    from posttrain.config import ConfigError
    from posttrain.models.tiny import char_tokenizer

    if settings.get("model") == "llama":
        settings["model"] = tiny_model("llama", vocab_size=len(char_tokenizer("0123456789+=,|")))
    with pytest.raises(ConfigError, match=message):
        _moe_run(tmp_path, "refused", routing_replay=True, **settings)
