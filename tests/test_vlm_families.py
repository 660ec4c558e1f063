"""The vision-language path on each family, built tiny and offline (``tests/vlm_families.py``).

For every family: the training passes (``batched_logprobs``, ``forward``) over a batch of rows with different
prompt lengths, image shapes and completion lengths equal, row by row, the model's own forward over that row alone,
log-probs and gradient; the image tokens are prompt tokens and never scored; a GRPO run on image rows trains the
language model and leaves the frozen vision parts as they were; LoRA adapts the language model alone.

How each family gets its rows' inputs: llava, gemma3, idefics3 (SmolVLM), llava_next and paligemma through their own
processor (saved, loaded with ``AutoProcessor``, run by posttrain's ``encode_image_prompt``); the Qwen-VL families
through their image processor and the prompt's ``<|image_pad|>`` tokens counted by hand (``vlm_families.qwen_encode``)
where transformers cannot build their processor (without torchvision).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoTokenizer

import posttrain
from posttrain.config import ModelConfig
from posttrain.models.logprobs import batched_logprobs
from posttrain.models.lora import apply_lora
from posttrain.models.modeling import collate, forward
from posttrain.models.vision import freeze_vision, image_token_ids
from vlm_families import (QWEN_FAMILIES, QWEN_PROCESSOR_MISSING, VLM_FAMILIES, has_processor, image_prompt,
                          prompt_encoder)

FAMILIES = ["llava", "gemma3", "idefics3", "llava_next", "paligemma", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"]

ROWS = [("What is in the image?", (112, 56)), ("What colour is the shape on the left?", (56, 112)),
        ("Describe.", (84, 84)), ("What is in the image?", (112, 56))]
"""(question, image width x height) of the batch's rows: prompts of different lengths (the questions, and the image
tokens where the family's count depends on the image's shape); the last row repeats the first, as a GRPO group's
samples do (so that ``share_prompts`` would share it)."""
COMPLETION_LENGTHS = [5, 2, 4, 3]

IMAGE_TOKENS = {
    "llava": [16, 16, 16, 16],  # (32 / 8)^2 patches, the CLS token dropped
    "gemma3": [4, 4, 4, 4],  # mm_tokens_per_image: 4x4 patches average-pooled to 2x2
    "paligemma": [16, 16, 16, 16],  # (32 / 8)^2
    # (32/8)^2 / 2^2 = 4 per crop after the pixel shuffle; 112x56 -> 64x32: 1 x 2 crops + the global image = 3 x 4;
    # 84x84 -> 64x64: 2 x 2 crops + global = 5 x 4
    "idefics3": [12, 12, 20, 12],
    # the base image's 16 + the tiles' features unpadded to the image's aspect ratio, one image_newline per row:
    # 112x56 -> pinpoint 32x64, 2 tiles: a 4 x 8 grid + 4 newlines = 36; 56x112 -> 64x32: 8 x 4 + 8 = 40;
    # 84x84 -> 64x64, 4 tiles: 8 x 8 + 8 = 72
    "llava_next": [52, 56, 88, 52],
    # t * h * w / 2^2 merged patches: 112x56 -> (1, 4, 8) of 14-px patches: 8; 84x84 -> (1, 6, 6): 9
    "qwen2_vl": [8, 8, 9, 8],
    "qwen2_5_vl": [8, 8, 9, 8],
    # 16-px patches, sides rounded to multiples of 32: 112x56 -> 128x64: (1, 4, 8): 8; 84x84 -> 96x96: (1, 6, 6): 9
    "qwen3_vl": [8, 8, 9, 8],
}
"""Each row's image placeholder tokens in its prompt, counted by hand from the family's processing."""

IMAGE_TOKEN = {"llava": "<image>", "gemma3": "<image_soft_token>", "paligemma": "<image>", "idefics3": "<image>",
               "llava_next": "<image>", "qwen2_vl": "<|image_pad|>", "qwen2_5_vl": "<|image_pad|>",
               "qwen3_vl": "<|image_pad|>"}

VISION_PARTS = {
    "llava": ("model.vision_tower.", "model.multi_modal_projector."),
    "gemma3": ("model.vision_tower.", "model.multi_modal_projector."),
    "paligemma": ("model.vision_tower.", "model.multi_modal_projector."),
    "idefics3": ("model.vision_model.", "model.connector."),
    "llava_next": ("model.vision_tower.", "model.multi_modal_projector.", "model.image_newline"),
    "qwen2_vl": ("model.visual.",),  # the merger (the projector) sits inside the visual module
    "qwen2_5_vl": ("model.visual.",),
    "qwen3_vl": ("model.visual.",),
}
"""(tower, projector) parameter-name prefixes in each family's checkpoint; LLaVA-NeXT's learnt row separator
``image_newline`` is part of the image embedding, frozen with the projector."""

COMPLETION_TOKEN_TYPE = {"paligemma": 1}
"""What a per-token image input (Gemma 3's ``token_type_ids``, Qwen's ``mm_token_type_ids``, PaliGemma's
``token_type_ids``) holds over the completion in the family's own forward: 0 (text) for the image-token marks; 1 for
PaliGemma, whose 0 is the bidirectional prefix (its processor gives a ``suffix`` 1, and its ``generate`` gives each
new token 1)."""

@dataclass
class Family:
    name: str
    directory: Path
    model: torch.nn.Module
    prompts: list[torch.Tensor]
    """[P_i] each row's prompt ids, image tokens included."""
    images: list[dict[str, torch.Tensor]]
    """Each row's image inputs, as its processor (or ``qwen_encode``) gave them."""
    completions: list[torch.Tensor]
    """[T_i] each row's completion ids."""

    @property
    def pad_id(self) -> int:
        return self.model.config.get_text_config().pad_token_id

    def padded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([N, T] completion ids, right-padded with the pad id, [N, T] mask)."""
        width = max(len(c) for c in self.completions)
        ids = torch.full((len(self.completions), width), self.pad_id)
        mask = torch.zeros_like(ids)
        for row, c in enumerate(self.completions):
            ids[row, :len(c)], mask[row, :len(c)] = c, 1
        return ids, mask

    def own_logprobs(self, row: int) -> torch.Tensor:
        """[T] row ``row``'s completion log-probs from the model's own forward over that row alone: prompt and
        completion, no padding, its image inputs; a per-token input runs on over the completion as
        :data:`COMPLETION_TOKEN_TYPE` says. PaliGemma's processor's ``labels`` are a loss target, not an input."""
        prompt, completion = self.prompts[row], self.completions[row]
        given = {k: v for k, v in self.images[row].items() if k != "labels"}
        for key in ("token_type_ids", "mm_token_type_ids"):
            if key in given:
                tail = torch.full((1, len(completion)), COMPLETION_TOKEN_TYPE.get(self.name, 0), dtype=given[key].dtype)
                given[key] = torch.cat([given[key], tail], 1)
        logits = self.model(input_ids=torch.cat([prompt, completion])[None], **given).logits[0, len(prompt) - 1:-1]
        return logits.log_softmax(-1).gather(-1, completion[:, None])[:, 0]


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """family name -> :class:`Family`, each built once in this module, when a test first asks for it."""
    built: dict[str, Family] = {}

    def get(name: str) -> Family:
        if name not in built:
            directory = VLM_FAMILIES[name](tmp_path_factory.mktemp(name))
            encode = prompt_encoder(directory)
            model = AutoModelForImageTextToText.from_pretrained(directory).eval()
            rows = [encode(messages, [image]) for messages, image in (image_prompt(q, size) for q, size in ROWS)]
            generator = torch.Generator().manual_seed(0)
            never_sampled = torch.tensor(image_token_ids(model))  # an image token would stand for an image
            completions = []
            for length in COMPLETION_LENGTHS:  # random text tokens, as the sampler may draw them
                ids = torch.randint(1, model.config.get_text_config().vocab_size, (length,), generator=generator)
                completions.append(torch.where(torch.isin(ids, never_sampled), 1, ids))
            built[name] = Family(name, directory, model, [r[0] for r in rows], [r[1] for r in rows], completions)
        return built[name]

    return get


SETTINGS = {
    "defaults": dict(micro_batch_size=4),  # share_prompts and trim_padding on: a VLM must step them aside
    "padded": dict(micro_batch_size=4, share_prompts=False, trim_padding=False),
    "one_row_per_micro_batch": dict(micro_batch_size=1),
}


@pytest.mark.parametrize("settings", list(SETTINGS))
@pytest.mark.parametrize("name", FAMILIES)
def test_training_passes_equal_the_model_on_each_row_alone(families, name, settings):
    family = families(name)
    completion_ids, mask = family.padded()
    assert len({len(p) for p in family.prompts[:3]}) == 3  # the rows' prompts do pad differently
    got, _ = batched_logprobs(family.model, family.prompts, completion_ids, mask, pad_id=family.pad_id,
                              images=family.images, **SETTINGS[settings])
    with torch.no_grad():
        for row, length in enumerate(COMPLETION_LENGTHS):
            torch.testing.assert_close(got[row, :length], family.own_logprobs(row), rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", FAMILIES)
def test_image_tokens_are_prompt_tokens_never_scored(families, name):
    family = families(name)
    image_id = AutoTokenizer.from_pretrained(family.directory).convert_tokens_to_ids(IMAGE_TOKEN[name])
    assert image_id == family.model.config.image_token_id
    assert [int((p == image_id).sum()) for p in family.prompts] == IMAGE_TOKENS[name]
    completion_ids, mask = family.padded()
    got, _ = batched_logprobs(family.model, family.prompts, completion_ids, mask, pad_id=family.pad_id,
                              micro_batch_size=4, images=family.images)
    assert got.shape == (4, 5)  # [N, T]: the completions' widest, no column for a prompt's (image) tokens
    assert ((got != 0) == mask.bool()).all()  # a log-prob at each completion token, 0 at its padding


@pytest.mark.parametrize("name", FAMILIES)
def test_the_training_gradient_is_the_sum_of_the_rows_alone(families, name):
    family = families(name)
    model = family.model
    completion_ids, mask = family.padded()
    batch = collate(family.prompts, completion_ids, mask, family.pad_id, torch.device("cpu"), images=family.images)
    model.zero_grad(set_to_none=True)
    forward(model, batch).logprobs.sum().backward()
    trained = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    sum(family.own_logprobs(row).sum() for row in range(len(ROWS))).backward()
    alone = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    query = next(n for n in alone if n.endswith("layers.0.self_attn.q_proj.weight") and not
                 n.startswith(VISION_PARTS[name]))  # a language-model weight
    assert_same_gradient(trained[query], alone[query])
    assert trained.keys() == alone.keys()  # the vision tower's and projector's too: train_vision tower trains them
    for n, gradient in alone.items():
        assert_same_gradient(trained[n], gradient, n)


def assert_same_gradient(got: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Equal to 1e-4 of the gradient's largest entry: float32 rounding puts both sides about 4e-6 of it from a
    float64 forward (Gemma 3's query weights), so an entry-wise rtol fails on the gradient's near-zero entries; and
    to 1e-7 where the gradient is 0 by symmetry (a key bias, which the softmax ignores: about 5e-9 of noise)."""
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4 * float(expected.abs().max()) + 1e-7, msg=what or None)


