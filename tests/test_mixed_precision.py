"""Mixed precision (``--mixed-precision bf16``): float32 weights, gradients and optimizer state; the
decoder stack computed under bfloat16 autocast; the LM head, log-probs and losses in float32."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

import posttrain.functional as F
from posttrain.config import Config, ConfigError
from posttrain.models.modeling import collate, completion_hidden, forward, frozen_copy, split_head
from posttrain.models.compute import autocast_dtype, use_mixed_precision
from posttrain.models import loading

from architectures import build

needs_bf16 = pytest.mark.skipif(not loading.bf16_supported(torch.device("cpu")),
                                reason="this CPU has neither AVX512-BF16 nor AMX")


def a_batch():
    prompts = [torch.tensor([5, 6, 7]), torch.tensor([8]), torch.tensor([5, 6, 7])]
    completions = torch.tensor([[11, 12, 13, 0], [14, 15, 16, 17], [18, 19, 0, 0]])
    return collate(prompts, completions, (completions != 0).long(), 0, torch.device("cpu"))


def run(model, batch):
    """Log-probs and every parameter's gradient of a weighted sum of them."""
    model.zero_grad()
    out = forward(model, batch, temperature=0.7, with_entropy=True)
    (out.logprobs * torch.linspace(-1, 1, out.logprobs.numel()).view_as(out.logprobs)).sum().backward()
    return out.logprobs.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_the_decoder_stack_runs_in_bfloat16_and_the_head_in_float32(kind):
    full = build(kind).train()
    mixed = copy.deepcopy(full)
    use_mixed_precision(mixed)
    batch = a_batch()
    real = batch.mask.bool()
    logprobs, grads = run(mixed, batch)
    logprobs32, grads32 = run(full, batch)
    assert {p.dtype for p in mixed.parameters()} == {torch.float32}  # weights and gradients stay float32
    assert grads.dtype == torch.float32

    body, head = split_head(mixed)
    with torch.no_grad():
        hidden = completion_hidden(body, batch)  # under autocast: the wrapped forward
        hidden32 = completion_hidden(split_head(full)[0], batch)
        head_in_float32, _ = F.linear_log_softmax(hidden[real].float(), head.weight, batch.completion_ids[real],
                                                  temperature=0.7)
    assert (hidden - hidden32).abs().max() > 1e-3  # bfloat16 rounding: the stack did not run in float32
    torch.testing.assert_close(logprobs[real], head_in_float32, rtol=0, atol=0)  # exactly the float32 head
    # bfloat16's cost: log-probs within a few hundredths of a nat, the gradient's direction kept
    assert (logprobs - logprobs32).abs().max() < 0.1
    assert torch.nn.functional.cosine_similarity(grads.double(), grads32.double(), dim=0) > 0.99


def test_attention_stays_float32_on_a_cpu_and_is_not_saved(tmp_path):
    from transformers import LlamaForCausalLM

    from posttrain.models.compute import FLOAT32_SDPA

    model = build("llama")
    assert model.config._attn_implementation == "sdpa"
    use_mixed_precision(model)
    assert model.config._attn_implementation == FLOAT32_SDPA
    assert frozen_copy(model).config._attn_implementation == FLOAT32_SDPA  # the reference too
    seen = []
    model.model.layers[0].self_attn.o_proj.register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
    with torch.no_grad():
        forward(model, a_batch())
    assert seen == [torch.float32]  # the attention's output; under autocast transformers' SDPA gives bfloat16
    model.save_pretrained(tmp_path)
    assert FLOAT32_SDPA not in (tmp_path / "config.json").read_text()
    assert LlamaForCausalLM.from_pretrained(tmp_path).config._attn_implementation == "sdpa"


def test_a_copy_computes_with_its_own_weights_in_the_same_precision():
    """The reference is a deep copy of the policy: the wrapped forward must follow it, not call the policy."""
    policy = build("llama")
    use_mixed_precision(policy)
    ref = frozen_copy(policy)
    assert autocast_dtype(ref) == torch.bfloat16
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(0.5)
        batch = a_batch()
        mine, theirs = forward(ref, batch).logprobs, forward(policy, batch).logprobs
    assert not torch.allclose(mine, theirs)
    use_mixed_precision(policy)  # twice: nothing more
    assert autocast_dtype(policy) == torch.bfloat16


def test_a_replaced_forward_is_not_silently_dropped():
    model = build("llama")
    model.model.forward = lambda *args, **kwargs: None
    with pytest.raises(RuntimeError, match="LlamaModel.forward is already replaced"):
        use_mixed_precision(model)


