"""The char tokenizer, the tiny Llama and the cached, atomic, deterministic warm-start recipe."""

import dataclasses
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from posttrain.models import tiny
from posttrain.models.tiny import (
    BUILTIN_MODELS,
    TinyRecipe,
    build_from_recipe,
    build_tiny_model,
    char_tokenizer,
    ensure_tiny_model,
    greedy_accuracy,
)
from posttrain.data.tasks import get_task

CHARS = BUILTIN_MODELS["tiny-addition"].chars


def test_tokenizer_round_trip_and_reload(tmp_path):
    tokenizer = char_tokenizer(CHARS)
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    text = "7+5=12,4+8+1=13,0+3+1=4|432"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and len(ids) == len(text) + 1  # one token per character
    assert tokenizer.decode(ids, skip_special_tokens=True) == text  # no spaces inserted
    assert tokenizer.decode(ids) == "<bos>" + text
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == ids[1:]
    # ids 0-3 are pad, bos, eos, unk; characters follow in order
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2, 3)
    assert tokenizer.convert_tokens_to_ids(list("01")) == [4, 5] and len(tokenizer) == 4 + len(CHARS)

    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert reloaded(text)["input_ids"] == ids
    assert reloaded.padding_side == "left" and reloaded.eos_token_id == 2
    batch = reloaded(["1+1=", "12+345="], padding=True)["input_ids"]
    assert batch[0] == [0, 0, 0] + reloaded("1+1=")["input_ids"]  # left padding
    assert reloaded.batch_decode([ids + [2, 0, 0]], skip_special_tokens=True) == [text]


def test_tokenizer_whitespace_and_unknown():
    tokenizer = char_tokenizer("ab \n")
    assert tokenizer.decode(tokenizer("a b\nba ")["input_ids"], skip_special_tokens=True) == "a b\nba "
    assert tokenizer("az", add_special_tokens=False)["input_ids"] == [4, tokenizer.unk_token_id]
    with pytest.raises(ValueError, match="repeated"):
        char_tokenizer("aa")


def test_parameter_count_by_hand():
    model = build_tiny_model(char_tokenizer(CHARS), seed=0)
    V, d, L, m = 4 + len(CHARS), 128, 3, 352
    # tied embedding V*d; per layer q,k,v,o 4*d*d + gate,up,down 3*d*m + two RMSNorms 2*d; final norm d
    expected = V * d + L * (4 * d * d + 3 * d * m + 2 * d) + d
    assert expected == 605_312
    assert sum(p.numel() for p in model.parameters()) == expected
    assert model.config.tie_word_embeddings and model.config.eos_token_id == 2


def test_build_is_seeded():
    tokenizer = char_tokenizer(CHARS)
    a, b, c = (build_tiny_model(tokenizer, seed, hidden_size=32, num_layers=1, intermediate_size=64) for seed in (0, 0, 1))
    assert torch.equal(a.model.embed_tokens.weight, b.model.embed_tokens.weight)
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


def test_left_padding_does_not_change_greedy_completions():
    tokenizer = char_tokenizer(CHARS)
    model = build_tiny_model(tokenizer, seed=3, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64).eval()
    prompts = ["1+2=", "47+385=", "999+9="]
    kwargs = dict(do_sample=False, max_new_tokens=12, pad_token_id=0, eos_token_id=2)
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    together = model.generate(**batch, **kwargs)[:, batch["input_ids"].shape[1]:]
    for row, prompt in enumerate(prompts):
        alone = tokenizer(prompt, return_tensors="pt")
        single = model.generate(**alone, **kwargs)[0, alone["input_ids"].shape[1]:]
        assert tokenizer.decode(single, skip_special_tokens=True) == tokenizer.decode(together[row], skip_special_tokens=True)


SMALL = TinyRecipe(task="addition", chars=CHARS, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                   batch_size=16, eval_every=5, eval_prompts=20, target_accuracy=0.0)


