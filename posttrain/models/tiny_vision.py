"""``tiny-vision``: a tiny LLaVA built offline, warm-started on the ``shapes`` task and cached like ``tiny-addition``.

The model is transformers' ``LlavaForConditionalGeneration``: a CLIP vision tower over the 32x32 image in
8x8 patches (16 patch features, the CLS feature dropped: ``vision_feature_select_strategy="default"``), LLaVA's
two-layer projector, and a Llama text model, with the character tokenizer of :mod:`posttrain.models.tiny` plus
one ``<image>`` token and a chat template. At the recipe's sizes (:class:`VisionRecipe`: the tower 64 wide, 2
layers, 4 heads; the text model 128 wide, 3 layers, 4 heads, MLP 352) it has 0.73M parameters. The processor
(``LlavaProcessor``: a ``CLIPImageProcessor`` and the tokenizer) is saved with the model, so the directory loads
with ``AutoModelForImageTextToText`` and ``AutoProcessor`` and is an architecture vLLM serves.

The warm start is :mod:`posttrain.models.tiny`'s procedure with images: supervised training of the whole model
(tower, projector and language model) on the task's training rows, the loss on the answer and EOS only, stopped
at the first evaluation whose greedy accuracy on a fixed subset of held-out rows reaches the recipe's target. A
prompt is encoded exactly as a run encodes it (:func:`posttrain.data.images.encode_image_prompt`: the chat
template, then the processor), so the warm start and the run see the same tokens and pixels. Caching is
:func:`posttrain.models.tiny.ensure_tiny_model`'s: importing this module adds ``tiny-vision`` to
:data:`posttrain.models.tiny.BUILTIN_MODELS` (:mod:`posttrain.models.loading` imports it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from posttrain.data.images import encode_image_prompt, row_images
from posttrain.data.tasks import get_task
from posttrain.data.tasks.task import Task
from posttrain.models.tiny import BUILTIN_MODELS, TinyRecipe, _log, build_record, char_tokenizer, supervised_until

if TYPE_CHECKING:
    from transformers import LlavaForConditionalGeneration, LlavaProcessor, PreTrainedModel

IMAGE_TOKEN = "<image>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'assistant' %}<eos>{% else %}={% endif %}"
    "{% endfor %}"
)
"""Each message's content (an image part as ``<image>``, which the processor expands to the image's tokens)
followed by ``=`` after a user turn and ``<eos>`` after an assistant turn; the generation prompt adds nothing
(the ``=`` already asks for the answer)."""


@dataclass(frozen=True)
class VisionRecipe(TinyRecipe):
    """A vision-language model's recipe: a LLaVA whose text model is :class:`TinyRecipe`'s fields (Llama only)
    and whose CLIP vision tower is these."""

    image_size: int = 32
    """Width and height of the images the tower takes, in pixels."""
    patch_size: int = 8
    """Side of a patch: ``(image_size / patch_size) ** 2`` image tokens per image."""
    vision_hidden_size: int = 64
    vision_layers: int = 2
    vision_heads: int = 4

    def build(self) -> tuple[PreTrainedModel, LlavaProcessor, dict[str, Any]]:
        """The model, its processor (which saves the tokenizer), and the record."""
        return build_from_recipe(self)


VISION_CHARS = " ?=.,0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
"""The alphabet: the task's question and answers, and short questions in plain English."""

# Its greedy accuracy can rise 0.3 in 10 steps, hence an evaluation every 2 steps, on 200 prompts; 5e-4 is the
# rate the task's run settings were measured from
BUILTIN_MODELS["tiny-vision"] = VisionRecipe(task="shapes", chars=VISION_CHARS, version=1, lr=5e-4, eval_every=2,
                                             eval_prompts=200)


def vision_processor(recipe: VisionRecipe) -> LlavaProcessor:
    """The character tokenizer over ``recipe.chars`` plus ``<image>`` and the chat template, with a CLIP image
    processor that keeps a ``recipe.image_size`` square image as it is (a larger one is resized and cropped)."""
    from transformers import CLIPImageProcessor, LlavaProcessor

    tokenizer = char_tokenizer(recipe.chars, model_max_length=256)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tokenizer.chat_template = CHAT_TEMPLATE
    images = CLIPImageProcessor(size={"shortest_edge": recipe.image_size},
                                crop_size={"height": recipe.image_size, "width": recipe.image_size})
    return LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=recipe.patch_size,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1,
                          chat_template=CHAT_TEMPLATE)


