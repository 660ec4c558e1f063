"""SmolLM2-135M-Instruct offline (``make test-smollm2``): the alias loads, its chat template renders,
it answers a sum, and GRPO with LoRA on the gsm task trains only the adapters against the base model.

The first run converts the GGUF into the cache (about 15-40 s); later runs load it in under a second.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.config import Config
from posttrain.data.prompts import encode_prompt
from posttrain.models.logprobs import batched_logprobs
from posttrain.models.loading import load_model_and_tokenizer, resolve_model_path
from posttrain.training.online import reference_logprobs, train_step
from posttrain.rollout.completions import SamplingParams
from posttrain.rollout.generators import HFGenerator
from posttrain.training.session import OnlineSession, eos_token_ids

pytestmark = pytest.mark.smollm2


@pytest.fixture(scope="module")
def smollm2():
    pytest.importorskip("gguf")
    torch.set_num_threads(2)  # the suite's one-thread default is for tiny models
    model, tokenizer = load_model_and_tokenizer("smollm2-135m", device="cpu")
    return model.eval(), tokenizer


def test_alias_loads_the_instruct_model(smollm2):
    model, tokenizer = smollm2
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert all(p.requires_grad for p in model.parameters())
    # pad == EOS == <|im_end|>: completion masks come from the first EOS (tests/test_models.py)
    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>"
    assert eos_token_ids(model, tokenizer) == [tokenizer.convert_tokens_to_ids("<|im_end|>")]


def test_chat_template_renders_with_the_generation_prompt(smollm2):
    _, tokenizer = smollm2
    ids = encode_prompt(tokenizer, [{"role": "user", "content": "What is 2 + 3?"}])
    assert tokenizer.decode(ids) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_an_environments_observation_is_inserted_as_the_next_user_turn(smollm2):
    from posttrain.rollout.episodes import user_turn

    _, tokenizer = smollm2
    # after the policy's turn, which ends with <|im_end|>: the rest of the template's user turn and the
    # assistant's header, with no second system prompt
    assert user_turn(tokenizer, "<|im_end|>")("higher") == (
        "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n")


def test_greedy_answer_to_a_sum(smollm2):
    model, tokenizer = smollm2
    generator = HFGenerator(model, tokenizer, SamplingParams(32), eos_token_ids(model, tokenizer))
    prompts = [encode_prompt(tokenizer, [{"role": "user", "content": "What is 2 + 3?"}]),
               encode_prompt(tokenizer, [{"role": "user", "content": "Say hello."}])]  # two lengths: left padding
    completions = generator.generate(prompts, num_samples=1, greedy=True)
    text = tokenizer.batch_decode(completions.completion_ids, skip_special_tokens=True)
    assert "5" in text[0]
    assert not completions.truncated[0]  # <|im_end|> ended it
    assert "<|im_end|>" not in text[0] and "<|im_start|>" not in text[0]


BREVITY = '''
def brevity(prompts, completions, **columns):
    """Shorter is better: a dense reward, so every group has variance and the step a gradient."""
    return [-len(c[-1]["content"]) / 100 for c in completions]
'''


def test_grpo_with_lora_on_gsm_trains_only_the_adapters(tmp_path):
    # 48 tokens rarely reach "The answer is N.": the exact-match reward would often give every
    # group zero variance and no gradient, so these steps train on a dense reward instead.
    pytest.importorskip("peft")
    torch.set_num_threads(2)
    (tmp_path / "rewards.py").write_text(BREVITY)
    config = Config.from_flat(dict(
        algorithm="grpo", task="gsm", model="smollm2-135m", reward=[f"{tmp_path / 'rewards.py'}:brevity"],
        lora_r=8, lora_alpha=16.0, prompts_per_step=2,
        group_size=4, max_new_tokens=48, learning_rate=1e-3, micro_batch_size=8, eval_size=0,
        progress=False, report_to="none", seed=0, device="cpu",
    ))
    s = OnlineSession.create(config)
    before = copy.deepcopy(s.policy.state_dict())
    for _ in range(2):
        metrics = train_step(s)
        s.step += 1
    assert all(torch.isfinite(torch.tensor(v)) for k, v in metrics.items() if isinstance(v, float))
    after = s.policy.state_dict()
    changed = {name for name in after if not torch.equal(before[name], after[name])}
    assert changed and all(".lora_A." in name or ".lora_B." in name for name in changed)

    g = s.last_groups
    comp = g.completions
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path("smollm2-135m")).eval()
    expected, _ = batched_logprobs(base, g.prompt_ids, comp.completion_ids, comp.mask, pad_id=s.pad_id,
                                   micro_batch_size=8)
    assert torch.allclose(reference_logprobs(s, g), expected, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("lora", [0, 16], ids=["full", "lora"])
def test_default_settings_fit_and_do_not_make_smollm2_worse(lora, tmp_path):
    """`posttrain train --model smollm2-135m --task gsm` with nothing else set (and with --lora-r 16): the run
    says which defaults it chose for a 135M model, stays within half the machine's memory (measured in the
    run's own process), takes minutes, not hours, a step, and three steps leave held-out accuracy where it was
    (within 3 of 100 problems)."""
    import json
    import subprocess
    import sys

    from posttrain.training.defaults import machine_memory

    argv = ["posttrain", "train", "--model", "smollm2-135m", "--task", "gsm", "--max-steps", "3", "--eval-size", "100",
            "--output", str(tmp_path / "run"), "--report-to", "none", "--no-progress",
            *(["--lora-r", str(lora)] if lora else [])]
    child = (f"import atexit, resource, runpy, sys; sys.argv = {argv!r}; atexit.register(lambda: print("
             "'PEAK_KIB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)); "
             "runpy.run_module('posttrain.cli', run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", child], check=True, capture_output=True, text=True)
    said = done.stderr
    assert f"defaults for smollm2-135m (135M parameters, {'LoRA' if lora else 'full fine-tuning'})" in said
    assert f"learning_rate {1e-5 if lora else 1e-6:g}" in said
    peak = int(next(line for line in said.splitlines() if line.startswith("PEAK_KIB")).split()[1]) * 1024
    assert peak <= machine_memory(torch.device("cpu")) / 2
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert max(row["time/step"] for row in rows if "time/step" in row) < 600
    accuracy = [row["eval/accuracy"] for row in rows if "eval/accuracy" in row]
    assert accuracy[-1] >= accuracy[0] - 0.03, accuracy