def test_warm_start_stops_at_first_evaluation_reaching_target(monkeypatch):
    scripted = [0.0, 0.1, 0.3, 0.6]
    monkeypatch.setattr(tiny, "greedy_accuracy", lambda *args, **kwargs: scripted.pop(0) if scripted else 0.0)
    tokenizer = char_tokenizer(CHARS)
    recipe = dataclasses.replace(SMALL, target_accuracy=0.25)
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    task = get_task("addition")
    result = tiny.warm_start(model, tokenizer, task, recipe)
    assert result["steps"] == 3 * recipe.eval_every and result["subset_accuracy"] == 0.3
    scripted.clear()  # from now on every evaluation reads 0.0
    with pytest.raises(RuntimeError, match="did not reach"):
        tiny.warm_start(model, tokenizer, task, dataclasses.replace(recipe, max_steps=4, eval_every=2))


def test_ensure_tiny_model_is_atomic_cached_and_deterministic(tmp_path, monkeypatch):
    monkeypatch.setitem(BUILTIN_MODELS, "tiny-test", SMALL)

    def failing_save(self, *args, **kwargs):
        raise OSError("disk full")

    with monkeypatch.context() as patch:  # a build that dies while writing leaves nothing behind
        patch.setattr(PreTrainedTokenizerFast, "save_pretrained", failing_save)
        with pytest.raises(OSError, match="disk full"):
            ensure_tiny_model("tiny-test", cache_dir=tmp_path)
    assert list((tmp_path / "models").iterdir()) == []

    path = ensure_tiny_model("tiny-test", cache_dir=tmp_path)
    assert path == tmp_path / "models" / f"tiny-test-v{SMALL.version}"
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [f"tiny-test-v{SMALL.version}"]  # no temp dir left
    record = json.loads((path / "posttrain_recipe.json").read_text())
    assert record["recipe"] == dataclasses.asdict(SMALL) and record["steps"] == SMALL.eval_every

    with monkeypatch.context() as patch:
        patch.setattr(tiny, "build_from_recipe", lambda recipe: pytest.fail("cache hit must not rebuild"))
        assert ensure_tiny_model("tiny-test", cache_dir=tmp_path) == path

    # an entry recorded with another recipe (changed without a version bump) is replaced, not used
    (path / "posttrain_recipe.json").write_text(json.dumps({**record, "recipe": {**record["recipe"], "lr": 1.0}}))
    assert ensure_tiny_model("tiny-test", cache_dir=tmp_path) == path
    assert json.loads((path / "posttrain_recipe.json").read_text())["recipe"] == dataclasses.asdict(SMALL)
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [f"tiny-test-v{SMALL.version}"]

    # the cached model is the recipe's model: rebuilding gives identical weights
    model = AutoModelForCausalLM.from_pretrained(path)
    rebuilt, _, rebuilt_record = build_from_recipe(SMALL)
    for name, tensor in rebuilt.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    assert rebuilt_record["start_accuracy_heldout"] == record["start_accuracy_heldout"]
    assert AutoTokenizer.from_pretrained(path)("1+2=")["input_ids"] == char_tokenizer(CHARS)("1+2=")["input_ids"]


def test_unknown_builtin_model(tmp_path):
    with pytest.raises(ValueError, match="valid: tiny-addition"):
        ensure_tiny_model("tiny-nothing", cache_dir=tmp_path)


def test_cache_root_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path))
    assert tiny.cache_root() == tmp_path
    assert tiny.cache_root(tmp_path / "x") == tmp_path / "x"


@pytest.mark.slow
def test_builtin_recipe_reaches_target_band(tmp_path):
    """The real recipe (about 25-45 s on 2 cores): start accuracy in the band RL needs."""
    recipe = BUILTIN_MODELS["tiny-addition"]
    path = ensure_tiny_model("tiny-addition", cache_dir=tmp_path)
    record = json.loads((path / "posttrain_recipe.json").read_text())
    assert recipe.target_accuracy <= record["start_accuracy_subset"] < recipe.target_accuracy + 0.2
    assert 0.15 <= record["start_accuracy_heldout"] <= 0.45
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    task = get_task("addition")
    assert greedy_accuracy(model, tokenizer, task, task.test) == record["start_accuracy_heldout"]