def test_bad_settings_name_the_field(tiny_model_dir, monkeypatch):
    with pytest.raises(ConfigError, match="mixed_precision: got 'fp16'; use no, bf16 or auto"):
        Config.from_flat({"mixed_precision": "fp16"})
    with pytest.raises(ConfigError, match="mixed_precision: bf16 computes float32 weights in bfloat16; with dtype "
                                          "bfloat16"):
        Config.from_flat({"mixed_precision": "bf16", "dtype": "bfloat16"})
    monkeypatch.setattr(loading, "bf16_supported", lambda device: False)
    with pytest.raises(ConfigError, match=r"mixed_precision: bf16 computes in bfloat16, which is not supported "
                                          r"natively on this CPU .*; use --mixed-precision no"):
        loading.load_model_and_tokenizer(str(tiny_model_dir), device="cpu", mixed_precision="bf16")


@pytest.mark.parametrize("native", [False, True])
def test_auto_is_bf16_only_where_the_hardware_computes_it(tiny_model_dir, native, monkeypatch, capsys):
    """``mixed_precision auto``: bf16 on a CPU with AVX512-BF16 or AMX, float32 elsewhere (emulated bfloat16
    products are slower there), decided before anything loads and said in one line; with bfloat16 weights it
    is no, as they already are."""
    from posttrain.training import defaults

    monkeypatch.setattr(loading, "bf16_supported", lambda device: native)
    config = defaults.decided_precision(Config.from_flat({"mixed_precision": "auto", "device": "cpu"}))
    assert config.model.mixed_precision == ("bf16" if native else "no")
    said = capsys.readouterr().err
    assert f"mixed_precision auto -> {'bf16' if native else 'no'}: " in said
    assert ("computes bfloat16 natively" if native else "neither AVX512-BF16 nor AMX") in said
    bf16_weights = Config.from_flat({"mixed_precision": "auto", "dtype": "bfloat16", "device": "cpu"})
    assert defaults.decided_precision(bf16_weights).model.mixed_precision == "no"
    model, _ = loading.load_model_and_tokenizer(str(tiny_model_dir), device="cpu", mixed_precision="auto")
    assert autocast_dtype(model) == (torch.bfloat16 if native else None)


def test_an_accelerate_launch_brings_its_mixed_precision(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(loading, "bf16_supported", lambda device: True)
    for launched, expected in (("no", None), ("bf16", torch.bfloat16)):
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", launched)
        model, _ = loading.load_model_and_tokenizer(str(tiny_model_dir), device="cpu")
        assert autocast_dtype(model) == expected
    with pytest.raises(ConfigError, match="mixed_precision: .* with dtype bfloat16 they already are"):
        loading.load_model_and_tokenizer(str(tiny_model_dir), device="cpu", dtype="bfloat16")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    with pytest.raises(ConfigError, match="accelerate config asks for fp16, which posttrain does not run"):
        loading.load_model_and_tokenizer(str(tiny_model_dir), device="cpu")


@needs_bf16
@pytest.mark.parametrize("algorithm, lora_r", [("grpo", 0), ("ppo", 0), ("dpo", 0), ("grpo", 4)],
                         ids=["grpo", "ppo", "dpo", "grpo-lora"])
def test_training_runs_in_mixed_precision(algorithm, lora_r, tiny_model_dir, reward_file):
    from posttrain.training import online, preference
    from posttrain.training.session import OnlineSession

    if lora_r and importlib.util.find_spec("peft") is None:
        pytest.skip("peft (extra: lora) is not installed")
    flat = dict(algorithm=algorithm, model=str(tiny_model_dir), task="addition", learning_rate=1e-3, max_steps=2,
                progress=False, report_to="none", seed=0, eval_size=8, mixed_precision="bf16", lora_r=lora_r)
    if algorithm != "dpo":
        flat.update(reward=[f"{reward_file}:sevens"], prompts_per_step=4, group_size=4, max_new_tokens=12)
        s = OnlineSession.create(Config.from_flat(flat))
        step = online.train_step
    else:  # the fixed pairs: a random model never adds, so no pair of its own samples has a right answer
        s = preference.PreferenceSession.create(Config.from_flat({**flat, "pairs_from": "dataset"}))
        step = preference.train_step
    before = [p.detach().clone() for p in s.policy.parameters()]
    for _ in range(2):
        metrics = step(s)
        s.step += 1
        assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values()), metrics
    assert autocast_dtype(s.policy) == torch.bfloat16
    if s.ref is not None:  # (DPO's reference scored everything up front; LoRA's is the policy, adapters off)
        assert autocast_dtype(s.ref.model if lora_r else s.ref) == torch.bfloat16
    assert {p.dtype for p in s.policy.parameters()} == {torch.float32}
    assert any(not torch.equal(a, b) for a, b in zip(before, s.policy.parameters()))
    if algorithm == "ppo":  # the value head reads the stack's hidden states in float32
        assert metrics["value_loss"] > 0 and s.value_head.linear.weight.dtype == torch.float32


