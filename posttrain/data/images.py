"""Images in rows, as TRL keeps them: an ``images`` column (paths, PIL images, or ``datasets``' image dicts) and a
prompt of chat messages whose content holds one ``{"type": "image"}`` part per image, in order.

:func:`row_images` reads a row's images (a path relative to the dataset file's directory, else to the working
directory), naming the row and the image when one is missing or unreadable. :func:`encode_image_prompt` renders
the prompt with the processor's chat template and runs the processor over text and images: the prompt's token
ids (each image placeholder expanded to the model's image tokens) and the model's image inputs
(``pixel_values`` and whatever else the family takes: ``image_grid_thw``, ``pixel_attention_mask``,
``token_type_ids``, ...), for one prompt; :mod:`posttrain.models.vision` batches them.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from torch import Tensor

from posttrain.data.prompts import DataError

IMAGE_COLUMNS = ("images", "image")
"""TRL's columns: ``images`` (a list) and ``image`` (one)."""
PROCESSOR_ATTRIBUTE = "posttrain_processor"


def attach_processor(tokenizer: Any, processor: Any) -> Any:
    """The model's text tokenizer, carrying its processor (the run passes tokenizers around; a prompt with images
    needs the processor)."""
    setattr(tokenizer, PROCESSOR_ATTRIBUTE, processor)
    return tokenizer


def processor_of(tokenizer: Any) -> Any:
    """The processor a tokenizer carries, or None (a text-only model's)."""
    return getattr(tokenizer, PROCESSOR_ATTRIBUTE, None)


def has_images(row: dict[str, Any]) -> bool:
    return any(row.get(column) is not None for column in IMAGE_COLUMNS)


def image_names(row: dict[str, Any]) -> list[str]:
    """A row's images as a record names them: each file's path, or what a PIL image or an image dict is."""
    value = next(row[c] for c in IMAGE_COLUMNS if row.get(c) is not None)
    items = value if isinstance(value, (list, tuple)) else [value]
    return [str(item) if isinstance(item, (str, Path)) else
            str(item.get("path") or "image bytes") if isinstance(item, dict) else type(item).__name__ for item in items]


def image_placeholders(prompt: Any) -> int:
    """The ``{"type": "image"}`` parts of a prompt's messages (0 for a plain string)."""
    if not isinstance(prompt, list):
        return 0
    return sum(1 for message in prompt if isinstance(message.get("content"), list)
               for part in message["content"] if isinstance(part, dict) and part.get("type") == "image")


def row_images(row: dict[str, Any], where: str, base: Path | None = None) -> list[Any]:
    """The row's images as RGB PIL images; a DataError naming ``where`` and the image for one that cannot be read."""
    from PIL import Image

    value = row.get("images", row.get("image"))
    if value is None:
        return []
    items = value if isinstance(value, (list, tuple)) else [value]
    images = []
    for number, item in enumerate(items, start=1):
        what = f"{where}: image {number}"
        try:
            if isinstance(item, Image.Image):
                image = item
            elif isinstance(item, dict) and (item.get("bytes") or item.get("path")):  # datasets' Image feature
                image = Image.open(io.BytesIO(item["bytes"])) if item.get("bytes") else Image.open(
                    _located(item["path"], base, what))
            elif isinstance(item, (str, Path)):
                image = Image.open(_located(item, base, what))
            else:
                raise DataError(f"{what} is a {type(item).__name__}; give a file path or a PIL image")
            images.append(image.convert("RGB"))
        except DataError:
            raise
        except OSError as error:  # PIL's UnidentifiedImageError is one
            raise DataError(f"{what} cannot be read as an image ({error})") from None
    return images


def _located(path: str | Path, base: Path | None, what: str) -> Path:
    path = Path(path)
    for candidate in ([base / path] if base is not None and not path.is_absolute() else []) + [path]:
        if candidate.is_file():
            return candidate
    raise DataError(f"{what} ({path}): no such file" + (f" (looked in {base} and the working directory)"
                                                        if base is not None and not path.is_absolute() else ""))


def encode_row_prompt(tokenizer: Any, row: dict[str, Any], where: str, tools: Any = ()) -> tuple[Tensor, dict[str, Tensor] | None]:
    """A row's prompt as token ids, and its image inputs when it has images (None when it has none); a DataError
    for images given to a text-only model."""
    from posttrain.data.prompts import encode_prompt

    if not has_images(row):
        return encode_prompt(tokenizer, row["prompt"], where, tools=tools), None
    processor = processor_of(tokenizer)
    if processor is None:
        raise DataError(f"{where}: the row has images, but the model is text-only (its directory has no image "
                        "processor); train an image-text-to-text model (LLaVA, Qwen2.5-VL, SmolVLM, ...) or drop the "
                        "images column")
    return encode_image_prompt(processor, row["prompt"], row_images(row, where), where)


def dataset_directory(dataset: str) -> Path:
    """Where a dataset's relative image paths start: its file's directory, a directory itself, else here."""
    path = Path(dataset)
    return path if path.is_dir() else path.parent if path.is_file() else Path.cwd()


def resolve_image_paths(rows: list[dict[str, Any]], base: Path, source: str) -> None:
    """Make each row's image paths absolute (relative ones read from ``base``, the dataset file's directory, else
    the working directory) and check each file opens as an image: a DataError names the row and the image."""
    for number, row in enumerate(rows, start=1):
        for column in IMAGE_COLUMNS:
            value = row.get(column)
            if value is None:
                continue
            items = value if isinstance(value, (list, tuple)) else [value]
            located = [_opens(_located(item, base, f"{source}: row {number}: image {i}"),
                              f"{source}: row {number}: image {i}")
                       if isinstance(item, (str, Path)) else item for i, item in enumerate(items, start=1)]
            row[column] = located if isinstance(value, (list, tuple)) else located[0]


def _opens(path: Path, what: str) -> str:
    """``path``, absolute, once its header reads as an image's."""
    from PIL import Image

    try:
        with Image.open(path):
            pass
    except OSError as error:
        raise DataError(f"{what} ({path}) cannot be read as an image ({error})") from None
    return str(path.resolve())


def encode_image_prompt(processor: Any, prompt: Any, images: list[Any], where: str) -> tuple[Tensor, dict[str, Tensor]]:
    """([P] the prompt's token ids, the model's image inputs for it) from the processor; a DataError when the
    prompt's image placeholders and the row's images do not pair up."""
    if not isinstance(prompt, list):
        raise DataError(f"{where}: a row with images needs its prompt as chat messages whose content holds a "
                        '{"type": "image"} part per image; got a string')
    wanted = image_placeholders(prompt)
    if wanted != len(images):
        raise DataError(f"{where}: {len(images)} image(s) in the row, {wanted} {{\"type\": \"image\"}} part(s) in its "
                        "prompt; give one part per image, in order")
    text = processor.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    encoded = dict(processor(text=[text], images=images or None, return_tensors="pt"))
    ids = encoded.pop("input_ids")[0]
    for made_for_supervision in ("attention_mask", "labels"):  # PaliGemma's processor writes labels
        encoded.pop(made_for_supervision, None)
    return ids, encoded
