"""Image-text-to-text models (vision-language models): recognised, their processor kept, their vision frozen, their
image inputs batched, and their training passes run on the model's own forward.

A vision-language model is a transformers image-text-to-text model (``AutoModelForImageTextToText``: LLaVA,
Qwen2.5-VL, Qwen3-VL, SmolVLM/Idefics3, Gemma 3, ...): a vision tower encodes each image, a projector maps it
into the language model's embeddings at the prompt's image tokens, and the language model goes on as a causal
LM. posttrain trains the language model (LoRA by default on its layers alone) and freezes the tower and the
projector unless ``train_vision`` says otherwise.

Exact by construction: every training pass of a vision-language model (the step's, the old policy's, the
reference's) is the model's own forward over rows of prompt (left-padded) and completion (right-padded), with
the rows' image inputs batched as its processor batches them (:func:`batch_image_inputs`). The text-only fast
paths (packed rows, a shared prompt's cache, the folded head) step aside, said once: a group's rows each run
their image through the tower. Image tokens are prompt tokens, so they are never scored.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor, nn

from posttrain.models.architecture import unwrapped

TOWERS = ("vision_tower", "visual", "vision_model", "vision_encoder", "image_encoder")
"""What families call their vision encoder (the submodule's own name)."""
PROJECTORS = ("multi_modal_projector", "connector", "mm_projector", "merger", "vision_projection", "projector")
"""What families call the map from image features into the language model's embeddings."""
PROJECTOR_PARAMETERS = ("image_newline", "image_seperator", "image_separator")
"""Parameters outside any module that belong to the image embedding (LLaVA-NeXT's row separator): frozen with the
projector."""
PER_TOKEN = ("token_type_ids", "mm_token_type_ids")
"""Image inputs that run along the prompt's tokens (Gemma 3's image-token marks): padded as the ids are."""
GENERATED_TOKEN_TYPE = {"paligemma": 1}
"""The ``token_type_ids`` a family gives the tokens it generates, where not 0: PaliGemma's 0 marks the prefix that
attends both ways, 1 the causal suffix (its ``generate`` marks each new token 1); Gemma 3's 0 is plain text."""


def generated_token_type(model: nn.Module) -> int:
    """The token type of a completion's tokens for ``model`` (:data:`GENERATED_TOKEN_TYPE`, else 0)."""
    return GENERATED_TOKEN_TYPE.get(getattr(unwrapped(model).config, "model_type", None), 0)


def causal_text_inputs(model: nn.Module, input_ids: Tensor) -> dict[str, Tensor]:
    """What a forward over text alone needs so that it is causal: PaliGemma's ids all marked as its suffix
    (unmarked, its whole row would attend both ways); nothing for other models."""
    kind = generated_token_type(model) if is_vision_model(model) else 0
    return {"token_type_ids": torch.full_like(input_ids, kind)} if kind else {}


def is_vision_model(model: nn.Module) -> bool:
    """Whether ``model`` takes images: its config has a vision part."""
    return getattr(unwrapped(model).config, "vision_config", None) is not None


def vision_parts(model: nn.Module) -> tuple[list[str], list[str]]:
    """(the vision tower's module paths, the projector's), as ``named_modules`` names them."""
    towers, projectors = [], []
    for name, _ in unwrapped(model).named_modules():
        last = name.rsplit(".", 1)[-1]
        inside = any(name.startswith(p + ".") for p in towers + projectors)
        if last in TOWERS and not inside:
            towers.append(name)
        elif last in PROJECTORS and not inside:
            projectors.append(name)
    return towers, projectors


def image_token_ids(model: nn.Module) -> list[int]:
    """The special token ids that stand for image or video content in a prompt (the config's
    ``image_token_id``/``image_token_index``, ``video_token_id``, ``vision_start_token_id``, ...)."""
    config = unwrapped(model).config
    ids = set()
    for name, value in vars(config).items():
        if re.fullmatch(r"(image|video|vision|boi|eoi)\w*_token_(id|index)", name) and isinstance(value, int) and value >= 0:
            ids.add(value)
    return sorted(ids)


def freeze_vision(model: nn.Module, train: str) -> None:
    """Freeze the vision tower and the projector (``train`` ``none``), the tower alone (``projector``), or neither
    (``tower``: both train)."""
    towers, projectors = vision_parts(model)
    frozen = {"none": towers + projectors, "projector": towers, "tower": []}[train]
    modules = dict(unwrapped(model).named_modules())
    for name in frozen:
        modules[name].requires_grad_(False)
    if train == "none":  # a projector's loose parameters (LLaVA-NeXT's image_newline) stay with the projector
        for name, parameter in unwrapped(model).named_parameters():
            if name.rsplit(".", 1)[-1] in PROJECTOR_PARAMETERS:
                parameter.requires_grad_(False)


def language_only(model: nn.Module, names: list[str]) -> str:
    """A ``peft`` ``target_modules`` pattern: the layers named ``names`` outside the vision tower and projector."""
    towers, projectors = vision_parts(model)
    outside = "".join(f"(?!{re.escape(p)}\\.)" for p in towers + projectors)
    return f"^{outside}.*\\.({'|'.join(map(re.escape, names))})$"


def batch_image_inputs(inputs: list[dict[str, Tensor]], prompt_lengths: list[int], prompt_width: int,
                       width: int, *, right_padded: bool = False, completion_type: int = 0) -> dict[str, Tensor]:
    """One batch's image inputs from each row's own (``encode_image_prompt``'s, one prompt each): a per-image or
    per-patch tensor (``pixel_values``, ``image_grid_thw``, ...) concatenated along its first dimension, its
    other dimensions zero-padded to the widest (Idefics3's images per prompt); a per-token one (``PER_TOKEN``)
    left-padded as the prompt is (``prompt_lengths``, to ``prompt_width``) and zero over the completion, to
    ``width`` columns (``right_padded``: each row's prompt starts at column 0), ``completion_type`` after the prompt
    (:func:`generated_token_type`). Rows without images add nothing."""
    keys = list(dict.fromkeys(k for row in inputs for k in row))
    out = {}
    for key in keys:
        if key in PER_TOKEN:
            column = torch.zeros(len(inputs), width, dtype=torch.long)
            for row, (given, length) in enumerate(zip(inputs, prompt_lengths)):
                start = 0 if right_padded else prompt_width - length
                column[row, start + length:] = completion_type
                if key in given:
                    column[row, start:start + length] = given[key][0, -length:]
            out[key] = column
            continue
        parts = [row[key] for row in inputs if key in row]
        shape = [max(p.shape[d] for p in parts) for d in range(1, parts[0].dim())]
        padded = [nn.functional.pad(p, [x for d in reversed(range(1, p.dim())) for x in (0, shape[d - 1] - p.shape[d])])
                  for p in parts]
        out[key] = torch.cat(padded)
    return out


def vision_outputs(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, completion_width: int,
                   image_inputs: dict[str, Tensor], hidden: bool) -> tuple[Tensor, Tensor | None]:
    """The model's own forward over ``input_ids`` [n, S] (prompt then completion, the last ``completion_width``
    columns): ([n, T, V] logits at the positions that predict each completion token, [n, T, D] the last hidden
    states there or None). The position ids are the model's own (a Qwen-VL's rope reads the image grid)."""
    if not image_inputs and torch.isin(input_ids, torch.tensor(image_token_ids(model), device=input_ids.device)).any():
        raise ValueError("a prompt holds image tokens but its row has no images: give the images in the row's "
                         "images column (a prompt's image placeholder tokens stand for its images)")
    dtype = next(p.dtype for p in unwrapped(model).parameters() if p.is_floating_point())
    device = input_ids.device
    given = {k: (v.to(device, dtype) if v.is_floating_point() else v.to(device)) for k, v in image_inputs.items()}
    if "token_type_ids" not in given:
        given.update(causal_text_inputs(model, input_ids))
    out = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=completion_width + 1,
                output_hidden_states=hidden, **given)
    logits = out.logits[:, :completion_width]
    states = out.hidden_states[-1][:, -completion_width - 1:-1] if hidden else None
    return logits, states
