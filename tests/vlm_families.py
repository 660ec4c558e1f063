"""Tiny random vision-language models of the major families, built offline and saved like hub checkpoints.

Each builder in :data:`VLM_FAMILIES` writes a random model (two decoder layers, width 32, a one- or two-layer
vision tower) and its processor into a directory with ``save_pretrained``, so that
``AutoModelForImageTextToText.from_pretrained(dir)`` and ``AutoProcessor.from_pretrained(dir)`` load them back:
LLaVA-1.5, Gemma 3, Idefics3 (SmolVLM), LLaVA-NeXT, PaliGemma, Qwen2-VL, Qwen2.5-VL and Qwen3-VL. Nothing comes from
the hub: the tokenizer is a byte-level BPE trained here on a few sentences and the chat template, with the family's
own image and chat special tokens; the chat template is a simplified one that renders a ``{"type": "image"}``
content part as the family's image placeholder.

transformers 5.25 builds the Qwen-VL processors only with torchvision (:data:`QWEN_PROCESSOR_MISSING`); without it a
Qwen-VL directory holds the model, the tokenizer and the image processor, and :func:`qwen_encode` does the processor's
part by hand. :func:`prompt_encoder` gives a directory's (prompt, images) -> (ids, image inputs) either way.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from pathlib import Path

import torch
from PIL import Image

CORPUS = [
    "What is in the image? Describe the picture in one word.",
    "The square is red. The circle is blue. A small green triangle.",
    "What colour is the shape on the left? It is red, then blue, then green.",
    "user assistant system model User: Assistant: USER: ASSISTANT:",
]
"""What the tokenizers' merges are learnt from, with each family's chat template."""


def bpe_tokenizer(template: str, special_tokens: list[str], *, bos: str | None, eos: str, pad: str,
                  named_tokens: dict[str, str] | None = None):
    """A byte-level BPE over :data:`CORPUS` and ``template``, whose ``special_tokens`` are one id each.

    ``named_tokens`` become tokenizer attributes (``image_token``, ``boi_token``, ...) that some processors
    read to find their placeholders; they are saved with the tokenizer, as the families' checkpoints do.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = list(dict.fromkeys([pad, eos, *([bos] if bos else []), *special_tokens, *(named_tokens or {}).values()]))
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator([template, *CORPUS] * 2,
                             trainers.BpeTrainer(vocab_size=420, special_tokens=specials, show_progress=False,
                                                 initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=bos, eos_token=eos, pad_token=pad,
                                        extra_special_tokens=named_tokens or {})
    tokenizer.chat_template = template
    return tokenizer


def token_id(tokenizer, token: str) -> int:
    """The id of a special token, which must be a single token of the vocabulary."""
    ids = tokenizer.convert_tokens_to_ids([token])
    assert ids[0] is not None and ids[0] != tokenizer.unk_token_id, token
    return ids[0]


def randomize(model, std: float = 0.1):
    """Draw every weight from N(0, std) (norm weights 1 + N(0, std)), seeded by the caller: transformers'
    zero biases and unit norms would leave parts of the model out of what a test compares."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and param.dim() == 1:
                param.copy_(1 + std * torch.randn_like(param))
            else:
                param.normal_(0, std)
    return model.eval()


def save(directory: Path, model, processor) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


# ---------------------------------------------------------------------------------------------- LLaVA


LLAVA_TEMPLATE = (
    "{% for message in messages %}{{ message['role'].upper() + ': ' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<image>\n' }}"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ ' ' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
"""llava-1.5-hf's layout: ``USER: <image>\\nQUESTION ASSISTANT:``."""


def build_llava(directory: Path) -> Path:
    """LLaVA-1.5: a CLIP vision tower (its CLS token dropped, ``vision_feature_select_strategy='default'``), a
    two-layer MLP projector and a Llama; one ``<image>`` becomes (32/8)^2 = 16 tokens."""
    from transformers import (CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration,
                              LlavaImageProcessorPil, LlavaProcessor)

    tokenizer = bpe_tokenizer(LLAVA_TEMPLATE, ["<image>"], bos="<s>", eos="</s>", pad="<pad>")
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              image_size=32, patch_size=8, projection_dim=32)
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=token_id(tokenizer, "<image>"),
                         vision_feature_select_strategy="default", vision_feature_layer=-1)
    torch.manual_seed(0)
    model = randomize(LlavaForConditionalGeneration(config))
    image_processor = LlavaImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=8,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=LLAVA_TEMPLATE)
    return save(directory, model, processor)