def build_tiny_vlm(processor: LlavaProcessor, recipe: VisionRecipe) -> LlavaForConditionalGeneration:
    """A randomly initialised LLaVA (CLIP tower, Llama text model) for ``processor``'s vocabulary, seeded."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    tokenizer = processor.tokenizer
    vision = CLIPVisionConfig(hidden_size=recipe.vision_hidden_size, intermediate_size=2 * recipe.vision_hidden_size,
                              num_hidden_layers=recipe.vision_layers, num_attention_heads=recipe.vision_heads,
                              image_size=recipe.image_size, patch_size=recipe.patch_size,
                              projection_dim=recipe.vision_hidden_size)
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=recipe.hidden_size,
                       intermediate_size=recipe.intermediate_size, num_hidden_layers=recipe.num_layers,
                       num_attention_heads=recipe.num_heads, num_key_value_heads=recipe.num_heads,
                       max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config = LlavaConfig(vision_config=vision, text_config=text,
                         image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
                         image_seq_length=(recipe.image_size // recipe.patch_size) ** 2,
                         vision_feature_select_strategy="default", vision_feature_layer=-1,
                         tie_word_embeddings=False)
    torch.manual_seed(recipe.seed)
    model = LlavaForConditionalGeneration(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def encode_rows(processor: LlavaProcessor, rows: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
    """([n, P] prompt ids, [n, 3, H, W] pixel values) of rows with one image each and prompts that encode to the
    same length (the task's: one question)."""
    encoded = [encode_image_prompt(processor, row["prompt"], row_images(row, f"row {i}"), f"row {i}")
               for i, row in enumerate(rows)]
    return torch.stack([ids for ids, _ in encoded]), torch.cat([images["pixel_values"] for _, images in encoded])


@torch.no_grad()
def greedy_accuracy(model: PreTrainedModel, processor: LlavaProcessor, task: Task, rows: list[dict[str, Any]],
                    encoded: tuple[torch.Tensor, torch.Tensor], batch_size: int = 250) -> float:
    """Fraction of ``rows`` (encoded as ``encoded``) that ``task.correct`` accepts, decoding greedily."""
    was_training = model.training
    model.eval()
    ids, pixels = encoded
    tokenizer = processor.tokenizer
    right = 0
    for start in range(0, len(rows), batch_size):
        batch = slice(start, start + batch_size)
        out = model.generate(input_ids=ids[batch], attention_mask=torch.ones_like(ids[batch]),
                             pixel_values=pixels[batch], do_sample=False, max_new_tokens=task.max_new_tokens,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        completions = tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)
        picked = rows[batch]
        columns = {key: [row[key] for row in picked] for key in picked[0] if key not in ("prompt", "images")}
        right += sum(task.correct([row["prompt"] for row in picked], completions, **columns))
    model.train(was_training)
    return right / len(rows)


def _supervised_batches(task: Task, processor: LlavaProcessor, recipe: VisionRecipe,
                        encoded: tuple[torch.Tensor, torch.Tensor]):
    """Endless (input_ids, pixel_values, labels) batches of prompt + answer + EOS; labels -100 on the prompt."""
    tokenizer = processor.tokenizer
    prompts, pixels = encoded
    answers = [tokenizer(row["answer"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
               for row in task.train]
    if len({len(a) for a in answers}) != 1:
        raise ValueError(f"task {task.name}: the warm start batches answers of one length")
    ids = torch.cat([prompts, torch.tensor(answers)], dim=1)
    labels = ids.clone()
    labels[:, :prompts.shape[1]] = -100
    generator = torch.Generator().manual_seed(recipe.seed)
    while True:
        order = torch.randperm(len(ids), generator=generator)
        for start in range(0, len(ids) - recipe.batch_size + 1, recipe.batch_size):
            picked = order[start:start + recipe.batch_size]
            yield ids[picked], pixels[picked], labels[picked]


def warm_start(model: PreTrainedModel, processor: LlavaProcessor, task: Task, recipe: VisionRecipe) -> dict[str, Any]:
    """Supervised training until subset greedy accuracy first reaches ``recipe.target_accuracy``."""
    subset = task.test[:recipe.eval_prompts]
    subset_encoded = encode_rows(processor, subset)
    batches = (dict(input_ids=ids, pixel_values=pixels, labels=labels) for ids, pixels, labels
               in _supervised_batches(task, processor, recipe, encode_rows(processor, task.train)))
    return supervised_until(model, batches, lambda: greedy_accuracy(model, processor, task, subset, subset_encoded),
                            recipe)


def build_from_recipe(recipe: VisionRecipe) -> tuple[PreTrainedModel, LlavaProcessor, dict[str, Any]]:
    """Build and warm-start the model; also the processor (which saves the tokenizer) and the record written
    to ``posttrain_recipe.json``."""
    start = time.perf_counter()
    task = get_task(recipe.task, seed=recipe.task_seed)
    processor = vision_processor(recipe)
    model = build_tiny_vlm(processor, recipe)
    n_params = sum(p.numel() for p in model.parameters())
    _log(f"warm-starting a {n_params / 1e6:.2f}M-parameter LLaVA on {recipe.task} "
         f"until held-out greedy accuracy >= {recipe.target_accuracy:.0%}")
    result = warm_start(model, processor, task, recipe)
    heldout = greedy_accuracy(model, processor, task, task.test, encode_rows(processor, task.test))
    _log(f"reached {result['subset_accuracy']:.0%} on {recipe.eval_prompts} held-out prompts after "
         f"{result['steps']} steps ({result['seconds']:.0f}s); {heldout:.1%} on all {len(task.test)} "
         f"({time.perf_counter() - start:.0f}s in all)")
    return model, processor, build_record(recipe, n_params, result, heldout, len(task.test), start)
