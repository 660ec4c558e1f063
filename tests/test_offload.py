"""--offload-reference and --offload-optimizer: weights and AdamW moments leave memory between uses and
come back bit for bit."""

from __future__ import annotations

import copy
import os

import pytest
import torch

import posttrain.parallel.offload as offload_module
from posttrain.config import Config, ConfigError
from posttrain.models.loading import load_model_and_tokenizer
from posttrain.models.modeling import frozen_copy
from posttrain.parallel.offload import FileStore, HostStore, Offloaded, OffloadedAdamW, check, offload, resident


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.fixture
def model_and_ids(tiny_model_dir):
    model, _ = load_model_and_tokenizer(str(tiny_model_dir), device="cpu")
    ids = torch.randint(0, model.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(0))
    return frozen_copy(model), ids


def test_an_offloaded_model_holds_no_weights_and_computes_the_same_bits(model_and_ids):
    model, ids = model_and_ids
    expected = logits(model, ids)
    tied = model.get_input_embeddings().weight is model.get_output_embeddings().weight
    count = len(list(model.parameters()))
    offload(model)
    assert all(p.numel() == 0 for p in model.parameters())
    with resident(model):
        assert torch.equal(logits(model, ids), expected)
        assert (model.get_input_embeddings().weight is model.get_output_embeddings().weight) == tied
        assert len(list(model.parameters())) == count
    assert all(p.numel() == 0 for p in model.parameters())  # released again after the block
    with resident(model):  # and loaded again, the same bytes
        assert torch.equal(logits(model, ids), expected)


def test_nested_uses_read_the_store_once_and_release_at_the_outer_end(model_and_ids):
    model, _ = model_and_ids
    offloaded = offload(model).posttrain_offloaded
    reads = []
    read = offloaded.store.read
    offloaded.store.read = lambda device: reads.append(device) or read(device)
    with resident(model):
        with resident(model):
            pass
        assert all(p.numel() > 0 for p in model.parameters())
    assert len(reads) == 1 and all(p.numel() == 0 for p in model.parameters())


def test_writes_are_kept_only_when_asked(model_and_ids):
    model, ids = model_and_ids
    offload(model)
    with resident(model):
        before = logits(model, ids)
        for p in model.parameters():
            p.data.add_(1.0)  # a change without write=True is dropped with the loaded copy
    with resident(model, write=True):
        assert torch.equal(logits(model, ids), before)
        for p in model.parameters():
            p.data.mul_(0.5)
        changed = logits(model, ids)
    with resident(model):
        assert torch.equal(logits(model, ids), changed)


def test_an_exception_in_the_block_still_releases(model_and_ids):
    model, _ = model_and_ids
    offload(model)
    with pytest.raises(RuntimeError, match="boom"):
        with resident(model):
            raise RuntimeError("boom")
    assert all(p.numel() == 0 for p in model.parameters())


@pytest.mark.parametrize("store", [FileStore, HostStore])
def test_stores_give_back_every_dtype_and_shape_exactly(store):
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(5, 7, generator=g), torch.randn(3, generator=g).bfloat16(), torch.tensor(2.5),
               torch.zeros(0, 4), torch.randint(-9, 9, (2, 2), generator=g)]
    s = store()
    s.write(tensors)
    back = s.read(torch.device("cpu"))
    assert all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
               for a, b in zip(tensors, back, strict=True))  # every tensor back, none dropped


def test_a_truncated_file_is_an_error_that_says_so():
    s = FileStore()
    s.write([torch.ones(64), torch.ones(64)])
    os.ftruncate(s.file.fileno(), 64 * 4 + 10)
    with pytest.raises(OSError, match="ends after 266 of the 512 bytes written; it was truncated"):
        s.read(torch.device("cpu"))


def test_only_a_frozen_model_is_offloaded(tiny_model_dir):
    model, _ = load_model_and_tokenizer(str(tiny_model_dir), device="cpu")
    with pytest.raises(ValueError, match="must be frozen"):
        Offloaded(model, FileStore())


def test_resident_is_a_no_op_for_models_that_are_not_offloaded(model_and_ids):
    model, ids = model_and_ids
    with resident(model), resident(None):
        assert all(p.numel() > 0 for p in model.parameters())


