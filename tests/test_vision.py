"""Vision-language models: image rows read and checked, image inputs batched, placeholders never sampled, and
every kind of run (online, preference, SFT) on a tiny LLaVA with the user's own image files.

The family matrix (each family's training pass against its own forward with the same images) is
tests/test_vlm_families.py; the built-in tiny VLM that learns is tests/test_tiny_vision.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from posttrain.cli import main
from posttrain.data.images import encode_image_prompt, encode_row_prompt, resolve_image_paths, row_images
from posttrain.data.preference import encode as encode_pairs
from posttrain.data.preference import unpair
from posttrain.data.prompts import DataError
from posttrain.data.sft import check_rows as check_sft_rows
from posttrain.data.sft import encode as encode_sft
from posttrain.models.vision import batch_image_inputs, image_token_ids

sys.path.insert(0, str(Path(__file__).parent))
from vlm_families import build_llava  # noqa: E402

USER = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many squares?"}]}]


def test_image_inputs_are_concatenated_per_image_and_per_token_ones_padded_like_the_ids():
    rows = [{"pixel_values": torch.ones(1, 3, 2, 2), "token_type_ids": torch.tensor([[0, 1, 1]])},
            {},  # a row without images adds nothing
            {"pixel_values": 2 * torch.ones(2, 3, 2, 2), "token_type_ids": torch.tensor([[1, 1]])}]
    left = batch_image_inputs(rows, prompt_lengths=[3, 1, 2], prompt_width=3, width=5)
    assert left["pixel_values"].shape == (3, 3, 2, 2) and left["pixel_values"][1:].eq(2).all()
    assert left["token_type_ids"].tolist() == [[0, 1, 1, 0, 0], [0, 0, 0, 0, 0], [0, 1, 1, 0, 0]]
    right = batch_image_inputs(rows, prompt_lengths=[3, 1, 2], prompt_width=5, width=5, right_padded=True)
    assert right["token_type_ids"].tolist() == [[0, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 0, 0, 0]]
    # per-image tensors of different sizes (Idefics3's image counts) are zero-padded to the widest
    ragged = batch_image_inputs([{"pixel_attention_mask": torch.ones(1, 2)}, {"pixel_attention_mask": torch.ones(1, 3)}],
                                [1, 1], 1, 1)
    assert ragged["pixel_attention_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]


def test_image_token_ids_are_the_configs_image_and_video_tokens():
    config = SimpleNamespace(image_token_id=5, video_token_id=7, vision_start_token_id=3, pad_token_id=0,
                             eos_token_id=2, image_token_index=-1)
    assert image_token_ids(SimpleNamespace(config=config)) == [3, 5, 7]


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return build_llava(tmp_path_factory.mktemp("llava") / "model")


@pytest.fixture(scope="module")
def processor(llava):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(llava)


def squares(count: int) -> Image.Image:
    image = Image.new("RGB", (32, 32), "white")
    for k in range(count):
        image.paste((0, 0, 0), (2 + 10 * k, 10, 8 + 10 * k, 16))
    return image


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    """A user's own data: PNG files beside JSONL files that name them by relative path."""
    root = tmp_path_factory.mktemp("images")
    (root / "pictures").mkdir()
    for count in (1, 2, 3):
        squares(count).save(root / "pictures" / f"{count}.png")
    counts = [1, 2, 3, 1, 2, 3]
    prompts = [{"prompt": USER, "images": [f"pictures/{n}.png"], "answer": str(n)} for n in counts]
    pairs = [{"prompt": USER, "images": [f"pictures/{n}.png"], "chosen": [{"role": "assistant", "content": str(n)}],
              "rejected": [{"role": "assistant", "content": str(n % 3 + 1)}]} for n in counts]
    demos = [{"messages": USER + [{"role": "assistant", "content": str(n)}], "images": [f"pictures/{n}.png"]}
             for n in counts]
    for name, rows in (("prompts", prompts), ("pairs", pairs), ("demos", demos)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (root / "reward.py").write_text(
        "def exact(prompts, completions, answer, **_):\n"
        "    texts = [c[-1]['content'] if isinstance(c, list) else c for c in completions]\n"
        "    return [float(t.strip() == a) for t, a in zip(texts, answer)]\n")
    return root


def test_a_missing_or_unreadable_image_names_its_row_and_file(tmp_path):
    (tmp_path / "bad.png").write_text("not an image")
    rows = [{"prompt": USER, "images": ["pictures/none.png"]}]
    with pytest.raises(DataError, match=r"data.jsonl: row 1: image 1 \(pictures/none.png\): no such file"):
        resolve_image_paths(rows, tmp_path, "data.jsonl")
    with pytest.raises(DataError, match=r"row 1: image 1 .*bad.png\) cannot be read as an image"):
        resolve_image_paths([{"prompt": USER, "images": ["bad.png"]}], tmp_path, "data.jsonl")
    with pytest.raises(DataError, match="row 4: image 1 is a int; give a file path or a PIL image"):
        row_images({"images": [3]}, "row 4")


def test_images_and_placeholders_must_pair_up(processor):
    two = [squares(1), squares(2)]
    with pytest.raises(DataError, match=r"row 2: 2 image\(s\) in the row, 1 \{\"type\": \"image\"\} part"):
        encode_image_prompt(processor, USER, two, "row 2")
    with pytest.raises(DataError, match="row 3: a row with images needs its prompt as chat messages"):
        encode_image_prompt(processor, "How many?", two[:1], "row 3")
    ids, inputs = encode_image_prompt(processor, USER, two[:1], "row 1")
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    assert int((ids == image_id).sum()) == 16  # (32 / 8)^2 patches, the CLS token dropped
    assert inputs["pixel_values"].shape == (1, 3, 32, 32)


def test_a_text_only_model_given_image_rows_says_so(tiny_model_dir):
    from transformers import AutoTokenizer

    with pytest.raises(DataError, match="row 5: the row has images, but the model is text-only"):
        encode_row_prompt(AutoTokenizer.from_pretrained(tiny_model_dir), {"prompt": USER, "images": [squares(1)]},
                          "row 5")


def test_preference_and_sft_rows_keep_their_images_and_never_train_on_the_prompt(processor):
    from posttrain.data.images import attach_processor

    tokenizer = attach_processor(processor.tokenizer, processor)
    pair = {"prompt": USER, "images": [squares(2)], "chosen": [{"role": "assistant", "content": "2"}],
            "rejected": [{"role": "assistant", "content": "3"}]}
    assert [row["images"] for row in unpair([pair])] == [pair["images"]] * 2  # KTO's rows keep them
    data = encode_pairs([pair], tokenizer, paired=True, with_scores=False, max_length=200, max_prompt_length=8)
    assert len(data.prompt_ids[0]) > 16 and not data.truncated[0]  # never cut to max_prompt_length: images inside
    assert data.images[0]["pixel_values"].shape == (1, 3, 32, 32)
    with pytest.raises(DataError, match="a prompt with images is never cut"):
        encode_pairs([pair], tokenizer, paired=True, with_scores=False, max_length=20, max_prompt_length=8)

    demo = {"messages": USER + [{"role": "assistant", "content": "2"}], "images": [squares(2)]}
    check_sft_rows([demo], "demos", completion_only_loss=False)
    sft = encode_sft([demo], tokenizer, completion_only_loss=False, max_length=200)
    trained = tokenizer.decode(sft.input_ids[0][sft.loss_mask[0]])
    assert trained.replace(" ", "") == "2</s>"  # the answer and its end of turn; no image token, whatever the flag
    two_turns = {"messages": demo["messages"] + USER[:0] + [{"role": "user", "content": "Sure?"},
                                                            {"role": "assistant", "content": "Yes"}],
                 "images": [squares(2)]}
    with pytest.raises(DataError, match="demos: row 1: a conversation with images trains on one assistant turn"):
        check_sft_rows([two_turns], "demos", completion_only_loss=True)


def test_the_sampler_never_writes_an_image_placeholder(llava):
    """A completion holding ``<image>`` would take an image its row does not have: the sampler gives it probability
    0, even when the model prefers it above every other token."""
    from posttrain.models.loading import load_model_and_tokenizer
    from posttrain.rollout.completions import SamplingParams
    from posttrain.rollout.generators import VisionGenerator

    model, tokenizer = load_model_and_tokenizer(str(llava))
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    with torch.no_grad():
        model.lm_head.weight[image_id] = 50 * model.lm_head.weight.abs().max()  # any hidden state now points here
        model.lm_head.weight[image_id] *= torch.sign(model.lm_head.weight[image_id])
    row = {"prompt": USER, "images": [squares(1)]}
    ids, _ = encode_row_prompt(tokenizer, row, "row 1")
    generator = VisionGenerator(model, tokenizer, SamplingParams(max_new_tokens=6, temperature=1.0),
                                [tokenizer.eos_token_id])
    out = generator.generate([ids], num_samples=4, rows=[row])
    assert out.completion_ids.numel() and not (out.completion_ids == image_id).any()
    assert torch.isfinite(out.sampling_logprobs).all()


@pytest.mark.parametrize("algorithm, data", [("grpo", "prompts"), ("dpo", "pairs"), ("kto", "pairs"),
                                             ("sft", "demos")])
def test_each_kind_of_run_trains_on_the_users_own_image_files(llava, image_dir, tmp_path, monkeypatch, algorithm, data):
    monkeypatch.chdir(tmp_path)  # the images are found beside the dataset, not in the working directory
    run = tmp_path / "run"
    flags = {"grpo": ["--reward", f"{image_dir}/reward.py:exact", "--prompts-per-step", "2", "--group-size", "2",
                      "--max-new-tokens", "3"],
             "dpo": ["--pairs-per-step", "2"], "kto": ["--pairs-per-step", "2"], "sft": ["--pairs-per-step", "2"]}
    code = main(["train", "--algorithm", algorithm, "--model", str(llava), "--dataset", str(image_dir / f"{data}.jsonl"),
                 "--max-steps", "2", "--eval-every", "0", "--save-every", "0", "--report-to", "none", "--no-progress",
                 "--output", str(run), *flags[algorithm]])
    assert code in (0, None)
    assert (run / "final_model" / "config.json").is_file()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]