# ---------------------------------------------------------------------------------------------- Gemma 3


GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{{ '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
"""Gemma 3's layout: ``<bos><start_of_turn>user\\n<start_of_image>QUESTION<end_of_turn>\\n<start_of_turn>model\\n``;
the processor expands ``<start_of_image>`` into ``\\n\\n<start_of_image>`` + mm_tokens_per_image
``<image_soft_token>`` + ``<end_of_image>\\n\\n``."""


def build_gemma3(directory: Path) -> Path:
    """Gemma 3 (4B and up): a SigLIP tower whose 4x4 patches are average-pooled to 2x2 = 4 soft tokens, projected
    by one matrix; a Gemma 3 text model with a sliding-window layer (window 8, so that the test's sequences
    cross it) and a global one. Image tokens attend to each other bidirectionally where ``token_type_ids``
    marks them."""
    from transformers import (Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil,
                              Gemma3Processor, Gemma3TextConfig, SiglipVisionConfig)

    names = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tokenizer = bpe_tokenizer(GEMMA3_TEMPLATE, ["<start_of_turn>", "<end_of_turn>"], bos="<bos>", eos="<eos>",
                              pad="<pad>", named_tokens=names)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=32, patch_size=8)
    text = Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8,
                            sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                            max_position_embeddings=256, pad_token_id=tokenizer.pad_token_id,
                            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                          boi_token_index=token_id(tokenizer, names["boi_token"]),
                          eoi_token_index=token_id(tokenizer, names["eoi_token"]),
                          image_token_index=token_id(tokenizer, names["image_token"]))
    torch.manual_seed(0)
    model = randomize(Gemma3ForConditionalGeneration(config))
    image_processor = Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_length=4,
                                chat_template=GEMMA3_TEMPLATE)
    return save(directory, model, processor)


# ---------------------------------------------------------------------------------------------- Idefics3 (SmolVLM)


IDEFICS3_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}:"
    "{% if message['content'] is string %}{{ ' ' + message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% else %}{{ ' ' + part['text'] }}{% endif %}{% endfor %}{% endif %}{{ '<end_of_utterance>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
"""SmolVLM's layout: ``<|im_start|>User:<image> QUESTION<end_of_utterance>\\nAssistant:``; the processor expands
``<image>`` into one ``<fake_token_around_image><row_i_col_j>`` + image_seq_len ``<image>`` block per crop, a newline
per row of crops, and the global image's ``<fake_token_around_image><global-img>`` block."""


