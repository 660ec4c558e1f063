"""posttrain's decode loop (FastGenerator) against transformers' generate, on tiny random models built here.

Greedy decoding must give generate's tokens, masks and truncation flags exactly; sampling must draw
from the distribution transformers' logits warpers define; the log-probs it samples with must equal a
fresh teacher-forced forward pass (which checks the KV cache, the broadcast prefill, the positions
under left padding and the compaction of finished rows).
"""

from __future__ import annotations

import importlib.util
import logging
from types import SimpleNamespace

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from posttrain.rollout import generation as generation_module
from posttrain.rollout.generation import draw, fill_order, next_tokens, sampling_distribution
from posttrain.models.logprobs import batched_logprobs
from posttrain.rollout.completions import SamplingParams
from posttrain.rollout.generators import FastGenerator, HFGenerator, make_generator

PAD, EOS = 0, [2, 11, 13]  # three EOS ids: with the model below, rows end at different steps
BUDGET = 12


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    """Two layers, grouped-query attention (4 query heads, 2 KV heads); weights large enough
    (std 0.3) that greedy decoding does not repeat one token."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=24, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         initializer_range=0.3, pad_token_id=PAD, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(config).eval()


def tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    """Learned absolute position embeddings: unlike rotary ones, a shifted position changes the output."""
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=24, n_embd=32, n_layer=2, n_head=4, n_positions=64, initializer_range=0.3,
                        pad_token_id=PAD, bos_token_id=1, eos_token_id=2)
    return GPT2LMHeadModel(config).eval()


MODELS = {"llama": tiny_llama, "gpt2": tiny_gpt2}


def prompts() -> list[torch.Tensor]:
    """Six prompts of 1 to 7 tokens (left padding differs per row)."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 24, (n,), generator=g) for n in (3, 7, 1, 5, 4, 6)]


def generators(model, pad_id: int = PAD, eos: list[int] = EOS, **sampling) -> tuple[HFGenerator, FastGenerator]:
    tokenizer = SimpleNamespace(pad_token_id=pad_id)
    params = SamplingParams(BUDGET, **sampling)
    return HFGenerator(model, tokenizer, params, eos), FastGenerator(model, tokenizer, params, eos)


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("pad_id, num_samples", [(PAD, 1), (EOS[0], 3)])  # the second: pad == eos
def test_greedy_equals_transformers_generate(model, pad_id, num_samples):
    hf, fast = generators(MODELS[model](), pad_id)
    expected = hf.generate(prompts(), num_samples=num_samples, greedy=True)
    got = fast.generate(prompts(), num_samples=num_samples, greedy=True)
    lengths = expected.lengths.tolist()
    assert len(set(lengths)) >= 3 and expected.truncated.any() and not expected.truncated.all()  # a real test
    assert torch.equal(got.completion_ids, expected.completion_ids)
    assert torch.equal(got.mask, expected.mask)
    assert torch.equal(got.truncated, expected.truncated)


def test_dropping_finished_rows_changes_no_other_row():
    """With EOS, finished rows leave the batch; without EOS every row runs the whole budget.
    Each row's tokens through its first EOS must be the same either way."""
    model = tiny_llama()
    _, stopping = generators(model)
    _, running = generators(model, eos=[-1])  # no token is -1: nothing stops, nothing is dropped
    dropped = stopping.generate(prompts(), num_samples=2, greedy=True)
    full = running.generate(prompts(), num_samples=2, greedy=True)
    lengths = dropped.lengths
    assert lengths.min() < BUDGET and (lengths == BUDGET).any()  # rows left while others went on
    for row, n in enumerate(lengths.tolist()):
        assert torch.equal(dropped.completion_ids[row, :n], full.completion_ids[row, :n])
        assert torch.isin(full.completion_ids[row, n - 1], torch.tensor(EOS)) or n == BUDGET
        assert not torch.isin(full.completion_ids[row, : n - 1], torch.tensor(EOS)).any()