def lora_under_autocast():
    """A tiny Llama under bfloat16 autocast with LoRA adapters whose B is random (so the adapters take
    part), and a function giving its log-probs on :func:`a_batch` and the adapters' gradients."""
    from posttrain.config import ModelConfig
    from posttrain.models.lora import apply_lora

    model = build("llama").train()
    use_mixed_precision(model)
    lora = apply_lora(model, ModelConfig(lora_r=2, lora_alpha=4.0))
    for m in lora.modules():
        if hasattr(m, "lora_B"):
            torch.nn.init.normal_(m.lora_B["default"].weight, std=0.3)
    batch = a_batch()

    def logprobs_and_adapter_grads():
        lora.zero_grad()
        out = forward(lora, batch, temperature=0.7)
        (out.logprobs * torch.linspace(-1, 1, out.logprobs.numel()).view_as(out.logprobs)).sum().backward()
        return out.logprobs.detach(), torch.cat([p.grad.flatten() for p in lora.parameters() if p.requires_grad])

    return lora, logprobs_and_adapter_grads


@needs_bf16
@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft (extra: lora) is not installed")
def test_lora_under_autocast_skips_peft_s_input_cast_and_computes_the_same():
    """Under mixed precision the LoRA layers take their bfloat16 inputs as they are (autocast casts the
    product's operands anyway): the same log-probs and gradients, bit for bit, as with PEFT's cast."""
    lora, logprobs_and_adapter_grads = lora_under_autocast()
    layers = [m for m in lora.modules() if hasattr(m, "cast_input_dtype_enabled")]
    assert layers and not any(m.cast_input_dtype_enabled for m in layers)
    without_cast = logprobs_and_adapter_grads()
    for m in layers:
        m.cast_input_dtype_enabled = True
    with_cast = logprobs_and_adapter_grads()
    assert torch.equal(without_cast[0], with_cast[0]) and torch.equal(without_cast[1], with_cast[1])


@needs_bf16
@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft (extra: lora) is not installed")
def test_lora_keeps_the_frozen_weights_cast_and_computes_what_autocast_computes():
    """Under mixed precision each frozen base weight is cast to bfloat16 once, not in every forward: the
    same log-probs and adapter gradients, bit for bit, as autocast's own per-forward cast. The kept cast
    is remade when the weight changes in place (a checkpoint load), not used while PEFT's adapters are
    merged into the weight (its merge writes through ``.data``, which the version counter does not
    see), and bypassed when the weight trains."""
    from posttrain.models.lora import cast_frozen_weights_once, forget_kept_casts

    lora, logprobs_and_adapter_grads = lora_under_autocast()
    batch = a_batch()
    bases = [m.base_layer for m in lora.modules() if hasattr(m, "lora_A")]
    assert bases and all("forward" in vars(b) for b in bases)
    kept = logprobs_and_adapter_grads()
    casts = [b._posttrain_kept_cast[1] for b in bases]
    assert all(c.dtype == torch.bfloat16 for c in casts)
    again = logprobs_and_adapter_grads()
    assert all(b._posttrain_kept_cast[1] is c for b, c in zip(bases, casts))  # not cast again
    for b in bases:  # autocast's own cast in every forward
        del b.forward
    plain = logprobs_and_adapter_grads()
    assert torch.equal(kept[0], plain[0]) and torch.equal(kept[1], plain[1]) and torch.equal(again[0], plain[0])

    cast_frozen_weights_once(lora)
    logprobs_and_adapter_grads()
    with torch.no_grad():  # as load_state_dict writes a weight: in place
        bases[0].weight.mul_(1.5)
    changed = logprobs_and_adapter_grads()
    for b in bases:
        del b.forward
    assert torch.equal(changed[0], logprobs_and_adapter_grads()[0]) and not torch.equal(changed[0], kept[0])
    cast_frozen_weights_once(lora)
    logprobs_and_adapter_grads()  # casts kept, then the merge changes the weights behind the version counter
    lora.merge_adapter()

    def merged_logprobs():
        with torch.no_grad():
            return forward(lora, batch, temperature=0.7).logprobs

    while_merged = merged_logprobs()
    assert not any("_posttrain_kept_cast" in vars(b) for b in bases)  # cast as autocast does, kept casts dropped
    for b in bases:
        del b.forward
    assert torch.equal(while_merged, merged_logprobs())
    lora.unmerge_adapter()
    cast_frozen_weights_once(lora)
    logprobs_and_adapter_grads()
    forget_kept_casts(lora)
    assert not any("_posttrain_kept_cast" in vars(b) for b in bases)
    bases[0].weight.requires_grad_(True)  # a trained weight is never served from a kept cast
    logprobs_and_adapter_grads()
    assert "_posttrain_kept_cast" not in vars(bases[0])
