"""The ``shapes`` task, the ``tiny-vision`` LLaVA built offline and cached, and the task's own run settings."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor, LlavaForConditionalGeneration

from posttrain.config import Config
from posttrain.data.tasks import get_task, shapes
from posttrain.data.tasks.shapes import Shape
from posttrain.models import tiny, tiny_vision
from posttrain.models.tiny import BUILTIN_MODELS, ensure_tiny_model
from posttrain.models.tiny_vision import VisionRecipe
from posttrain.training.defaults import task_defaults

SMALL = dataclasses.replace(BUILTIN_MODELS["tiny-vision"], hidden_size=32, num_layers=1, num_heads=2,
                            intermediate_size=64, vision_hidden_size=16, vision_layers=1, vision_heads=2,
                            batch_size=16, eval_every=3, eval_prompts=20, target_accuracy=0.0)
"""The real recipe at a test's size; target 0 stops at the first evaluation."""


def small_task(seed: int = 0):
    return shapes.make_task(seed, n_train=64, n_test=32)


def regions(image) -> int:
    """Connected regions of non-white pixels (4-neighbours), by flood fill."""
    width, height = image.size
    pixels = image.load()
    seen, count = set(), 0
    for start in ((x, y) for y in range(height) for x in range(width)):
        if start in seen or pixels[start] == shapes.BACKGROUND:
            continue
        count += 1
        stack = [start]
        seen.add(start)
        while stack:
            x, y = stack.pop()
            for nx, ny in ((x + 1, y), (x - 1, y), (x, y + 1), (x, y - 1)):
                if 0 <= nx < width and 0 <= ny < height and (nx, ny) not in seen and pixels[nx, ny] != shapes.BACKGROUND:
                    seen.add((nx, ny))
                    stack.append((nx, ny))
    return count


def test_rows_are_deterministic_disjoint_and_their_answer_is_the_picture():
    train, test = shapes.make_rows(0, 300, 100)
    again_train, again_test = shapes.make_rows(0, 300, 100)
    assert [r["answer"] for r in train + test] == [r["answer"] for r in again_train + again_test]
    assert all(a["images"][0].tobytes() == b["images"][0].tobytes()
               for a, b in zip(train + test, again_train + again_test))
    def pictures(rows):
        return {r["images"][0].tobytes() for r in rows}

    assert len(pictures(train)) == 300 and len(pictures(test)) == 100 and not pictures(train) & pictures(test)
    other, _ = shapes.make_rows(1, 300, 100)
    assert [r["answer"] for r in other] != [r["answer"] for r in train]
    assert {r["answer"] for r in train} == {str(n) for n in range(1, 10)}
    for row in train[:60] + test[:20]:  # no two shapes touch: the count is the number of coloured regions
        assert row["images"][0].size == (32, 32) and regions(row["images"][0]) == int(row["answer"])
        assert row["prompt"] == [{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                                                   "text": "How many shapes?"}]}]