def test_finished_rows_places_go_to_the_last_running_rows():
    running = torch.tensor([True, False, True, False, True, True])
    order, holes, movers = fill_order(running)
    assert order.tolist() == [0, 4, 2, 5] and holes.tolist() == [1, 3] and movers.tolist() == [4, 5]
    order, holes, movers = fill_order(torch.tensor([True, True, False, False]))  # only the tail finished: no copy
    assert order.tolist() == [0, 1] and holes.numel() == movers.numel() == 0
    order, holes, movers = fill_order(torch.tensor([False, True, True]))
    assert order.tolist() == [2, 1] and holes.tolist() == [0] and movers.tolist() == [2]


class Recording(torch.nn.Module):
    """The model, keeping each forward pass's last-position logits."""

    def __init__(self, model):
        super().__init__()
        self.model, self.logits = model, []

    config = property(lambda self: self.model.config)
    device = property(lambda self: self.model.device)

    def forward(self, **kwargs):
        out = self.model(**kwargs)
        self.logits.append(out.logits[:, -1].detach().clone())
        return out


@pytest.mark.parametrize("model_name", list(MODELS))
def test_sampled_tokens_logprobs_equal_a_teacher_forced_forward(model_name, monkeypatch):
    """Step t's forward pass ran on the rows still unfinished at t (mask[:, t] == 1, in the order the
    decode loop records: finished rows' places go to the last running rows); the prefill ran once per
    prompt. The log-prob of each sampled token under those logits must equal the one a fresh forward
    pass over prompt + completion gives."""
    model, g = MODELS[model_name](), 3
    recording = Recording(model).eval()  # generate restores the mode it found: keep dropout off
    _, fast = generators(recording)
    step_rows = []
    real_decode = generation_module.decode
    monkeypatch.setattr(generation_module, "decode", lambda *a, **k: real_decode(*a, **{**k, "step_rows": step_rows}))
    torch.manual_seed(0)
    comp = fast.generate(prompts(), num_samples=g)
    n, t = comp.completion_ids.shape
    assert not comp.completion_ids.is_inference()  # decoded under inference_mode, handed out as a normal tensor
    assert comp.lengths.min() < t and not comp.truncated.all()  # rows were dropped along the way
    assert len(recording.logits) == t and recording.logits[0].shape[0] == len(prompts())
    assert any(not torch.equal(rows, rows.sort().values) for rows in step_rows)  # the batch's order did change
    logprobs = torch.zeros(n, t)
    for step, logits in enumerate(recording.logits):
        rows = torch.arange(n) if step == 0 else step_rows[step - 1]
        assert torch.equal(rows.sort().values, comp.mask[:, step].nonzero().squeeze(1))  # the unfinished rows
        logits = logits.repeat_interleave(g, 0) if step == 0 else logits
        assert len(logits) == len(rows)
        tokens = comp.completion_ids[rows, step]
        logprobs[rows, step] = torch.log_softmax(logits.float(), -1).gather(1, tokens[:, None]).squeeze(1)
    expanded = [p for p in prompts() for _ in range(g)]
    expected, _ = batched_logprobs(model, expanded, comp.completion_ids, comp.mask, pad_id=PAD, micro_batch_size=64)
    assert torch.allclose(logprobs * comp.mask, expected, atol=1e-5)


@pytest.mark.parametrize("temperature, top_k, top_p", [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (0.9, 6, 0.7), (1.0, 40, 0.5),
])
def test_sampling_distribution_equals_transformers_warpers(temperature, top_k, top_p):
    logits = 2.0 * torch.randn(4, 30, generator=torch.Generator().manual_seed(0))
    probs, token_ids = sampling_distribution(logits, temperature, top_k, top_p)
    ours = probs if token_ids is None else torch.zeros_like(logits).scatter(1, token_ids, probs)
    ours = ours / ours.sum(-1, keepdim=True)
    warped = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        warped = TopKLogitsWarper(top_k)(None, warped)
    if top_p < 1.0:
        warped = TopPLogitsWarper(top_p)(None, warped)
    expected = torch.softmax(warped, -1)
    assert torch.allclose(ours, expected, atol=1e-6)
    kept = (expected > 0).sum(-1)
    assert (kept < 30).all() if (top_k or top_p < 1.0) else (kept == 30).all()  # the filter did something


