"""--offload-reference: the reference's weights leave memory between passes and come back bit for bit."""

from __future__ import annotations

import os

import pytest
import torch

from posttrain.config import Config, ConfigError
from posttrain.modeling import frozen_copy, load_model_and_tokenizer
from posttrain.offload import FileStore, HostStore, Offloaded, check, offload, resident


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
    assert all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) for a, b in zip(tensors, back))


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