def test_paligemma_completion_tokens_see_only_earlier_ones(families):
    """Changing a completion's last token changes no earlier token's log-prob, as in PaliGemma's ``generate`` (each
    sampled token has ``token_type_ids`` 1: causal), and the processor's ``labels`` never reach the model."""
    family = families("paligemma")
    images = family.images
    assert all("labels" not in row for row in images)
    completion_ids, mask = family.padded()
    changed = completion_ids.clone()
    changed[0, 4] = (changed[0, 4] + 1) % family.model.config.get_text_config().vocab_size
    first, second = (batched_logprobs(family.model, family.prompts[:1], ids[:1], mask[:1], pad_id=family.pad_id,
                                      micro_batch_size=1, images=images[:1])[0] for ids in (completion_ids, changed))
    torch.testing.assert_close(first[0, :4], second[0, :4], rtol=0, atol=1e-6)


def colour_reward(calls: list):
    def reward(prompts, completions, answer, **columns):
        calls.append(list(answer))
        texts = [c[0]["content"] for c in completions]  # chat prompts: each completion is the assistant's message
        return [sum(map(ord, text)) % 5 / 4 for text in texts]  # varies within a group: the step has a gradient
    return reward


@pytest.fixture(scope="module")
def grpo_runs(families, tmp_path_factory):
    """family name -> (the run's result, the answers each reward call got): a 2-step GRPO run through
    ``posttrain.train`` on a 4-row JSONL file of chat prompts with one image each (paths relative to the file), run
    once in this module."""
    runs: dict[str, tuple[dict, list]] = {}

    def get(name: str) -> tuple[dict, list]:
        if name not in runs:
            directory = tmp_path_factory.mktemp(f"grpo-{name}")
            rows = []
            for number, (question, size) in enumerate(ROWS):
                messages, image = image_prompt(question, size)
                image.save(directory / f"image{number}.png")
                rows.append({"prompt": messages, "images": [f"image{number}.png"],
                             "answer": ["red", "blue", "green", "red"][number]})
            dataset = directory / "rows.jsonl"
            dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
            calls: list = []
            result = posttrain.train(model=str(families(name).directory), algorithm="grpo", train_dataset=str(dataset),
                                     reward_funcs=[colour_reward(calls)], output=str(directory / "run"), max_steps=2,
                                     prompts_per_step=2, group_size=2, max_new_tokens=3, eval_size=0, eval_every=0,
                                     save_every=0, report_to="none", progress=False, learning_rate=1e-2)
            runs[name] = result, calls
        return runs[name]

    return get