def test_rollouts_a_vision_model_cannot_take_yet_are_refused_by_name(llava, image_dir, tmp_path, capsys):
    code = main(["train", "--model", str(llava), "--dataset", str(image_dir / "prompts.jsonl"), "--reward",
                 f"{image_dir}/reward.py:exact", "--sampler-dtype", "bfloat16", "--max-steps", "1",
                 "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "3", "--output", str(tmp_path / "run")])
    assert code == 2
    assert "a vision-language model samples with the policy itself" in capsys.readouterr().err


def test_a_run_keeps_held_out_images_with_its_answers_and_the_report_draws_them(llava, image_dir, tmp_path):
    from posttrain.report.html import build_report

    run = tmp_path / "run"
    code = main(["train", "--model", str(llava), "--dataset", str(image_dir / "prompts.jsonl"), "--eval-dataset",
                 str(image_dir / "prompts.jsonl"), "--reward", f"{image_dir}/reward.py:exact", "--max-steps", "2",
                 "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "3", "--eval-every", "0",
                 "--save-every", "0", "--report-to", "none", "--no-progress", "--output", str(run)])
    assert code in (0, None)
    records = [json.loads(line) for line in (run / "heldout_samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0] * 6 + [2] * 6  # six rows, before and after
    assert [r["answer"] for r in records[:6]] == ["1", "2", "3", "1", "2", "3"]
    first = Image.open(run / records[0]["images"][0])
    assert first.size == (32, 32) and first.getpixel((4, 12)) == (0, 0, 0)  # the row's own picture: one square
    page = build_report([run], tmp_path / "report").read_text()
    assert "Held-out images, before and after" in page and page.count('class=sample alt="held-out row') == 6