def build_idefics3(directory: Path) -> Path:
    """Idefics3 (SmolVLM's architecture): a SigLIP-like tower over 32-px crops of 8-px patches, a pixel shuffle
    (scale factor 2: 16 patches -> 4 tokens) and one linear connector, a Llama. Images are resized to a longest
    edge of 64 and split into 32-px crops plus the whole image, so images of different shapes give prompts with
    different numbers of crops (the batch pads ``pixel_values`` with all-zero crops, which the model drops)."""
    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessorPil,
                              Idefics3Processor, Idefics3VisionConfig, LlamaConfig)

    crops = [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
    tokenizer = bpe_tokenizer(IDEFICS3_TEMPLATE, ["<|im_start|>", "<fake_token_around_image>", "<image>",
                                                  "<global-img>", *crops], bos="<|im_start|>",
                              eos="<end_of_utterance>", pad="<|endoftext|>")
    image_processor = Idefics3ImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32},
                                                do_image_splitting=True)
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4,
                                  chat_template=IDEFICS3_TEMPLATE)
    vision = Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                  image_size=32, patch_size=8)
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id)
    config = Idefics3Config(vision_config=vision, text_config=text, scale_factor=2,
                            image_token_id=token_id(tokenizer, "<image>"), pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = randomize(Idefics3ForConditionalGeneration(config))
    return save(directory, model, processor)


# ---------------------------------------------------------------------------------------------- PaliGemma


PALIGEMMA_TEMPLATE = (
    "{% for message in messages %}{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{% endfor %}"
)
"""PaliGemma's layout (no chat turns): ``<image>QUESTION``; the processor repeats ``<image>`` image_seq_length times
and puts ``<bos>`` after the image and ``\\n`` at the end: ``<image>*16<bos>QUESTION\\n``."""


def build_paligemma(directory: Path) -> Path:
    """PaliGemma: a SigLIP tower (16 patches of 8 px: 16 image tokens), one linear projector and a Gemma whose
    prefix (the image and the question, ``token_type_ids`` 0) attends bidirectionally and whose suffix (the answer,
    ``token_type_ids`` 1: what generation appends) attends causally."""
    from transformers import (GemmaConfig, PaliGemmaConfig, PaliGemmaForConditionalGeneration, PaliGemmaProcessor,
                              SiglipImageProcessorPil, SiglipVisionConfig)

    tokenizer = bpe_tokenizer(PALIGEMMA_TEMPLATE, [], bos="<bos>", eos="<eos>", pad="<pad>",
                              named_tokens={"image_token": "<image>"})
    image_processor = SiglipImageProcessorPil(size={"height": 32, "width": 32})
    image_processor.image_seq_length = 16
    processor = PaliGemmaProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                   chat_template=PALIGEMMA_TEMPLATE)  # adds its <loc>/<seg> tokens to the vocabulary
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=32, patch_size=8)
    text = GemmaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                       pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id)
    config = PaliGemmaConfig(vision_config=vision, text_config=text, projection_dim=32, hidden_size=32,
                             image_token_index=token_id(tokenizer, "<image>"), vocab_size=len(tokenizer))
    torch.manual_seed(0)
    model = randomize(PaliGemmaForConditionalGeneration(config))
    return save(directory, model, processor)


# ---------------------------------------------------------------------------------------------- LLaVA-NeXT


LLAVA_NEXT_PINPOINTS = [[32, 64], [64, 32], [64, 64]]
"""The resolutions (height, width) an image is fitted to before it is cut into 32-px tiles: 2 or 4 tiles, plus the
whole image resized to 32 px."""


def build_llava_next(directory: Path) -> Path:
    """LLaVA-NeXT (LLaVA-1.6, "anyres"): LLaVA-1.5's CLIP tower and projector applied to the tiles of the best-fitting
    of :data:`LLAVA_NEXT_PINPOINTS` and to the whole image; the tiles' features are unpadded back to the image's
    aspect ratio with an ``image_newline`` embedding per row. Images of different shapes have different numbers of
    tiles and of image tokens: the batch zero-pads ``pixel_values`` [1, tiles, C, 32, 32] to the most tiles, and the
    model reads each image's own tiles from ``image_sizes``."""
    from transformers import (CLIPVisionConfig, LlamaConfig, LlavaNextConfig, LlavaNextForConditionalGeneration,
                              LlavaNextImageProcessorPil, LlavaNextProcessor)

    tokenizer = bpe_tokenizer(LLAVA_TEMPLATE, ["<image>"], bos="<s>", eos="</s>", pad="<pad>")
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              image_size=32, patch_size=8, projection_dim=32)
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id)
    config = LlavaNextConfig(vision_config=vision, text_config=text, image_token_index=token_id(tokenizer, "<image>"),
                             image_grid_pinpoints=LLAVA_NEXT_PINPOINTS, vision_feature_select_strategy="default",
                             vision_feature_layer=-1)
    torch.manual_seed(0)
    model = randomize(LlavaNextForConditionalGeneration(config))
    image_processor = LlavaNextImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                                 image_grid_pinpoints=LLAVA_NEXT_PINPOINTS)
    processor = LlavaNextProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=8,
                                   vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                   chat_template=LLAVA_TEMPLATE)
    return save(directory, model, processor)


# ---------------------------------------------------------------------------------------------- Qwen