def state(directory: Path) -> dict[str, torch.Tensor]:
    """The weights of the model saved in ``directory``, by the model's own parameter names (checkpoints saved by
    transformers and by posttrain name them differently on disk)."""
    return AutoModelForImageTextToText.from_pretrained(directory).state_dict()


@pytest.mark.parametrize("name", FAMILIES)
def test_a_grpo_run_on_image_rows_trains_the_language_model(families, grpo_runs, name):
    family = families(name)
    if name in QWEN_FAMILIES and not has_processor(family.directory):
        pytest.skip(QWEN_PROCESSOR_MISSING)
    result, calls = grpo_runs(name)
    assert [len(answers) for answers in calls] == [4, 4]  # 2 steps of 2 prompts x 2 completions
    for answers in calls:  # each completion scored with its own row's answer column: a group shares one
        assert answers[0] == answers[1] and answers[2] == answers[3] and set(answers) <= {"red", "blue", "green"}
    final, start = state(result["run_dir"] / "final_model"), state(family.directory)
    assert final.keys() == start.keys()
    vision = [k for k in start if k.startswith(VISION_PARTS[name])]
    assert vision and all(torch.equal(final[k], start[k]) for k in vision)  # train_vision none: frozen
    assert any(not torch.equal(final[k], start[k]) for k in start if k not in vision)  # the language model trained


