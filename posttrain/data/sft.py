"""Supervised fine-tuning data: TRL's three SFT dataset shapes, checked, tokenized, truncated, packed.

From a JSONL/JSON/Parquet/CSV file, a directory or ``hf:NAME`` (``posttrain.data.prompts.read_rows``); the
first row's columns decide the shape, and every row must have it:

- ``text``: a string; the loss covers every token;
- ``prompt`` + ``completion``: two strings, or two lists of chat messages (TRL's conversational
  prompt-completion). Strings are tokenized as the preference data are (the prompt with the tokenizer's
  special tokens, as generation sees it; the completion without, EOS appended); chat messages are
  rendered as TRL does (the prompt with the chat template and the generation prompt, the completion
  as what the template adds after it, its end of turn included, no EOS added). The completion may also be
  a list of segments, ``{"text": ..., "train": true|false}``: each tokenized alone, EOS appended, and only
  the ``train`` segments (and EOS) trained on. That is how a tool-use demonstration is written: the
  model's call and answer trained, the tool's result between them not (``--task gsm-calculator``'s
  ``solution``), whatever ``completion_only_loss`` says. The loss covers the completion only when the preset's
  ``completion_only_loss`` is True, else every token;
- ``messages``: a list of ``{"role", "content"}``, rendered with the chat template. With
  ``completion_only_loss`` the loss covers the assistant turns only: the text each assistant message
  adds, found by rendering the conversation's prefixes (up to the message before it with the
  generation prompt, then up to the message itself) rather than by ``{% generation %}`` markers,
  which most templates lack. A turn's span is all the template writes after the generation prompt:
  the content and the end-of-turn text (ChatML: ``content<|im_end|>\\n``). A template that renders a
  prefix differently once more messages follow (one that drops earlier turns' reasoning, say) is
  an error naming the row: its assistant spans cannot be cut off the whole conversation.

A ``messages`` conversation is tokenized piece by piece (a piece is a span trained on or not), so an
assistant span's tokens are exactly its text's whatever the tokenizer would merge across its border.

Images (a vision-language model's rows): an ``images`` column as in online data (``posttrain.data.images``), in
``prompt`` + ``completion`` rows whose prompt is chat messages, or ``messages`` rows whose last message is the one
assistant turn; the prompt (the conversation before that turn) is encoded with its images by the model's processor
and never trained on, so image tokens are never scored. Such an example is one row of its own (no packing), and a
prompt with images is never cut.

A built-in task (``--task addition``) gives demonstrations: each training prompt with its reference
``solution`` as the completion (the rows a built-in model is warm-started on); its held-out prompts
with theirs are the held-out demonstrations.

Truncation keeps the start: an example longer than ``max_length`` tokens loses its end, and is counted
as truncated. Token 0 of an example is never trained on (nothing predicts it).

Packing (:func:`pack`, :func:`layout`): an optimizer step's examples are placed into rows of up to
``max_length`` positions, best fit decreasing; each example's position ids restart at 0, which is how
transformers' attention masks tell packed examples apart (``masking_utils.find_packed_sequence_indices``):
attention is causal within each example and never crosses into another. Without packing each example is
its own row, right-padded to the micro-batch's longest. Either way a row holds each example's tokens but
its last (which predicts nothing), and the token each position predicts.

Every problem with a row is a ``DataError`` naming the source, the 1-based row number and the field.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from posttrain.data.images import dataset_directory, encode_row_prompt, has_images, resolve_image_paths
from posttrain.data.preference import completion_text, completion_token_ids
from posttrain.data.prompts import (
    DataError,
    HubSplits,
    encode_prompt,
    is_chat,
    read_rows,
    require_chat_template,
)
from posttrain.data.tasks import get_task
from posttrain.data.tasks.task import Task

SHAPES = {"text": ("text",), "prompt-completion": ("prompt", "completion"), "messages": ("messages",)}
"""Dataset shape -> its columns (TRL's names)."""


# --- checking ------------------------------------------------------------------------------


def dataset_shape(row: dict[str, Any], where: str) -> str:
    """The shape a row's columns name (``messages`` first, then ``prompt``/``completion``, then ``text``)."""
    if "messages" in row:
        return "messages"
    if "prompt" in row or "completion" in row:
        return "prompt-completion"
    if "text" in row:
        return "text"
    raise DataError(f"{where} has none of the SFT columns: text, prompt + completion, or messages "
                    f"(columns: {', '.join(row) or 'none'})")


def check_rows(rows: list[dict[str, Any]], source: str, *, completion_only_loss: bool) -> str:
    """Raise DataError at the first unusable row; return the dataset's shape (the first row's)."""
    if not rows:
        raise DataError(f"{source}: the dataset has no rows")
    shape = dataset_shape(rows[0], f"{source}: row 1")
    for number, row in enumerate(rows, start=1):
        where = f"{source}: row {number}"
        for name in SHAPES[shape]:
            if row.get(name) is None:
                raise DataError(f"{where} has no {name!r}: the dataset's first row makes it a {shape} dataset "
                                f"({' + '.join(SHAPES[shape])}; columns here: {', '.join(row)})")
        if shape == "text":
            _check_string(row, "text", where)
            if has_images(row):
                raise DataError(f"{where}: a text row cannot hold images; give prompt + completion or messages rows "
                                'whose user content has a {"type": "image"} part per image')
        elif shape == "messages":
            _check_messages(row, "messages", where)
            if completion_only_loss and not any(m["role"] == "assistant" for m in row["messages"]):
                raise DataError(f"{where}: 'messages' has no assistant message, so nothing is trained on "
                                "(completion_only_loss covers the assistant turns); drop the row or set "
                                "completion_only_loss false")
            if completion_only_loss and row["messages"][0]["role"] == "assistant":
                raise DataError(f"{where}: 'messages' starts with an assistant message; a conversation starts "
                                "with a system or user message that the assistant answers")
        else:
            chat = is_chat(row["prompt"])
            for name in ("prompt", "completion"):
                if name == "completion" and is_segments(row["completion"]):
                    _check_segments(row, where)
                elif chat:
                    _check_messages(row, name, where)
                else:
                    _check_string(row, name, where)
            if not is_segments(row["completion"]) and is_chat(row["completion"]) != chat:
                raise DataError(f"{where}: 'prompt' and 'completion' must both be strings or both be lists of "
                                "chat messages")
    return shape


def _check_string(row: dict[str, Any], name: str, where: str) -> None:
    value = row[name]
    if not isinstance(value, str):
        raise DataError(f"{where}: {name!r} must be a string, got {type(value).__name__} {value!r:.60}")
    if not value.strip():
        raise DataError(f"{where}: {name!r} is empty")


def is_segments(completion: Any) -> bool:
    """Whether a completion is given as segments: a list of ``{"text", "train"}`` dicts."""
    return isinstance(completion, list) and bool(completion) and isinstance(completion[0], dict) \
        and "text" in completion[0] and "role" not in completion[0]


def _check_segments(row: dict[str, Any], where: str) -> None:
    for k, segment in enumerate(row["completion"], start=1):
        if not (isinstance(segment, dict) and isinstance(segment.get("text"), str)
                and isinstance(segment.get("train"), bool) and set(segment) == {"text", "train"}):
            raise DataError(f"{where}: 'completion' segment {k} must be {{\"text\": string, \"train\": true or "
                            f"false}}, got {segment!r:.80}")
    if not any(segment["train"] and segment["text"] for segment in row["completion"]):
        raise DataError(f"{where}: 'completion' has no segment with train true and some text, so nothing is "
                        "trained on")


def _check_messages(row: dict[str, Any], name: str, where: str) -> None:
    value = row[name]
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: {name!r} must be a non-empty list of {{'role', 'content'}} messages, got "
                        f"{value!r:.60}")
    parts_allowed = has_images(row)  # a vision-language row: content may be a list of text and image parts
    for k, message in enumerate(value, start=1):
        content = message.get("content") if isinstance(message, dict) else None
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and (isinstance(content, str) or parts_allowed and _is_parts(content))):
            raise DataError(f"{where}: {name!r} message {k} must have a string 'role' and a string 'content'"
                            f"{' (or a list of text and image parts)' if parts_allowed else ''}, got {message!r:.80}")
    if parts_allowed and name == "messages":
        _check_image_conversation(value, where)