QWEN_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}{% else %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL's layout (without Qwen2's default system turn):
``<|im_start|>user\\n<|vision_start|><|image_pad|><|vision_end|>QUESTION<|im_end|>\\n<|im_start|>assistant\\n``;
the processor repeats ``<|image_pad|>`` once per merged patch."""

QWEN_SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                       "<|video_pad|>"]

QWEN_PROCESSOR_MISSING = ("transformers 5.25 builds the Qwen-VL processors only with torchvision (their video "
                          "processor; without it ProcessorMixin's class check walks a dummy VIDEO_PROCESSOR_MAPPING: "
                          "AttributeError '_extra_content'), which is not installed here")


def qwen_parts(patch_size: int):
    """The tokenizer, the text config's shared fields, the special token ids of the config and the image processor
    (images resized to multiples of 2 * ``patch_size``, 4 to 16 merged patches: dynamic resolution) of the Qwen VL
    families."""
    from transformers import Qwen2VLImageProcessorPil

    tokenizer = bpe_tokenizer(QWEN_TEMPLATE, QWEN_SPECIAL_TOKENS, bos=None, eos="<|im_end|>", pad="<|endoftext|>")
    text = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                pad_token_id=tokenizer.pad_token_id, bos_token_id=None, eos_token_id=tokenizer.eos_token_id)
    ids = dict(image_token_id=token_id(tokenizer, "<|image_pad|>"), video_token_id=token_id(tokenizer, "<|video_pad|>"),
               vision_start_token_id=token_id(tokenizer, "<|vision_start|>"),
               vision_end_token_id=token_id(tokenizer, "<|vision_end|>"))
    factor = 2 * patch_size
    image_processor = Qwen2VLImageProcessorPil(patch_size=patch_size, merge_size=2,
                                               size={"shortest_edge": 4 * factor ** 2,
                                                     "longest_edge": 16 * factor ** 2})
    return tokenizer, text, ids, image_processor


def qwen_processor(processor_class, video_processor_class, tokenizer, image_processor):
    """The family's processor, or None where transformers cannot build it here (:data:`QWEN_PROCESSOR_MISSING`)."""
    try:
        return processor_class(image_processor=image_processor, tokenizer=tokenizer,
                               video_processor=video_processor_class(), chat_template=QWEN_TEMPLATE)
    except (AttributeError, ImportError):
        return None


def save_qwen(directory: Path, model, tokenizer, image_processor, processor) -> Path:
    """The model, its tokenizer and image processor (what :func:`qwen_encode` reads), and its processor where it
    could be built."""
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    image_processor.save_pretrained(directory)
    if processor is not None:
        processor.save_pretrained(directory)
    return directory


def qwen_encode(tokenizer, image_processor, messages: list[dict], images: list[Image.Image]):
    """([P] prompt ids, image inputs) as a Qwen-VL processor gives them for one chat prompt, without the processor:
    the image processor's ``pixel_values`` [patches, C * T * P * P] and ``image_grid_thw`` [images, 3], the chat
    template's ``<|image_pad|>`` repeated t * h * w / merge_size^2 times (one token per merged patch) between
    ``<|vision_start|>`` and ``<|vision_end|>``, and ``mm_token_type_ids`` [1, P] (1 at those tokens), which the
    model's multimodal rotary positions read."""
    inputs = dict(image_processor(images=images, return_tensors="pt"))
    merged = (inputs["image_grid_thw"].prod(-1) // image_processor.merge_size ** 2).tolist()
    pieces = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False).split("<|image_pad|>")
    assert len(pieces) == len(images) + 1, "one image part per image"
    text = pieces[0] + "".join("<|image_pad|>" * n + piece for n, piece in zip(merged, pieces[1:]))
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
    inputs["mm_token_type_ids"] = (ids == token_id(tokenizer, "<|image_pad|>")).long()[None]
    return ids, inputs


