import json
import random

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import posttrain.training.checkpoint as ckpt
from posttrain.training import setup
from posttrain.training.checkpoint import (
    CheckpointError,
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    save_final_model,
)


def fingerprint(model, algorithm: str) -> dict:
    """What a run stores and checks on resume (the trainers' own fingerprint)."""
    return setup.fingerprint(model.config.name_or_path, algorithm, model)

def tiny_llama(seed: int, *, layers: int = 1, tied: bool = False, name: str = "tiny-llama") -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=tied,
    )
    model = LlamaForCausalLM(config)
    model.config.name_or_path = name
    return model


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, **{str(i): i + 1 for i in range(31)}}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")), unk_token="<unk>")


BATCH = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(0))


def train_step(model, optimizer, scheduler) -> None:
    model(input_ids=BATCH, labels=BATCH).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()


def make_training(seed: int, **kw):
    model = tiny_llama(seed, **kw)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (s + 1))
    return model, optimizer, scheduler


def save(run_dir, step, model, **kw):
    kw.setdefault("trainer_state", {"fingerprint": fingerprint(model, "grpo")})
    return save_checkpoint(run_dir, step, model=model, **kw)


def test_round_trip_restores_everything_and_resumed_equals_uninterrupted(tmp_path):
    model, optimizer, scheduler = make_training(seed=0)
    train_step(model, optimizer, scheduler)
    train_step(model, optimizer, scheduler)
    state = {"epoch": 1, "data_position": 7, "fingerprint": fingerprint(model, "grpo")}
    path = save_checkpoint(tmp_path, 2, model=model, tokenizer=tiny_tokenizer(), optimizer=optimizer,
                           scheduler=scheduler, trainer_state=state)
    draws_after_save = (torch.rand(3), random.random(), np.random.rand())

    resumed, resumed_optimizer, resumed_scheduler = make_training(seed=1)  # different initial weights
    trainer_state = load_checkpoint(path, model=resumed, optimizer=resumed_optimizer, scheduler=resumed_scheduler,
                                    expected_fingerprint=fingerprint(resumed, "grpo"))

    assert trainer_state == {"step": 2, **state}
    assert path == tmp_path / "checkpoints" / "step_000002"
    for key, value in model.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key
    for param, resumed_param in zip(model.parameters(), resumed.parameters()):
        saved, restored = optimizer.state[param], resumed_optimizer.state[resumed_param]
        assert torch.equal(saved["exp_avg"], restored["exp_avg"]) and torch.equal(saved["exp_avg_sq"], restored["exp_avg_sq"])
        assert restored["step"].item() == 2
    assert resumed_scheduler.last_epoch == 2 and resumed_optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 / 3)
    assert torch.equal(torch.rand(3), draws_after_save[0])
    assert random.random() == draws_after_save[1] and np.random.rand() == draws_after_save[2]

    train_step(model, optimizer, scheduler)  # one more step from both: bitwise equal
    train_step(resumed, resumed_optimizer, resumed_scheduler)
    for key, value in model.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key


def test_checkpoint_directory_lists_every_file_in_the_manifest_and_loads_with_from_pretrained(tmp_path):
    model = tiny_llama(0, tied=True)
    path = save(tmp_path, 40, model, tokenizer=tiny_tokenizer())
    manifest = json.loads((path / "manifest.json").read_text())["files"]
    on_disk = {p.name for p in path.iterdir()} - {"manifest.json"}
    assert set(manifest) == on_disk and {"model.safetensors", "rng.pt", "trainer_state.json", "tokenizer.json"} <= on_disk
    assert all(manifest[name]["size"] == (path / name).stat().st_size for name in on_disk)

    reloaded = LlamaForCausalLM.from_pretrained(path)
    assert torch.equal(reloaded.lm_head.weight, model.lm_head.weight)
    fresh = tiny_llama(1, tied=True)
    load_checkpoint(path, model=fresh)  # lm_head.weight is not in the file: allowed, it is tied
    assert torch.equal(fresh.model.embed_tokens.weight, model.model.embed_tokens.weight)
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight


def test_weights_are_loaded_with_strict_keys(tmp_path):
    path = save(tmp_path, 1, tiny_llama(0, layers=1))
    bigger = tiny_llama(1, layers=2)
    before = {k: v.clone() for k, v in bigger.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"missing keys \['model\.layers\.1\."):
        load_checkpoint(path, model=bigger)
    assert all(torch.equal(before[k], v) for k, v in bigger.state_dict().items())  # untouched