def _is_parts(content: Any) -> bool:
    return isinstance(content, list) and all(
        isinstance(p, dict) and (p.get("type") == "image" or p.get("type") == "text" and isinstance(p.get("text"), str))
        for p in content)


def _check_image_conversation(messages: list[dict[str, Any]], where: str) -> None:
    """A conversation with images trains on its one assistant turn, the last message (its prompt, images
    included, is encoded by the processor as one piece)."""
    assistants = [k for k, m in enumerate(messages, start=1) if m["role"] == "assistant"]
    if assistants != [len(messages)]:
        raise DataError(f"{where}: a conversation with images trains on one assistant turn, its last message; this "
                        f"one has assistant messages at {assistants or 'none'} of {len(messages)}: give a row per "
                        "assistant turn (the conversation up to it), or prompt + completion rows")


def demonstrations(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A built-in task's rows as prompt-completion demonstrations: the reference ``solution`` is the
    completion (the assistant's message after a chat prompt); the other columns are kept."""
    def completion(row: dict[str, Any]) -> Any:
        solution = row["solution"]
        if is_chat(row["prompt"]) and isinstance(solution, str):
            return [{"role": "assistant", "content": solution}]
        return solution

    return [{**row, "completion": completion(row)} for row in rows]


def load_rows(dataset: str | None, eval_dataset: str | None, task: str | None, *, completion_only_loss: bool,
              seed: int = 0, hub: HubSplits = HubSplits()) -> tuple[list[dict], list[dict], Task | None]:
    """Checked (train, held-out) rows of ``dataset`` (else the built-in ``task``'s demonstrations), and the
    task (None for a dataset). The held-out rows must have the training rows' shape."""
    if dataset is not None:
        train, source, built_in = read_rows(dataset, hub.config, hub.split), dataset, None
        test = read_rows(eval_dataset, hub.config, hub.eval_split) if eval_dataset else []
        resolve_image_paths(train, dataset_directory(dataset), dataset)
        if test:
            resolve_image_paths(test, dataset_directory(eval_dataset), eval_dataset)
    else:
        built_in = get_task(task, seed)
        if not built_in.train or "solution" not in built_in.train[0]:
            raise DataError(f"task {task}: its rows have no reference 'solution' to imitate; give demonstrations "
                            "with --dataset FILE (text, prompt + completion, or messages)")
        train, test, source = demonstrations(built_in.train), demonstrations(built_in.test), f"task {task}"
        eval_dataset = f"task {task} (held-out)"
    shape = check_rows(train, source, completion_only_loss=completion_only_loss)
    if test and check_rows(test, eval_dataset, completion_only_loss=completion_only_loss) != shape:
        raise DataError(f"{eval_dataset}: a {dataset_shape(test[0], eval_dataset)} dataset, but the training data "
                        f"({source}) are {shape}; give held-out rows of the same shape")
    return train, test, built_in


# --- tokenizing ----------------------------------------------------------------------------


@dataclass
class SFTExamples:
    """``N`` tokenized demonstrations."""

    rows: list[dict[str, Any]]  # [N] the source rows
    input_ids: list[Tensor]  # [N] each [L_i] long
    loss_mask: list[Tensor]  # [N] each [L_i] bool: the token is trained on (never token 0)
    truncated: Tensor  # [N] bool: the example was cut to max_length
    images: list[dict[str, Tensor] | None] | None = None  # [N] an example's image inputs (None: it has none)
    loss_tokens: Tensor = field(init=False)  # [N] long: each example's trained tokens

    def __post_init__(self) -> None:
        self.loss_tokens = torch.tensor([int(m.sum()) for m in self.loss_mask], dtype=torch.long)

    def __len__(self) -> int:
        return len(self.input_ids)

    def subset(self, keep: list[int]) -> "SFTExamples":
        return SFTExamples([self.rows[i] for i in keep], [self.input_ids[i] for i in keep],
                           [self.loss_mask[i] for i in keep], self.truncated[keep],
                           None if self.images is None else [self.images[i] for i in keep])


def pieces_to_tokens(tokenizer: Any, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[bool]]:
    """Token ids of text ``pieces`` (each tokenized alone, no special tokens) and whether each is trained on."""
    ids: list[int] = []
    trained: list[bool] = []
    for text, train in pieces:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
        ids += piece
        trained += [train] * len(piece)
    return ids, trained


def conversation_pieces(tokenizer: Any, messages: list[dict[str, str]], where: str,
                        completion_only_loss: bool) -> list[tuple[str, bool]]:
    """The rendered conversation cut into (text, trained) pieces: with ``completion_only_loss`` each
    assistant message's span (what rendering it adds after the generation prompt) is trained and the
    rest not; without, the whole conversation is one trained piece."""
    require_chat_template(tokenizer, where)

    def render(upto: int, generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(messages[:upto], add_generation_prompt=generation_prompt, tokenize=False)

    full = render(len(messages), False)
    if not completion_only_loss:
        return [(full, True)]
    pieces, done = [], 0  # done: characters of `full` already in pieces
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, after = render(k, True), render(k + 1, False)
        if not (after.startswith(before) and full.startswith(after) and len(before) >= done):
            raise DataError(f"{where}: the chat template renders the conversation before message {k + 1} (the "
                            "assistant's) differently once later messages follow, so its span cannot be found in "
                            "the whole conversation; give prompt + completion rows instead")
        pieces += [(full[done:len(before)], False), (full[len(before):len(after)], True)]
        done = len(after)
    return pieces + [(full[done:], False)]


def example_tokens(tokenizer: Any, row: dict[str, Any], shape: str, where: str,
                   completion_only_loss: bool, tools: Sequence[Callable] = ()) -> tuple[list[int], list[bool]]:
    """(token ids, trained flags) of one checked row, before truncation (the module docstring's rules)."""
    if shape == "text":
        ids = tokenizer(row["text"])["input_ids"]
        ids = ids if ids and ids[-1] == tokenizer.eos_token_id else ids + [tokenizer.eos_token_id]
        return ids, [True] * len(ids)
    if shape == "messages":
        return pieces_to_tokens(tokenizer, conversation_pieces(tokenizer, row["messages"], where, completion_only_loss))
    prompt = encode_prompt(tokenizer, row["prompt"], where, tools=tools).tolist()
    if is_segments(row["completion"]):  # the policy's turns and what a tool inserted between them
        ids, trained = pieces_to_tokens(tokenizer, [(seg["text"], seg["train"]) for seg in row["completion"]])
        return prompt + ids + [tokenizer.eos_token_id], [not completion_only_loss] * len(prompt) + trained + [True]
    text = completion_text(tokenizer, row["prompt"], row["completion"], where)
    if is_chat(row["prompt"]):  # the template writes the turn's end: no EOS added
        completion = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        completion = completion_token_ids(tokenizer, [text])[0]
    return prompt + completion, [not completion_only_loss] * len(prompt) + [True] * len(completion)


def encode(rows: list[dict[str, Any]], tokenizer: Any, *, completion_only_loss: bool, max_length: int,
           source: str = "data", tools: Sequence[Callable] = ()) -> SFTExamples:
    """Tokenize and truncate checked rows (the module docstring's rules); chat prompts get the ``tools``'
    descriptions as the online trainer renders them, so a warm start sees the prompts RL will."""
    shape = dataset_shape(rows[0], f"{source}: row 1")
    input_ids, loss_mask, truncated, images = [], [], [], []
    for number, row in enumerate(rows, start=1):
        where = f"{source}: row {number}"
        if has_images(row):
            ids, trained, inputs = image_example_tokens(tokenizer, row, where)
            if not any(trained[:max_length]):  # the cut would fall in the prompt, among its image tokens
                raise DataError(f"{where}: the prompt with its image tokens fills max_length ({max_length}); a prompt "
                                "with images is never cut, so raise --max-length or use smaller images")
        else:
            (ids, trained), inputs = example_tokens(tokenizer, row, shape, where, completion_only_loss, tools), None
        trained[0] = False  # nothing predicts the first token
        input_ids.append(torch.tensor(ids[:max_length], dtype=torch.long))
        loss_mask.append(torch.tensor(trained[:max_length], dtype=torch.bool))
        truncated.append(len(ids) > max_length)
        images.append(inputs)
    return SFTExamples(rows, input_ids, loss_mask, torch.tensor(truncated, dtype=torch.bool),
                       images if any(i is not None for i in images) else None)


def image_example_tokens(tokenizer: Any, row: dict[str, Any], where: str) -> tuple[list[int], list[bool], dict]:
    """(token ids, trained flags, image inputs) of a row with images: its prompt (the conversation before the last
    message, for ``messages``) encoded with its images by the processor and never trained on (image tokens are not
    scored, whatever ``completion_only_loss`` says), then its completion as the template writes it."""
    prompt, completion = (row["messages"][:-1], row["messages"][-1:]) if "messages" in row else \
        (row["prompt"], row["completion"])
    ids, inputs = encode_row_prompt(tokenizer, {**row, "prompt": prompt}, where)
    text = completion_text(tokenizer, prompt, completion, where)
    answer = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids.tolist() + answer, [False] * len(ids) + [True] * len(answer), inputs


# --- packing -------------------------------------------------------------------------------


def pack(lengths: list[int], capacity: int) -> list[list[int]]:
    """Best fit decreasing: the indices of ``lengths`` grouped into bins holding at most ``capacity``
    each, longest first; each item goes to the bin it fills most (a new bin when none has room).
    An item longer than ``capacity`` gets a bin of its own."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fits = [b for b in range(len(bins)) if room[b] >= lengths[i]]
        if fits:
            b = min(fits, key=lambda b: room[b])
            bins[b].append(i)
            room[b] -= lengths[i]
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def arrange(data: SFTExamples, idx: list[int], *, packing: bool, max_length: int) -> list[list[int]]:
    """The rows of examples ``idx``: packed into rows of at most ``max_length`` positions, or one each."""
    if not packing:
        return [[i] for i in idx]
    return [[idx[j] for j in row] for row in pack([len(data.input_ids[i]) - 1 for i in idx], max_length)]


@dataclass
class TokenRows:
    """Rows of examples ready for the model: position ``t`` of an example holds its token ``t`` and
    predicts its token ``t + 1``. Padding holds ``pad_id``, trains nothing, and its positions restart
    at 0 like an example's (its own segment: no real token attends to it).

    input_ids, position_ids, targets: [R, W] long; loss_mask: [R, W] bool (the target is trained on);
    example: [R, W] long, the position's example as an index into ``examples`` (-1: padding).
    """

    input_ids: Tensor
    position_ids: Tensor
    targets: Tensor
    loss_mask: Tensor
    example: Tensor
    examples: list[int]  # dataset indices of the rows' examples, in row order
    images: list[dict[str, Tensor]] | None = None  # [R] each row's image inputs (rows of one example each)

    def to(self, device: torch.device) -> "TokenRows":
        return TokenRows(self.input_ids.to(device), self.position_ids.to(device), self.targets.to(device),
                         self.loss_mask.to(device), self.example.to(device), self.examples, self.images)


def layout(data: SFTExamples, rows: list[list[int]], pad_id: int) -> TokenRows:
    """The tensors of ``rows`` (lists of example indices), right-padded to the longest row."""
    widths = [sum(len(data.input_ids[i]) - 1 for i in row) for row in rows]
    shape = (len(rows), max(max(widths), 1))
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    targets = torch.full(shape, pad_id, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    loss_mask = torch.zeros(shape, dtype=torch.bool)
    example = torch.full(shape, -1, dtype=torch.long)
    examples: list[int] = []
    for r, row in enumerate(rows):
        at = 0
        for i in row:
            ids, n = data.input_ids[i], len(data.input_ids[i]) - 1  # the last token predicts nothing
            input_ids[r, at:at + n], targets[r, at:at + n] = ids[:-1], ids[1:]
            loss_mask[r, at:at + n] = data.loss_mask[i][1:]
            position_ids[r, at:at + n] = torch.arange(n)
            example[r, at:at + n] = len(examples)
            examples.append(i)
            at += n
        position_ids[r, at:] = torch.arange(shape[1] - at)  # padding: a segment of its own
    images = None if data.images is None else [data.images[row[0]] or {} for row in rows]  # unpacked: one each
    return TokenRows(input_ids, position_ids, targets, loss_mask, example, examples, images)
