"""The training forward (posttrain.models.modeling.forward) through the folded LM head and shared prompts,
against the model's own forward over whole rows and the unfused log-softmax."""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch
from architectures import build


def forward_case(kind, lora, shared, monkeypatch, prepare=None):
    """A model (LoRA on q and v when ``lora``; ``prepare`` applied to it), a value head, a collated batch of 5
    rows (prompts shared by rows 0/2 and 1/4 when ``shared``) and ``run()``: the training forward's
    log-probs and values, backward through both, every gradient. Also the model's decoder body."""
    from posttrain.models import modeling
    from posttrain.models.modeling import ValueHead, collate

    if lora and importlib.util.find_spec("peft") is None:
        pytest.skip("peft (extra: lora) is not installed")
    model = build(kind).train()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    if prepare is not None:
        prepare(model)
    assert modeling.split_head(model) is not None
    torch.manual_seed(1)
    value_head = ValueHead(32)
    torch.nn.init.normal_(value_head.linear.weight)
    a, b, c = torch.tensor([5, 6, 7]), torch.tensor([8]), torch.tensor([9, 10])
    prompts = [a, b, a, c, b] if shared else [a, b, c, torch.tensor([20]), torch.tensor([21, 22, 23, 24])]
    completions = torch.tensor([[11, 12, 13, 0], [14, 15, 0, 0], [16, 17, 18, 19], [25, 0, 0, 0], [26, 27, 28, 0]])
    mask = (completions != 0).long()
    monkeypatch.setattr(modeling, "worth_sharing", lambda *sizes: True)  # these prompts are too short to pay
    batch = collate(prompts, completions, mask, 0, torch.device("cpu"))
    assert (batch.owner_n is not None) is shared
    upstream = torch.randn(5, 4)
    params = [p for p in list(model.parameters()) + list(value_head.parameters()) if p.requires_grad]

    def run():
        for p in params:
            p.grad = None
        out = modeling.forward(model, batch, temperature=0.7, with_entropy=True, value_head=value_head)
        ((out.logprobs * upstream + out.values) * batch.mask).sum().backward()
        return out, [p.grad.clone() for p in params]

    return batch, run, modeling.split_head(model)[0]


def as_models_own_forward(batch, monkeypatch):
    """The reference every path is checked against: the model's own forward (its head included) over the
    batch's whole padded rows, no packing, no shared prompt, no folded head."""
    from posttrain.models import modeling

    monkeypatch.setattr(modeling, "split_head", lambda model: None)
    batch.trim_padding, batch.first_U, batch.owner_n = False, None, None