def test_offloading_needs_a_reference_copy():
    with pytest.raises(ConfigError, match="offload_reference: with LoRA the reference is the policy"):
        Config.from_flat(dict(offload_reference=True, lora_r=4))
    with pytest.raises(ConfigError, match="offload_reference: simpo as configured runs no reference model"):
        check(True, False, "simpo")
    check(True, True, "grpo")
    check(False, False, "simpo")


def adamw_run(adamw, model, steps: int = 4, groups: bool = False):
    """``steps`` AdamW steps on seeded gradients (one parameter left without gradient at step 2);
    returns the optimizer. ``groups``: two parameter groups with their own rate and weight decay."""
    g = torch.Generator().manual_seed(1)
    params = list(model.parameters())
    if groups:
        half = len(params) // 2
        optimizer = adamw([{"params": params[:half]}, {"params": params[half:], "lr": 3e-2, "weight_decay": 0.0}],
                          lr=1e-2, weight_decay=0.1, fused=True)
    else:
        optimizer = adamw(params, lr=1e-2, weight_decay=0.1, fused=True)
    for step in range(steps):
        for i, p in enumerate(params):
            p.grad = None if (step == 2 and i == 0) else torch.randn(p.shape, generator=g)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return optimizer


@pytest.mark.parametrize("store", [FileStore, HostStore])
def test_offloaded_adamw_takes_adamw_steps_bit_for_bit_with_no_moments_in_memory(tiny_model_dir, store, monkeypatch):
    monkeypatch.setattr(offload_module, "new_store", lambda device: store())  # HostStore is the GPU's
    models = [load_model_and_tokenizer(str(tiny_model_dir), device="cpu")[0] for _ in range(2)]
    plain, offloaded = adamw_run(torch.optim.AdamW, models[0]), adamw_run(OffloadedAdamW, models[1])
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p, q)
        assert all(offloaded.state[q][name].numel() == 0 for name in OffloadedAdamW.MOMENTS)
        assert torch.equal(plain.state[p]["step"], offloaded.state[q]["step"])
    plain_state, offloaded_state = plain.state_dict(), offloaded.state_dict()
    assert plain_state["param_groups"] == offloaded_state["param_groups"]
    for k, state in plain_state["state"].items():
        assert all(torch.equal(v, offloaded_state["state"][k][name]) for name, v in state.items())
    assert all(offloaded.state[q]["exp_avg"].numel() == 0 for q in models[1].parameters())  # released again


def test_offloaded_adamw_steps_each_parameter_group_with_its_own_settings(tiny_model_dir):
    models = [load_model_and_tokenizer(str(tiny_model_dir), device="cpu")[0] for _ in range(2)]
    adamw_run(torch.optim.AdamW, models[0], groups=True)
    adamw_run(OffloadedAdamW, models[1], groups=True)
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p, q)


def test_offloaded_adamw_frees_each_gradient_once_applied(tiny_model_dir):
    model = load_model_and_tokenizer(str(tiny_model_dir), device="cpu")[0]
    optimizer = OffloadedAdamW(model.parameters(), lr=1e-2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    assert all(p.grad is None for p in model.parameters())


def test_offloaded_adamw_resumes_from_its_state_dict(tiny_model_dir):
    """A state dict from one offloaded AdamW, loaded into a fresh one, continues exactly as the first."""
    models = [load_model_and_tokenizer(str(tiny_model_dir), device="cpu")[0] for _ in range(2)]
    first = adamw_run(OffloadedAdamW, models[0], steps=2)
    models[1].load_state_dict(models[0].state_dict())
    second = OffloadedAdamW(models[1].parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    second.load_state_dict(copy.deepcopy(first.state_dict()))  # as a checkpoint file would carry it
    assert all(second.state[q]["exp_avg"].numel() == 0 for q in models[1].parameters())  # stored, not held
    g = torch.Generator().manual_seed(5)
    for _ in range(2):
        grads = [torch.randn(p.shape, generator=g) for p in models[0].parameters()]
        for model, optimizer in ((models[0], first), (models[1], second)):
            for p, grad in zip(model.parameters(), grads):
                p.grad = grad.clone()
            optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(models[0].parameters(), models[1].parameters()))