def test_extra_modules_round_trip_and_must_exist_when_asked_for(tmp_path):
    model, value_head = tiny_llama(0), nn.Linear(16, 1)
    path = save(tmp_path, 1, model, extra_modules={"value_head": value_head})
    fresh_head = nn.Linear(16, 1)
    load_checkpoint(path, model=tiny_llama(1), extra_modules={"value_head": fresh_head})
    assert torch.equal(fresh_head.weight, value_head.weight) and torch.equal(fresh_head.bias, value_head.bias)
    with pytest.raises(CheckpointError, match="has no critic.safetensors"):
        load_checkpoint(path, model=tiny_llama(1), extra_modules={"critic": nn.Linear(16, 1)})
    with pytest.raises(CheckpointError, match="has no optimizer.pt"):
        load_checkpoint(path, model=tiny_llama(1), optimizer=torch.optim.SGD(value_head.parameters(), lr=1.0))


def test_a_crash_mid_save_leaves_no_checkpoint_and_leftovers_are_ignored_then_cleaned(tmp_path, monkeypatch):
    model = tiny_llama(0)
    first = save(tmp_path, 1, model)

    def crash(directory):
        raise KeyboardInterrupt  # e.g. Ctrl-C after the weights, before the manifest

    with monkeypatch.context() as patch:
        patch.setattr(ckpt, "_write_manifest", crash)
        with pytest.raises(KeyboardInterrupt):
            save(tmp_path, 2, model)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001"]

    # a killed process cannot clean up: its half-written temp dir stays behind
    leftover = tmp_path / "checkpoints" / ".tmp-step_000002-99999"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"partial")
    assert latest_checkpoint(tmp_path) == first
    save(tmp_path, 2, model)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001", "step_000002"]


def test_corrupt_files_are_named_and_latest_checkpoint_falls_back(tmp_path):
    model, optimizer, scheduler = make_training(seed=0)
    train_step(model, optimizer, scheduler)
    older = save(tmp_path, 1, model, optimizer=optimizer)
    newer = save(tmp_path, 2, model, optimizer=optimizer)

    data = bytearray((newer / "optimizer.pt").read_bytes())
    data[100] ^= 0xFF  # same size, different content
    (newer / "optimizer.pt").write_bytes(bytes(data))
    assert latest_checkpoint(tmp_path) == newer  # sizes still match
    assert latest_checkpoint(tmp_path, verify=True) == older
    with pytest.raises(CheckpointError, match=r"file optimizer.pt has sha256 [0-9a-f]{64}, manifest says"):
        load_checkpoint(newer, model=model, optimizer=optimizer)

    size = (newer / "model.safetensors").stat().st_size
    with (newer / "model.safetensors").open("r+b") as f:
        f.truncate(size - 1)
    assert latest_checkpoint(tmp_path) == older
    message = f"corrupt checkpoint .*step_000002: file model.safetensors has {size - 1} bytes, manifest says {size}"
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(newer, model=model)

    (older / "manifest.json").unlink()
    assert latest_checkpoint(tmp_path) is None
    with pytest.raises(CheckpointError, match="manifest.json is missing"):
        load_checkpoint(older, model=model)


def test_fingerprint_mismatch_says_what_differs(tmp_path):
    model = tiny_llama(0, name="tiny-a")
    path = save(tmp_path, 3, model)
    other = tiny_llama(1, name="tiny-b")
    before = other.lm_head.weight.clone()
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(path, model=other, expected_fingerprint=fingerprint(other, "dpo"))
    assert str(error.value) == (
        f"checkpoint {path} was made with model tiny-a / algorithm grpo; this run uses model tiny-b / algorithm dpo"
    )
    assert torch.equal(other.lm_head.weight, before)  # nothing restored
    assert fingerprint(model, "grpo") == {
        "model": "tiny-a", "algorithm": "grpo", "parameters": sum(p.numel() for p in model.parameters()),
    }


def _steps(run_dir):
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def test_keep_last_prunes_old_checkpoints_and_a_resume_drops_the_abandoned_future(tmp_path):
    model = tiny_llama(0)
    for step in (5, 10, 100, 1000000):  # numeric order, not name order: step_1000000 sorts before step_100
        save(tmp_path / "a", step, model, keep_last=2)
    assert _steps(tmp_path / "a") == ["step_000100", "step_1000000"]
    assert latest_checkpoint(tmp_path / "a") == checkpoint_path(tmp_path / "a", 1000000)

    for step in (1, 2, 3, 4):
        save(tmp_path / "b", step, model, keep_last=None)
    assert _steps(tmp_path / "b") == ["step_000001", "step_000002", "step_000003", "step_000004"]
    save(tmp_path / "b", 2, model, keep_last=2)  # resumed from step 1, saved step 2 again
    assert _steps(tmp_path / "b") == ["step_000001", "step_000002"]


def test_final_model_is_written_atomically_and_replaced(tmp_path):
    first, second = tiny_llama(0), tiny_llama(1)
    path = save_final_model(tmp_path, first, tiny_tokenizer())
    save_final_model(tmp_path, second)
    assert path == tmp_path / "final_model" and sorted(p.name for p in tmp_path.iterdir()) == ["final_model"]
    ckpt.verify_checkpoint(path)
    assert torch.equal(LlamaForCausalLM.from_pretrained(path).lm_head.weight, second.lm_head.weight)