def assert_same_forward(mine, theirs, mine_grads, their_grads, mask):
    """Log-probs, entropies and values on the real tokens to float32 rounding, zero log-probs elsewhere, and
    every gradient relative to its tensor's scale."""
    real = mask.bool()
    torch.testing.assert_close(mine.logprobs[real], theirs.logprobs[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mine.entropy[real], theirs.entropy[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mine.values[real], theirs.values[real], rtol=1e-5, atol=1e-5)
    assert (mine.logprobs[~real] == 0).all()
    for a, b in zip(mine_grads, their_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * max(1.0, float(b.abs().max())))


@pytest.mark.parametrize("bucketed", [False, True], ids=["one-pass", "by-length"])
@pytest.mark.parametrize("shared", [False, True], ids=["distinct-prompts", "shared-prompts"])
@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("kind", ["llama", "llama-biases-untied-rope-scaled", "qwen2"])
def test_training_forward_with_the_folded_head_equals_the_models_own(kind, lora, shared, bucketed, monkeypatch):
    """modeling.forward through linear_log_softmax (with shared prompts, each prompt run once; by
    length, each group of rows trimmed to its longest completion) against the model's own forward over
    whole rows and the unfused log-softmax: log-probs, entropies, values and every gradient."""
    from posttrain.models import modeling

    monkeypatch.setattr(modeling, "BUCKET_COST", 0 if bucketed else 10**6)  # lengths 3, 2, 4, 1, 3
    batch, run, body = forward_case(kind, lora, shared, monkeypatch)
    rows_per_call = []
    body_forward = body.forward
    monkeypatch.setattr(body, "forward", lambda **kw: rows_per_call.append(len(kw["input_ids"])) or body_forward(**kw))
    folded, folded_grads = run()
    # the distinct prompts once, then every completion; by length: rows [3], [1], [0, 4], [2], the first
    # (one token) predicted by its prompt's last position alone
    expected_calls = {(False, False): [5], (True, False): [3, 5], (False, True): [1, 1, 2, 1], (True, True): [3, 1, 2, 1]}
    assert rows_per_call == expected_calls[shared, bucketed]
    as_models_own_forward(batch, monkeypatch)
    direct, direct_grads = run()
    assert_same_forward(folded, direct, folded_grads, direct_grads, batch.mask)


@pytest.mark.parametrize("checkpointed", [False, True], ids=["", "checkpointed"])
@pytest.mark.parametrize("shared", [False, True], ids=["distinct-prompts", "shared-prompts"])
@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("kind", ["llama", "llama-biases-untied-rope-scaled", "qwen2"])
def test_packed_pass_equals_the_models_own_forward_over_padded_rows(kind, lora, shared, checkpointed, monkeypatch):
    """One packed pass (posttrain.models.packing: no padding, a shared prompt placed once, attention kept
    inside each group) against the model's own forward over whole padded rows: log-probs, entropies,
    values and every gradient, to float32 rounding; with gradient checkpointing the recomputed layers
    get the layout again."""
    from posttrain.models.compute import checkpoint_layers, use_packed_attention
    from posttrain.models.packing import has_packed_attention

    def prepare(model):
        assert use_packed_attention(model)
        if checkpointed:
            checkpoint_layers(model)

    batch, run, body = forward_case(kind, lora, shared, monkeypatch, prepare)
    assert has_packed_attention(body)
    calls = []
    body_forward = body.forward
    monkeypatch.setattr(body, "forward", lambda **kw: calls.append(kw["input_ids"].shape) or body_forward(**kw))
    packed, packed_grads = run()
    # one row: each prompt once (shared) or per row, and every completion but its last token
    prompt_tokens = (3 + 1 + 2) if shared else (3 + 1 + 2 + 1 + 4)
    assert calls == [torch.Size([1, prompt_tokens + (3 + 2 + 4 + 1 + 3) - 5])]
    as_models_own_forward(batch, monkeypatch)
    direct, direct_grads = run()
    assert_same_forward(packed, direct, packed_grads, direct_grads, batch.mask)


@pytest.mark.parametrize("path", ["folded-shared", "folded-whole-rows", "models-own-forward"])
@pytest.mark.parametrize("completion_width", [1, 3])
def test_training_forward_equals_the_log_softmax_of_each_rows_full_logits(path, completion_width, monkeypatch):
    """Every path of modeling.forward against the textbook computation, one row at a time with no
    padding: the model's logits over prompt + completion, log-softmax, the sampled token's entry. The
    layers never see a row's last position (it predicts nothing)."""
    from posttrain.models import modeling
    from posttrain.models.modeling import collate

    model = build("llama")
    a, b = torch.tensor([5, 6, 7]), torch.tensor([8])
    prompts = [a, a, b, b]
    completions = torch.tensor([[11, 12, 13], [14, 15, 0], [16, 0, 0], [17, 18, 19]])[:, :completion_width]
    mask = (completions != 0).long()
    monkeypatch.setattr(modeling, "worth_sharing", lambda *sizes: path == "folded-shared")
    if path == "models-own-forward":
        monkeypatch.setattr(modeling, "split_head", lambda model: None)
    batch = collate(prompts, completions, mask, 0, torch.device("cpu"))
    widths = []
    forward_of = modeling.split_head(model)[0] if path != "models-own-forward" else model
    inner = forward_of.forward
    monkeypatch.setattr(forward_of, "forward", lambda **kw: widths.append(kw["input_ids"].shape[1]) or inner(**kw))
    with torch.no_grad():
        out = modeling.forward(model, batch, temperature=0.7)
        widths_seen = list(widths)
        for row, (prompt, completion) in enumerate(zip(prompts, completions)):
            n = int(mask[row].sum())
            ids = torch.cat([prompt, completion[:n]])[None]
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1] / 0.7  # position P + t - 1 predicts token t
            expected = logits.log_softmax(-1).gather(-1, completion[:n, None])[:, 0]
            torch.testing.assert_close(out.logprobs[row, :n], expected, rtol=1e-5, atol=1e-5)
            assert (out.logprobs[row, n:] == 0).all()
    prompt_width = 3  # the longest prompt
    expected_widths = {"folded-shared": [prompt_width, completion_width - 1] if completion_width > 1 else [prompt_width],
                       "folded-whole-rows": [prompt_width + completion_width - 1],
                       "models-own-forward": [prompt_width + completion_width - 1]}[path]
    assert widths_seen == expected_widths


def test_collate_finds_the_rows_that_share_a_prompt(monkeypatch):
    from posttrain.models import modeling
    from posttrain.models.modeling import collate

    monkeypatch.setattr(modeling, "worth_sharing", lambda *sizes: True)

    a, b, c = torch.tensor([5, 6]), torch.tensor([7]), torch.tensor([5, 6])  # c equals a in content
    completions = torch.tensor([[1, 2], [3, 0], [4, 5], [6, 7]])
    batch = collate([b, a, c, b], completions, (completions != 0).long(), 0, torch.device("cpu"))
    assert batch.first_U.tolist() == [0, 1] and batch.owner_n.tolist() == [0, 1, 1, 0]
    assert batch.prompt_width == 2
    distinct = collate([a, b], completions[:2], torch.ones(2, 2, dtype=torch.long), 0, torch.device("cpu"))
    assert distinct.first_U is None and distinct.owner_n is None


def test_length_buckets_pad_each_group_to_its_own_longest_row():
    from posttrain.models.modeling import length_buckets

    assert length_buckets([5, 2, 9, 3], cost=0) == [[1], [3], [0], [2]]  # no cost: every length its own
    assert length_buckets([5, 2, 9, 3], cost=100) == [[0, 1, 2, 3]]  # nothing saves 100 positions: one pass
    # 8 rows: four of ~10 tokens and four of ~120; one pass pads 8 x 124 = 992, two cost 4 x 12 + 4 x 124 + 2c
    lengths = [120, 10, 124, 12, 118, 9, 11, 122]
    assert length_buckets(lengths, cost=32) == [[5, 1, 6, 3], [4, 0, 7, 2]]
    assert length_buckets([7], cost=0) == [[0]]


def test_sharing_prompts_is_chosen_where_it_measured_faster():
    from posttrain.models.modeling import worth_sharing

    assert worth_sharing(16, 4, 13, 32)  # GRPO, 4 prompts x 4: saves 156 of 720 positions
    assert worth_sharing(16, 4, 75, 32)  # long prompts: saves 900 of 1712
    assert not worth_sharing(8, 4, 13, 18)  # a DPO step of 4 pairs: saves 52 of 248, measured slower
    assert worth_sharing(8, 4, 48, 118)  # the same with 48-token prompts: saves 192 of 1328, measured faster
    assert not worth_sharing(8, 4, 40, 200)  # saves 160 of 1920, under a tenth: not worth a second pass
    assert not worth_sharing(4, 4, 100, 10)  # nothing shared


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft (extra: lora) is not installed")
def test_only_lora_wrappers_get_the_folded_head():
    """Prompt tuning acts in the PEFT wrapper's forward, which calling the body directly would skip."""
    from peft import LoraConfig, PromptTuningConfig, get_peft_model

    from posttrain.models.modeling import split_head

    assert split_head(get_peft_model(build("llama"), LoraConfig(r=2, target_modules=["q_proj"]))) is not None
    prompt_tuned = get_peft_model(build("llama"), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2))
    assert split_head(prompt_tuned) is None


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("mode", ["eval", "train-with-dropout"])
def test_gradient_checkpointing_gives_the_same_gradients_with_fewer_saved_activations(mode, lora, monkeypatch):
    """checkpoint_layers: each decoder layer keeps only its inputs and is recomputed in the backward.
    Log-probs and every gradient equal the stored-activation run's (dropout included: the recompute
    replays the RNG state), the layers really are recomputed, and rows that share a prompt run
    whole (a recomputed prompt pass would write its cache twice)."""
    from posttrain.models import modeling
    from posttrain.models.modeling import collate
    from posttrain.models.compute import checkpoint_layers, is_checkpointed

    if lora and importlib.util.find_spec("peft") is None:
        pytest.skip("peft (extra: lora) is not installed")

    def model():
        m = build("llama")
        if mode != "eval":
            m.config.attention_dropout = 0.3
            m.train()
        if lora:
            from peft import LoraConfig, get_peft_model

            m = get_peft_model(m, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
        return m

    a, b = torch.tensor([5, 6, 7]), torch.tensor([8])
    completions = torch.tensor([[11, 12, 13, 0], [14, 15, 0, 0], [16, 17, 18, 19], [25, 26, 0, 0]])
    batch = collate([a, a, b, b], completions, (completions != 0).long(), 0, torch.device("cpu"))
    upstream = torch.randn(4, 4)

    def run(m):
        torch.manual_seed(3)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            out = modeling.forward(m, batch, temperature=0.7, with_entropy=True)
        (out.logprobs * upstream * batch.mask).sum().backward()
        return out.logprobs.detach(), {n: p.grad for n, p in m.named_parameters() if p.requires_grad}, sum(saved)

    plain, plain_grads, plain_saved = run(model())
    checkpointed_model = model()
    assert checkpoint_layers(checkpointed_model) == 2 and is_checkpointed(checkpointed_model)
    calls = []
    layer = next(m for m in checkpointed_model.modules() if getattr(m, "posttrain_checkpointed", False))
    layer.self_attn.register_forward_pre_hook(lambda *args: calls.append("run"))
    checkpointed, grads, checkpointed_saved = run(checkpointed_model)
    assert calls.count("run") == 2  # forward, then the recompute in the backward
    assert checkpointed_saved < plain_saved / 2
    torch.testing.assert_close(checkpointed, plain, rtol=0, atol=0)
    assert grads.keys() == plain_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], plain_grads[name], rtol=0, atol=0, msg=name)
    with torch.no_grad():  # no-grad passes (reference, rollout log-probs) run the layer once, as before
        calls.clear()
        modeling.forward(checkpointed_model, batch, temperature=0.7)
        assert calls.count("run") == 1

    monkeypatch.setattr(modeling, "worth_sharing", lambda *sizes: True)  # these prompts are too short to pay
    shared = collate([a, a, b, b], completions, (completions != 0).long(), 0, torch.device("cpu"))
    body = modeling.split_head(checkpointed_model)[0]
    rows_per_call = []
    body_forward = body.forward
    monkeypatch.setattr(body, "forward", lambda **kw: rows_per_call.append(len(kw["input_ids"])) or body_forward(**kw))
    modeling.forward(checkpointed_model, shared, temperature=0.7)
    assert rows_per_call == [4]  # with gradient: whole rows, one pass
    with torch.no_grad():
        modeling.forward(checkpointed_model, shared, temperature=0.7)
    assert rows_per_call == [4, 2, 4]  # without: the two distinct prompts once, then every completion