def test_draw_inverts_the_cdf():
    # probs 0.5, 0, 0.25, 0.25: CDF 0.5, 0.5, 0.75, 1.0; column j is drawn for u in [cdf[j-1], cdf[j]).
    probs = torch.tensor([[0.5, 0.0, 0.25, 0.25]]).expand(6, 4)
    u = torch.tensor([0.0, 0.49, 0.5, 0.74, 0.75, 0.999])
    assert draw(probs, None, u).tolist() == [0, 0, 2, 2, 3, 3]  # column 1 (probability 0) never
    # Unnormalised (top-p zeroed the middle column): 1, 0, 1 sums to 2, so u = 0.5 -> target 1.0 -> column 2;
    # token ids map the columns back to the vocabulary.
    probs, ids = torch.tensor([[1.0, 0.0, 1.0]]).expand(2, 3), torch.tensor([[7, 3, 5]]).expand(2, 3)
    assert draw(probs, ids, torch.tensor([0.49, 0.5])).tolist() == [7, 5]


# The 0.999 quantile of the chi-square distribution with df degrees of freedom.
CHI2_999 = {9: 27.877, 4: 18.467}


@pytest.mark.parametrize("top_k", [0, 5])
def test_sampled_frequencies_follow_the_distribution(top_k):
    """20,000 draws from one 10-token distribution: Pearson's chi-square below its 0.999 quantile."""
    logits = torch.randn(1, 10, generator=torch.Generator().manual_seed(3)).expand(20_000, 10)
    torch.manual_seed(0)
    tokens = next_tokens(logits, greedy=False, temperature=0.8, top_k=top_k, top_p=1.0)
    probs, ids = sampling_distribution(logits[:1], 0.8, top_k, 1.0)
    expected = probs if ids is None else torch.zeros(1, 10).scatter(1, ids, probs)
    expected = 20_000 * expected[0].double()
    observed = torch.bincount(tokens, minlength=10).double()
    assert observed[expected == 0].sum() == 0
    support = expected > 0
    chi2 = ((observed[support] - expected[support]) ** 2 / expected[support]).sum()
    assert chi2 < CHI2_999[int(support.sum()) - 1]


def test_sampling_is_reproducible_under_a_seed():
    _, fast = generators(tiny_llama(), top_p=0.9)
    outs = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        outs.append(fast.generate(prompts(), num_samples=2).completion_ids)
    assert torch.equal(outs[0], outs[1])
    assert not torch.equal(outs[0], outs[2])


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft (extra: lora) is not installed")
def test_lora_model_takes_the_fast_path_with_its_adapters():
    from peft import LoraConfig, get_peft_model

    base = tiny_llama()
    base_greedy = generators(base)[1].generate(prompts(), num_samples=1, greedy=True)
    lora = get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                                   init_lora_weights=False))  # random B: the adapters matter
    hf, fast = generators(lora)
    expected = hf.generate(prompts(), num_samples=2, greedy=True)
    got = fast.generate(prompts(), num_samples=2, greedy=True)
    assert fast.fallback_reason == ""  # it ran posttrain's loop
    assert not torch.equal(expected.completion_ids[::2], base_greedy.completion_ids)
    assert torch.equal(got.completion_ids, expected.completion_ids) and torch.equal(got.mask, expected.mask)


def test_sliding_window_model_falls_back_to_generate_and_says_why(caplog):
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=24, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=4, initializer_range=0.3)
    model = MistralForCausalLM(config).eval()
    hf, fast = generators(model)
    with caplog.at_level(logging.WARNING, logger="posttrain.rollout.generators"):
        got = fast.generate(prompts(), num_samples=1, greedy=True)
    assert "not all full attention" in caplog.text
    expected = hf.generate(prompts(), num_samples=1, greedy=True)
    assert torch.equal(got.completion_ids, expected.completion_ids)


def test_backend_hf_is_the_fast_path_unless_generate_is_asked_for(monkeypatch):
    model, tokenizer, params = tiny_llama(), SimpleNamespace(pad_token_id=PAD), SamplingParams(BUDGET)
    assert type(make_generator("hf", model, tokenizer, params, EOS)) is FastGenerator
    monkeypatch.setenv("POSTTRAIN_HF_GENERATE", "1")
    assert type(make_generator("hf", model, tokenizer, params, EOS)) is HFGenerator