def build_qwen2_vl(directory: Path) -> Path:
    """Qwen2-VL: a ViT over 14-px patches (2 frames per temporal patch) with 2-D rotary positions, whose 2x2
    neighbours a merger MLP folds into one token; a Qwen2 text model with multimodal rotary positions
    (mrope: temporal, height and width sections of each head)."""
    from transformers import (Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor,
                              Qwen2VLVideoProcessor)

    tokenizer, text, ids, image_processor = qwen_parts(patch_size=14)
    vision = dict(depth=2, embed_dim=32, hidden_size=32, mlp_ratio=2, num_heads=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
    config = Qwen2VLConfig(text_config=text, vision_config=vision, **ids)
    torch.manual_seed(0)
    model = randomize(Qwen2VLForConditionalGeneration(config))
    processor = qwen_processor(Qwen2VLProcessor, Qwen2VLVideoProcessor, tokenizer, image_processor)
    return save_qwen(directory, model, tokenizer, image_processor, processor)


def build_qwen2_5_vl(directory: Path) -> Path:
    """Qwen2.5-VL: Qwen2-VL with RMSNorm/SwiGLU vision blocks and windowed attention in all but the
    ``fullatt_block_indexes`` blocks (a window of one merged patch here, so that it bites)."""
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor,
                              Qwen2VLVideoProcessor)

    tokenizer, text, ids, image_processor = qwen_parts(patch_size=14)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, window_size=28, fullatt_block_indexes=[1], out_hidden_size=32)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
    torch.manual_seed(0)
    model = randomize(Qwen2_5_VLForConditionalGeneration(config))
    processor = qwen_processor(Qwen2_5_VLProcessor, Qwen2VLVideoProcessor, tokenizer, image_processor)
    return save_qwen(directory, model, tokenizer, image_processor, processor)


def build_qwen3_vl(directory: Path) -> Path:
    """Qwen3-VL: a ViT over 16-px patches with learnt positions (interpolated to the image's grid) and
    rotary ones, a merger, and DeepStack: the features of ``deepstack_visual_indexes`` blocks are added to
    the first decoder layers' hidden states at the image tokens; a Qwen3 text model with interleaved mrope."""
    from transformers import (Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor,
                              Qwen3VLVideoProcessor)

    tokenizer, text, ids, image_processor = qwen_parts(patch_size=16)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=32, num_position_embeddings=16, deepstack_visual_indexes=[0])
    text.update(head_dim=8, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                             "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    config = Qwen3VLConfig(text_config=text, vision_config=vision, **ids)
    torch.manual_seed(0)
    model = randomize(Qwen3VLForConditionalGeneration(config))
    processor = qwen_processor(Qwen3VLProcessor, Qwen3VLVideoProcessor, tokenizer, image_processor)
    return save_qwen(directory, model, tokenizer, image_processor, processor)


VLM_FAMILIES: dict[str, Callable[[Path], Path]] = {
    "llava": build_llava,
    "gemma3": build_gemma3,
    "idefics3": build_idefics3,
    "paligemma": build_paligemma,
    "llava_next": build_llava_next,
    "qwen2_vl": build_qwen2_vl,
    "qwen2_5_vl": build_qwen2_5_vl,
    "qwen3_vl": build_qwen3_vl,
}
"""Family name (the checkpoints' ``model_type``) -> a builder that writes the tiny model and its processor (a
Qwen-VL family's tokenizer and image processor, and its processor where it can be built) into a directory and
returns it."""

QWEN_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def has_processor(directory: Path) -> bool:
    """Whether the builder could save the family's processor (a Qwen-VL one needs torchvision)."""
    return (directory / "processor_config.json").is_file()


def prompt_encoder(directory: Path) -> Callable[[list[dict], list[Image.Image]], tuple[torch.Tensor, dict]]:
    """How a row's chat prompt and images become ([P] prompt ids, image inputs): posttrain's own
    ``encode_image_prompt`` over the saved processor; a Qwen-VL model saved without one, :func:`qwen_encode` over its
    tokenizer and image processor."""
    if has_processor(directory):
        from transformers import AutoProcessor

        from posttrain.data.images import encode_image_prompt

        processor = AutoProcessor.from_pretrained(directory)
        return lambda messages, images: encode_image_prompt(processor, messages, images, "test row")
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(directory)
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(directory)
    return lambda messages, images: qwen_encode(tokenizer, image_processor, messages, images)


def image_prompt(question: str = "What is in the image?",
                 size: tuple[int, int] = (40, 32)) -> tuple[list[dict], Image.Image]:
    """A one-turn chat with one image part and ``question``, and a random RGB image of ``size`` (width,
    height) that the family's processor resizes to what its vision tower takes."""
    generator = torch.Generator().manual_seed(zlib.crc32(question.encode()))
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=generator, dtype=torch.uint8)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    return messages, Image.fromarray(pixels.numpy())