def test_gradient_checkpointing_names_a_model_without_decoder_layers():
    from posttrain.config import ConfigError
    from posttrain.models.compute import checkpoint_layers

    with pytest.raises(ConfigError, match="gradient_checkpointing: Linear has no decoder layers"):
        checkpoint_layers(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
def test_fused_adapter_product_equals_peft_forward_and_gradients(autocast):
    """posttrain.models.lora's fused LoRA linear against peft's own forward: outputs and the gradients of
    the input and both adapters (float32 rounding in float32; bf16 rounding under autocast), and peft's
    forward wherever the adapters are switched off."""
    if importlib.util.find_spec("peft") is None:
        pytest.skip("peft (extra: lora) is not installed")
    from peft import LoraConfig, get_peft_model

    from posttrain.models.lora import fuse_adapter_products

    if autocast and not torch.backends.mkldnn.is_available():
        pytest.skip("no bf16 on this CPU")
    model = get_peft_model(build("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"],
                                                      init_lora_weights=False))
    layer = model.base_model.model.model.layers[0].mlp.up_proj
    torch.manual_seed(0)
    x = torch.randn(2, 5, layer.in_features)
    upstream = torch.randn(2, 5, layer.out_features)

    def run():
        inputs = x.clone().requires_grad_()
        for p in layer.parameters():
            p.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = layer(inputs)
        (out.float() * upstream).sum().backward()
        grads = [inputs.grad] + [p.grad.clone() for p in layer.parameters() if p.requires_grad]
        return out.float(), grads

    peft_out, peft_grads = run()
    fuse_adapter_products(model)
    assert isinstance(layer.forward, functools.partial)
    fused_out, fused_grads = run()
    tolerance = dict(rtol=2e-2, atol=2e-2) if autocast else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused_out, peft_out, **tolerance)
    assert len(fused_grads) == 3
    for mine, theirs in zip(fused_grads, peft_grads, strict=True):
        torch.testing.assert_close(mine, theirs, **tolerance)
    with model.disable_adapter():
        assert torch.equal(layer(x), layer.base_layer(x))