def test_each_shape_keeps_to_its_cell():
    specs = shapes.make_specs(0, 500)
    for spec in specs:
        cells = [(s.x // 8, s.y // 8) for s in spec]
        assert len(set(cells)) == len(spec)  # one shape per cell
        for s in spec:  # the box ends before the cell's last row and column: 8 * cell + 7 stays white
            assert s.x % 8 + s.size <= 7 and s.y % 8 + s.size <= 7 and 4 <= s.size <= 7


def test_render_hand_checked():
    image = shapes.render((Shape("square", 1, 2, 4, 0), Shape("circle", 8, 8, 7, 2)))
    red, blue = shapes.COLOURS[0], shapes.COLOURS[2]
    pixels = [image.getpixel((x, y)) for y in range(32) for x in range(32)]
    assert pixels.count(red) == 16  # the 4x4 square at x 1-4, y 2-5
    assert image.getpixel((1, 2)) == red and image.getpixel((4, 5)) == red and image.getpixel((5, 5)) == (255,) * 3
    # the circle: inside its 7x7 box at x 8-14, y 8-14, its centre filled and the box's corners white
    assert image.getpixel((11, 11)) == blue and image.getpixel((8, 8)) == (255,) * 3
    assert all(8 <= i % 32 <= 14 and 8 <= i // 32 <= 14 for i, p in enumerate(pixels) if p == blue)
    assert 16 + pixels.count(blue) + pixels.count((255,) * 3) == 32 * 32


def test_reward_hand_checked():
    completions = ["3", " 3\n", "03", "4", "", "3 shapes", [{"role": "assistant", "content": "3"}]]
    answers = ["3"] * len(completions)
    assert shapes.accuracy(None, completions, answers) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert shapes.correct(None, ["9", "7"], ["9", "8"]) == [True, False]
    assert shapes.final_answer(" 12 ") == "12" and shapes.final_answer("x") is None


def test_task_is_registered_with_its_model():
    task = get_task("shapes")
    assert task.default_model == "tiny-vision" and isinstance(BUILTIN_MODELS["tiny-vision"], VisionRecipe)
    assert len(task.train) == 5000 and len(task.test) == 500
    assert task.max_new_tokens >= 2  # a digit and EOS


def test_processor_and_model_save_and_load_as_a_hugging_face_llava(tmp_path):
    processor = tiny_vision.vision_processor(SMALL)
    model = tiny_vision.build_tiny_vlm(processor, SMALL).eval()
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path).eval()
    loaded_processor = AutoProcessor.from_pretrained(tmp_path)
    assert isinstance(loaded, LlavaForConditionalGeneration)
    assert type(loaded_processor).__name__ == "LlavaProcessor"

    row = small_task().test[0]
    ids, pixels = tiny_vision.encode_rows(loaded_processor, [row])
    tokens = loaded_processor.tokenizer.convert_ids_to_tokens(ids[0].tolist())
    # <bos>, the image as 16 tokens ((32 / 8) ** 2 patches, CLS dropped), the question, "="
    assert tokens == ["<bos>"] + ["<image>"] * 16 + list("How many shapes?=")
    assert loaded.config.image_seq_length == 16 and loaded.config.image_token_index == ids[0, 1].item()
    assert torch.equal(ids, tiny_vision.encode_rows(processor, [row])[0])
    with torch.no_grad():
        expected = model(input_ids=ids, pixel_values=pixels).logits
        assert torch.equal(loaded(input_ids=ids, pixel_values=pixels).logits, expected)
        blank = loaded(input_ids=ids, pixel_values=torch.zeros_like(pixels)).logits
    assert not torch.allclose(blank[0, -1], expected[0, -1])  # the answer position reads the image


def test_tiny_build_is_cached_loads_through_posttrain_and_is_deterministic(tmp_path, monkeypatch):
    monkeypatch.setitem(BUILTIN_MODELS, "tiny-vision-test", SMALL)
    monkeypatch.setattr(tiny_vision, "get_task", lambda name, seed: small_task(seed))
    path = ensure_tiny_model("tiny-vision-test", cache_dir=tmp_path)
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [f"tiny-vision-test-v{SMALL.version}"]
    record = json.loads((path / "posttrain_recipe.json").read_text())
    assert record["recipe"] == dataclasses.asdict(SMALL) and record["steps"] == SMALL.eval_every
    with monkeypatch.context() as patch:
        patch.setattr(tiny_vision, "build_from_recipe", lambda recipe: pytest.fail("cache hit must not rebuild"))
        assert ensure_tiny_model("tiny-vision-test", cache_dir=tmp_path) == path

    from posttrain.data.images import processor_of
    from posttrain.models.loading import load_model_and_tokenizer

    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path))
    model, tokenizer = load_model_and_tokenizer("tiny-vision-test", device="cpu")
    assert isinstance(model, LlavaForConditionalGeneration) and processor_of(tokenizer) is not None
    rebuilt, _, rebuilt_record = SMALL.build()
    for name, tensor in rebuilt.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    assert rebuilt_record["start_accuracy_heldout"] == record["start_accuracy_heldout"]

    # a recorded vision recipe with another tower (changed without a version bump) is rebuilt
    changed = {**record, "recipe": {**record["recipe"], "patch_size": 4}}
    (path / "posttrain_recipe.json").write_text(json.dumps(changed))
    assert tiny._recorded_recipe(path, VisionRecipe)["patch_size"] == 4
    ensure_tiny_model("tiny-vision-test", cache_dir=tmp_path)
    assert json.loads((path / "posttrain_recipe.json").read_text())["recipe"] == dataclasses.asdict(SMALL)