def test_a_vision_language_final_model_loads_with_its_processor(grpo_runs):
    from transformers import AutoProcessor

    result, _ = grpo_runs("llava")
    processor = AutoProcessor.from_pretrained(result["run_dir"] / "final_model")
    assert type(processor).__name__ == "LlavaProcessor"


@pytest.mark.parametrize("name", FAMILIES)
def test_lora_adapts_the_language_model_alone(families, name):
    model = apply_lora(AutoModelForImageTextToText.from_pretrained(families(name).directory), ModelConfig(lora_r=4))
    names = {n.removeprefix("base_model.model."): p for n, p in model.named_parameters()}
    adapters = [n for n in names if ".lora_A." in n or ".lora_B." in n]
    assert adapters and not [n for n in adapters if n.startswith(VISION_PARTS[name])]
    assert all(names[n].requires_grad for n in adapters)
    # an adapter on each of the language model's attention and MLP projections, in every decoder layer
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in adapters}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert {int(n.split(".layers.")[1].split(".")[0]) for n in adapters} == {0, 1}
    vision = [n for n in names if n.startswith(VISION_PARTS[name])]
    assert vision and not [n for n in vision if names[n].requires_grad]


@pytest.mark.parametrize("name", FAMILIES)
def test_train_vision_none_freezes_the_tower_and_the_projector(families, name):
    model = AutoModelForImageTextToText.from_pretrained(families(name).directory)
    freeze_vision(model, "none")  # what a run with lora_r 0 does
    for n, p in model.named_parameters():
        assert p.requires_grad == (not n.startswith(VISION_PARTS[name])), n