def test_packed_pass_with_a_one_token_completion_in_a_shared_group(monkeypatch):
    """A group member whose completion is one token has no completion inputs (its token is predicted by the
    prompt's last position): an empty piece in the packed row, the same log-probs and gradients."""
    from posttrain.models import modeling
    from posttrain.models.modeling import collate
    from posttrain.models.compute import use_packed_attention

    model = build("llama").train()
    assert use_packed_attention(model)
    monkeypatch.setattr(modeling, "worth_sharing", lambda *sizes: True)
    prompt = torch.tensor([5, 6, 7])
    completions = torch.tensor([[11, 0, 0], [12, 13, 14], [15, 0, 0]])
    batch = collate([prompt, prompt, prompt], completions, (completions != 0).long(), 0, torch.device("cpu"))
    assert batch.owner_n is not None

    def run():
        model.zero_grad()
        out = modeling.forward(model, batch)
        (out.logprobs * batch.mask).sum().backward()
        return out.logprobs.detach(), [p.grad.clone() for p in model.parameters()]

    packed, packed_grads = run()
    as_models_own_forward(batch, monkeypatch)
    direct, direct_grads = run()
    torch.testing.assert_close(packed, direct, rtol=1e-5, atol=1e-5)
    for mine, theirs in zip(packed_grads, direct_grads, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5 * max(1.0, float(theirs.abs().max())))