def test_warm_start_stops_at_first_evaluation_reaching_target(monkeypatch):
    scripted = [0.0, 0.2, 0.5, 0.9]
    monkeypatch.setattr(tiny_vision, "greedy_accuracy", lambda *args, **kwargs: scripted.pop(0))
    recipe = dataclasses.replace(SMALL, target_accuracy=0.4, eval_every=2)
    processor = tiny_vision.vision_processor(recipe)
    model = tiny_vision.build_tiny_vlm(processor, recipe)
    result = tiny_vision.warm_start(model, processor, small_task(), recipe)
    assert result["steps"] == 3 * recipe.eval_every and result["subset_accuracy"] == 0.5
    scripted[:] = [0.0, 0.0]
    with pytest.raises(RuntimeError, match="did not reach"):
        tiny_vision.warm_start(model, processor, small_task(), dataclasses.replace(recipe, max_steps=4))


def test_task_run_defaults_fill_what_the_user_left_unset(tmp_path):
    plain = Config.from_flat({"task": "shapes", "model": "tiny-vision", "max_steps": 7})
    config, lines = task_defaults(plain, None)
    assert config.optim.learning_rate == 5e-4 and config.rollout.prompts_per_step == 16
    assert config.rollout.group_size == 8 and config.optim.warmup_steps == 10 and config.run.max_minutes == 8.0
    assert config.run.max_steps == 7  # the user's
    assert {"learning_rate", "group_size"} <= config.given
    assert lines == [("defaults for task shapes on tiny-vision: learning_rate 0.0005, warmup_steps 10, "
                      "prompts_per_step 16, group_size 8, max_minutes 8; set a field to override it")]
    assert task_defaults(Config.from_flat({"task": "shapes"}), None)[0].rollout.group_size == 8  # its own model
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "2+2=", "answer": "4"}\n')
    for other in ({"task": "shapes", "model": "tiny-addition"}, {"task": "addition"},
                  {"task": "shapes", "algorithm": "dpo"}, {"task": "shapes", "dataset": str(rows)}):
        config = Config.from_flat(other)
        assert task_defaults(config, None) == (config, []), other


@pytest.mark.slow
def test_default_run_gains_twenty_points(tmp_path):
    """`posttrain train --model tiny-vision --task shapes`: the task's own settings (200 steps of 16 prompts x 8
    samples, at most 8 minutes of training) raise held-out accuracy by 0.20 or more (the model's first build
    takes 1-3 minutes more, once per cache)."""
    run = tmp_path / "run"
    subprocess.run([sys.executable, "-m", "posttrain", "train", "--model", "tiny-vision", "--task", "shapes",
                    "--output", str(run), "--no-progress"], check=True)
    evaluations = [row for row in map(json.loads, Path(run, "metrics.jsonl").read_text().splitlines())
                   if "eval/accuracy" in row]
    before, after = evaluations[0]["eval/accuracy"], evaluations[-1]["eval/accuracy"]
    assert after >= before + 0.20, f"held-out accuracy {before:.3f} -> {after:.3f}"