def test_a_packed_pass_builds_no_attention_mask(monkeypatch):
    """The packed attention never reads transformers' mask, so none is built: with restarting position ids and
    no mask given, transformers would build an [S, S] one every forward."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    from posttrain.models.compute import use_packed_attention

    batch, run, body = forward_case("llama", False, True, monkeypatch, lambda model: use_packed_attention(model))
    name = body.config._attn_implementation
    build, masks = ALL_MASK_ATTENTION_FUNCTIONS[name], []
    monkeypatch.setitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, name,
                        lambda *args, **kwargs: masks.append(build(*args, **kwargs)) or masks[-1])
    run()
    assert masks == [None]


def reference_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa):
    """PyTorch's ``varlen_attn`` as documented, on the CPU: per segment, causal from the bottom right (query i
    of mq sees keys up to i + mk - mq), which ``window_size=(-1, 0)`` asks for."""
    assert window_size == (-1, 0) and max_q == int((cu_q[1:] - cu_q[:-1]).max())
    assert max_k == int((cu_k[1:] - cu_k[:-1]).max())
    outs = []
    for s in range(len(cu_q) - 1):
        qs = q[cu_q[s]:cu_q[s + 1]].transpose(0, 1)  # [H, mq, d]
        ks, vs = (t[cu_k[s]:cu_k[s + 1]].transpose(0, 1) for t in (k, v))
        mq, mk = qs.shape[1], ks.shape[1]
        mask = torch.ones(mq, mk, dtype=torch.bool).tril(mk - mq)
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=enable_gqa).transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("shared", [False, True], ids=["distinct-prompts", "shared-prompts"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_the_variable_length_layout_equals_the_models_own_forward(kind, shared, monkeypatch):
    """The GPU path's segments (packing.VarlenIndex: a completion's keys are its prompt's and its own, causal
    from the bottom right) through a CPU stand-in for FlashAttention's varlen kernel, against the model's
    own forward over padded rows: log-probs, entropies, values, every gradient."""
    from posttrain.models import packing
    from posttrain.models.compute import use_packed_attention

    calls = []
    monkeypatch.setattr(packing, "varlen_kernel", lambda query: lambda *a, **kw: calls.append(a[3]) or
                        reference_varlen_attn(*a, **kw))
    batch, run, _ = forward_case(kind, False, shared, monkeypatch, lambda model: use_packed_attention(model))
    calls.clear()  # use_packed_attention's own check of a packed pass ran through the stand-in too
    varlen, varlen_grads = run()
    # one call per layer: a segment per row, or (shared) for prompts a and b a prompt segment and one per
    # completion each, and row 3 (prompt c, alone) one
    segments = 7 if shared else 5
    assert calls and all(len(cu) == segments + 1 for cu in calls)
    as_models_own_forward(batch, monkeypatch)
    direct, direct_grads = run()
    assert_same_forward(varlen, direct, varlen_grads, direct_grads, batch.mask)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention's varlen kernel runs on a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_cuda_varlen_kernel_equals_per_group_attention(dtype):
    """On a GPU (scripts/gpu_check.sh): PyTorch's varlen_attn over the layout's segments against one SDPA call
    per group, outputs and gradients within the dtype's rounding."""
    from posttrain.models import packing

    prompts = [torch.tensor([5, 6, 7]), torch.tensor([8]), torch.tensor([5, 6, 7]), torch.tensor([9, 10])]
    ids = torch.zeros(4, 3 + 4, dtype=torch.long)
    mask = torch.zeros_like(ids)
    lengths = torch.tensor([4, 2, 3, 1])
    for row, (prompt, n) in enumerate(zip(prompts, lengths)):
        ids[row, 3 - len(prompt):3], mask[row, 3 - len(prompt):3] = prompt, 1
        ids[row, 3:3 + n], mask[row, 3:3 + n] = torch.arange(11, 11 + n), 1
    _, _, layout = packing.pack(ids, mask, 3, lengths, torch.tensor([0, 1, 0, 2]))
    layout = layout.to(torch.device("cuda"))
    size = sum(piece for span in layout.spans for piece in span.pieces)
    torch.manual_seed(0)
    q = torch.randn(1, 4, size, 16, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, 2, size, 16, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    kernel = packing.varlen_kernel(q)
    assert kernel is not None
    outs = []
    for attend in (lambda: packing._varlen_attention(q, k, v, layout, 0.25, kernel)[0],
                   lambda: packing._packed_attention(q, k, v, layout, 0.25)[0]):
        out = attend()
        grads = torch.autograd.grad((out.float() * torch.linspace(-1, 1, out.numel(), device="cuda").view_as(out)).sum(),
                                    (q, k, v))
        outs.append((out, grads))
    tolerance = dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(outs[0][0], outs[1][0], **tolerance)
    for a, b in zip(outs[0][1], outs[1][1]):
        torch.testing.assert_close(a, b, **tolerance)


def test_a_varlen_kernel_of_another_signature_is_not_called(monkeypatch, caplog):
    """The GPU kernel is called with PyTorch 2.13's keywords (scale, window_size, enable_gqa); a varlen_attn
    without them (an older PyTorch) is said once and left for the per-sequence SDPA calls."""
    from posttrain.models import packing

    def older(query, key, value, cu_q, cu_k, max_q, max_k, *, is_causal=False):
        raise AssertionError("not to be called")

    def current(query, key, value, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        raise AssertionError("not to be called")

    packing._varlen_signature_reason.cache_clear()
    with caplog.at_level("WARNING"):
        assert packing._varlen_signature_reason(older) == (
            f"torch {torch.__version__}'s varlen_attn takes no enable_gqa, scale, window_size (PyTorch 2.13's does); "
            "packed passes run one SDPA call per sequence instead")
    assert packing._varlen_signature_reason(current) is None
    assert "varlen_attn takes no" in caplog.text


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_a_lora_reference_pass_takes_the_folded_head_and_equals_the_base_models_forward(packed, monkeypatch):
    """A LoRA policy's reference (its base model, adapters off) runs the policy's own passes: the folded head,
    never the [n, T, V] logits (which on SmolLM2 added 3 GiB to every step after the first), and its log-probs
    equal a copy of the model without adapters over whole rows; the policy's training mode is restored."""
    import copy

    from peft import LoraConfig, get_peft_model

    from posttrain.models import modeling
    from posttrain.models.logprobs import batched_logprobs
    from posttrain.models.lora import reference_model

    base = build("llama").train()
    plain = copy.deepcopy(base).eval()
    policy = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    ref = reference_model(policy)
    prompts = [torch.tensor([5, 6, 7]), torch.tensor([8]), torch.tensor([5, 6, 7])]
    completions = torch.tensor([[11, 12, 13, 0], [14, 15, 0, 0], [16, 17, 18, 19]])
    mask = (completions != 0).float()
    if not packed:
        monkeypatch.setattr(modeling, "has_packed_attention", lambda model: False)
    monkeypatch.setattr(modeling, "_from_logits", lambda *a, **k: pytest.fail("the reference pass built logits"))
    theirs = []
    for prompt, row, m in zip(prompts, completions, mask):
        ids = torch.cat([prompt, row[m.bool()]])[None]
        with torch.no_grad():
            logp = plain(input_ids=ids).logits[0, :-1].log_softmax(-1)
        theirs.append(logp.gather(1, ids[0, 1:, None])[len(prompt) - 1:, 0])
    mine, _ = batched_logprobs(ref, prompts, completions, mask, pad_id=0, micro_batch_size=8)
    for row, expected in enumerate(theirs):
        torch.testing.assert_close(mine[row, :len(expected)], expected, rtol=1e-5, atol=1e-5)
    adapted, _ = batched_logprobs(policy, prompts, completions, mask, pad_id=0, micro_batch_size=8)
    assert (adapted - mine).abs().max() > 1e-3  # the adapters are on again, and they change the log-probs
    assert policy.training
